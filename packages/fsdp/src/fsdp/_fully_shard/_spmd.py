"""Parameters already ``DTensor`` s on the whole SPMD mesh: ``fully_shard(dp_mesh_dims=...)``.

[Note: full-SPMD meshes]
torch 2.13's newer way to combine FSDP with other parallelisms (torchtitan's
``full_dtensor`` backend): one mesh for everything, say ``(dp_shard, tp)``; the
model's parameters are ``DTensor`` s on that whole mesh, ``Replicate()`` on every
data-parallel dimension and whatever tensor parallelism made them on the others;
``fully_shard(block, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))``
names which dimensions are data parallel. It is the tensor-parallel composition of
``_tensor_parallel.py`` seen from the other side, and it reuses its three forms:

- *cut*: the parameter's local tensor (this rank's piece on the non-dp dimensions)
  is cut over the shard dimension exactly as a plain parameter; the collectives run
  over the dp groups only: the shard dimension's group (several shard names are
  flattened into one dimension, as torch does), and under HSDP the replicate
  dimension's;
- *sharded*: a ``DTensor`` on the whole mesh with the parameter's placements, the
  shard dimension's ``Replicate()`` turned into ``Shard(dim)``, or into
  ``_StridedShard(dim, split_factor=n)`` when later mesh dimensions cut the same
  tensor dimension into ``n`` pieces (the dp chunk is taken inside each of their
  pieces). With several shard names, the mesh has their flattened dimension in
  their place (HSDP: the replicate and shard dimensions, as torch's);
- *unsharded*: a ``DTensor`` on the whole mesh with the parameter's own placements
  (``Replicate()`` on the dp dimensions), so the model's ops meet the mesh they were
  written for.

The gradient keeps what autograd gave it on the dp dimensions (typically
``Partial``: each rank's contribution, which the reduce-scatter sums) and is
redistributed to the parameter's placements on the others before its local tensor
is reduced; torch's does the same, so the two divide and sum alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp._fully_shard._mesh import MeshInfo, mesh_info
from fsdp._fully_shard._tensor_parallel import TensorParallelSpec

__all__ = ["DataParallelMeshDims", "SpmdMesh", "spmd_mesh"]


@dataclass
class DataParallelMeshDims:
    """Which dimensions of a full SPMD mesh are data parallel (torch 2.13's type).

    ``shard``: the dimension name(s) ``fully_shard`` shards over (several are
    flattened into one, in mesh order); ``replicate``: the name(s) it replicates
    across (HSDP). At least one is set. torch's own ``DataParallelMeshDims`` works
    as well: ``fully_shard`` reads only these two fields.
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "At least one of shard or replicate must be set in DataParallelMeshDims: name "
                "the mesh dimension(s) fully_shard shards over, e.g. "
                "DataParallelMeshDims(shard='dp_shard')"
            )

    @property
    def shard_names(self) -> tuple[str, ...]:
        """``shard`` as a tuple of names (empty when unset)."""
        return _names(self.shard, "shard")

    @property
    def replicate_names(self) -> tuple[str, ...]:
        """``replicate`` as a tuple of names (empty when unset)."""
        return _names(self.replicate, "replicate")


def _names(value: Any, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else tuple(value)
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"DataParallelMeshDims.{field} must be a mesh dimension name or a tuple of them, "
            f"got {value!r}"
        )
    return names


@dataclass(frozen=True)
class SpmdMesh:
    """A ``fully_shard`` call's full mesh and its data-parallel dimensions."""

    mesh: DeviceMesh  # the full SPMD mesh the parameters live on
    shard_dims: tuple[int, ...]  # its dimensions fully_shard shards over (consecutive)
    replicate_dims: tuple[int, ...]  # its dimensions fully_shard replicates across (HSDP)
    dp: MeshInfo  # the groups the collectives run over (flattened / joined as torch's)

    @property
    def dp_dims(self) -> frozenset[int]:
        """Every data-parallel dimension of :attr:`mesh`."""
        return frozenset(self.shard_dims + self.replicate_dims)

    def check_param(self, name: str, param: Any) -> None:
        """Refuse a parameter that is not a ``DTensor`` on :attr:`mesh`, replicated over dp,
        in torch's words plus the fix."""
        if not isinstance(param, DTensor):
            raise ValueError(
                "When dp_mesh_dims is provided, all parameters must be DTensors on the full "
                f"SPMD mesh (e.g. via distribute_module). Got plain tensor for parameter "
                f"'{name}'. Distribute it on {self.mesh} (Replicate() on the data-parallel "
                "dimensions) before fully_shard, or call fully_shard without dp_mesh_dims and "
                "with the data-parallel mesh"
            )
        # Equal, not identical: DTensor's sharding cache hands out an equal mesh object of an
        # earlier op (torch's own check of identity fails spuriously after that).
        if param.device_mesh != self.mesh:
            raise ValueError(
                "Expected param's DTensor mesh to be the same mesh passed to fully_shard, but "
                f"got different mesh objects: parameter '{name}' lives on {param.device_mesh}, "
                f"fully_shard got {self.mesh}. Pass the mesh the model was distributed on"
            )
        names = self.mesh.mesh_dim_names or ()
        for i in sorted(self.dp_dims):
            placement = param.placements[i]
            if not isinstance(placement, Replicate):
                kind = "shard" if i in self.shard_dims else "replicate"
                raise ValueError(
                    f"Expected Replicate() on DP {kind} dim '{names[i]}' (index {i}) but got "
                    f"{placement} (parameter '{name}'): fully_shard does the data-parallel "
                    "sharding itself; distribute the parameter with Replicate() there"
                )
        for i, placement in enumerate(param.placements):
            if i not in self.dp_dims and type(placement) not in (Shard, Replicate):
                raise NotImplementedError(
                    f"parameter '{name}' has {placement} on mesh dim '{names[i]}': fully_shard "
                    "composes with Shard(dim) or Replicate() on the other dimensions; "
                    "redistribute it to one of those first"
                )
        if not param._local_tensor.is_contiguous():
            raise NotImplementedError(
                f"FSDP does not support non-contiguous parameters yet: {name}'s local tensor "
                f"has stride {param._local_tensor.stride()}; make it contiguous first"
            )

    def spec(self, param: DTensor) -> TensorParallelSpec:
        """``param``'s unsharded form: its own mesh and placements, the gradient's dp
        placements kept (see the note)."""
        return TensorParallelSpec(
            mesh=self.mesh,
            placements=tuple(param.placements),
            shape=param.shape,
            stride=tuple(param.stride()),
            keep_grad_dims=self.dp_dims,
        )

    def sharded_form(
        self, spec: TensorParallelSpec, shard: Shard
    ) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        """The sharded ``DTensor``'s mesh and placements when the local tensor is cut along
        ``shard.dim`` over the shard dimension(s)."""
        placements = list(spec.placements)
        for i in self.shard_dims:
            split = 1
            for j in range(i + 1, self.mesh.ndim):
                later = spec.placements[j]
                if isinstance(later, Shard) and later.dim == shard.dim:
                    split *= self.mesh.size(j)
            placements[i] = _StridedShard(shard.dim, split_factor=split) if split > 1 else shard
        if len(self.shard_dims) == 1:
            return self.mesh, tuple(placements)
        # Several shard dimensions: their flattened one (HSDP: the joined replicate and
        # shard mesh) stands where the first of them was.
        names = self.mesh.mesh_dim_names or ()
        hsdp = self.dp.replicate_group is not None
        meshes: list[DeviceMesh] = []
        out: list[Placement] = []
        for i in range(self.mesh.ndim):
            if i == self.shard_dims[0]:
                meshes.append(self.dp.mesh)
                out.extend((Replicate(), placements[i]) if hsdp else (placements[i],))
            elif i in self.shard_dims or (hsdp and i in self.replicate_dims):
                continue
            else:
                meshes.append(self.mesh[names[i]])
                out.append(placements[i])
        concatenate: Any = DeviceMesh._concatenate  # private in torch 2.13: torch's FSDP2 uses it
        joined: DeviceMesh = concatenate(meshes)
        return joined, tuple(out)


def spmd_mesh(mesh: Any, dims: Any) -> SpmdMesh:
    """Check ``mesh`` and ``dims`` (torch's errors, with the fix) and make the dp groups."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            "fully_shard(dp_mesh_dims=...) needs mesh= the full SPMD DeviceMesh the parameters "
            f"are distributed on, got {type(mesh).__name__}"
        )
    shard_names = _names(getattr(dims, "shard", None), "shard")
    replicate_names = _names(getattr(dims, "replicate", None), "replicate")
    if not shard_names and not replicate_names:
        raise ValueError(
            "At least one of shard or replicate must be set in dp_mesh_dims: e.g. "
            "DataParallelMeshDims(shard='dp_shard')"
        )
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "mesh must have mesh_dim_names when dp_mesh_dims is provided: build it with "
            "init_device_mesh(device, shape, mesh_dim_names=(...))"
        )
    for name in (*shard_names, *replicate_names):
        if name not in names:
            raise ValueError(
                f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {names}: "
                "dp_mesh_dims names dimensions of the mesh passed to fully_shard"
            )
    if set(shard_names) & set(replicate_names) or len(set(shard_names)) != len(shard_names):
        raise ValueError(
            f"dp_mesh_dims names a mesh dimension twice (shard={shard_names}, "
            f"replicate={replicate_names}): each dimension is either sharded or replicated over"
        )
    if not shard_names:
        raise NotImplementedError(
            f"dp_mesh_dims with replicate={replicate_names} and no shard dimension (pure data "
            "parallelism on an SPMD mesh) is not supported by this implementation: name a "
            "shard dimension (FSDP or HSDP), or use torch's replicate() for DDP"
        )
    shard_dims = tuple(names.index(n) for n in shard_names)
    if list(shard_dims) != list(range(shard_dims[0], shard_dims[0] + len(shard_dims))):
        raise ValueError(
            f"dp_mesh_dims shard={shard_names} must name consecutive mesh dimensions in mesh "
            f"order ({names}): they are flattened into one shard dimension"
        )
    shard_mesh = _submesh(mesh, shard_names)
    if replicate_names:
        concatenate: Any = DeviceMesh._concatenate
        dp_mesh: DeviceMesh = concatenate([_submesh(mesh, replicate_names), shard_mesh])
    else:
        dp_mesh = shard_mesh
    return SpmdMesh(
        mesh=mesh,
        shard_dims=shard_dims,
        replicate_dims=tuple(names.index(n) for n in replicate_names),
        dp=mesh_info(dp_mesh),
    )


def _submesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The 1-D mesh over ``names``: the dimension itself, or their flattened product."""
    if len(names) == 1:
        return mesh[names[0]]
    sliced: Any = mesh[names]
    flat: DeviceMesh = sliced._flatten("_".join(names))  # torch's name for the same dimension
    return flat
