"""A parameter sharded over its own mesh: ``shard_placement_fn`` returning a
``ShardPlacementResult`` (expert parallelism).

[Note: parameters on their own mesh]
torchtitan's MoE recipe shards a block's routed experts over fewer ranks than the
rest of the block: with expert parallelism 2 on 4 ranks, each rank holds half the
experts (``DTensor`` s on the ``ep`` mesh), and only the 2 ranks holding the same
experts can share their shards, so the expert weights are cut over the
"expert data parallel" mesh (2 ranks) while attention and norms are cut over dp
(4 ranks), all in one ``fully_shard(block, shard_placement_fn=...)`` call. The
function returns ``ShardPlacementResult(placement, mesh_info)`` for such a
parameter. Parameters whose groups differ form parts of their own in the block's
group (one all-gather and one reduction per mesh, the hooks unchanged): a part
is cut over its own mesh, divides its gradients by that mesh's size, and under an
int ``reshard_after_forward`` keeps a copy over as many ranks of its own mesh.
Parameters whose mesh has the very groups of the call's mesh share its parts.

``mesh_info`` is read by its fields, so torch's ``FSDPMeshInfo`` /
``HSDPMeshInfo`` (what torchtitan builds) work as they are; ours also takes a
``DeviceMesh`` there. Under torchtitan's ``full_dtensor`` backend the experts are
``DTensor`` s on a mesh of their own, ``(efsdp, ep)``, and their mesh info comes from
torch's ``_get_mesh_info(sparse_mesh, DataParallelMeshDims(shard="efsdp"))``: it carries
``dp_mesh_dims`` and ``spmd_mesh``, and such a parameter is sharded as on a full SPMD
mesh ([Note: full-SPMD meshes]), over that mesh's dp dimensions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from fsdp._fully_shard._mesh import MeshInfo, mesh_info, where
from fsdp._fully_shard._spmd import SpmdMesh, spmd_mesh
from fsdp._fully_shard._tensor_parallel import MeshComposer

__all__ = ["PlacementResolver", "ShardPlacementResult"]


@dataclass
class ShardPlacementResult:
    """What ``shard_placement_fn`` may return for a parameter on a mesh of its own.

    ``placement``: the ``Shard(dim)`` to cut it along (``None``: dim 0);
    ``mesh_info``: the mesh to cut it over, a ``DeviceMesh`` (1-D: shard over it,
    2-D ``(replicate, shard)``: HSDP) or torch's ``FSDPMeshInfo`` / ``HSDPMeshInfo``.
    """

    placement: Shard | None
    mesh_info: Any


class PlacementResolver:
    """One ``fully_shard`` call's answers from ``shard_placement_fn``: each parameter's cut
    and mesh, with one :class:`MeshInfo` (and one tensor-parallel composer) per set of groups."""

    def __init__(
        self,
        fn: Callable[[nn.Parameter], Any] | None,
        info: MeshInfo,
        spmd: SpmdMesh | None = None,
    ) -> None:
        self.fn = fn
        self.info = info
        self.spmd = spmd
        self._infos: dict[tuple[int, int], MeshInfo] = {_groups(info): info}
        self._composers: dict[int, MeshComposer] = {}
        self._spmds: dict[tuple[Any, ...], tuple[DeviceMesh, SpmdMesh]] = {}

    def resolve(
        self, name: str, param: nn.Parameter
    ) -> tuple[Shard | None, MeshInfo, SpmdMesh | None]:
        """``param``'s requested placement (``None``: dim 0), the groups to cut it over, and
        the full SPMD mesh it lives on when it is one ([Note: full-SPMD meshes])."""
        result = None if self.fn is None else self.fn(param)
        if result is None or isinstance(result, Shard):
            return result, self.info, self.spmd
        if not (hasattr(result, "placement") and hasattr(result, "mesh_info")):
            raise ValueError(
                f"Invalid shard_placement_fn result: {result!r} (parameter {name!r}, "
                f"{where()}); return a Shard(dim), None, or a "
                "ShardPlacementResult(placement, mesh_info)"
            )
        given = result.mesh_info
        dims = getattr(given, "dp_mesh_dims", None)
        if dims is not None:  # torch's mesh info of a full SPMD mesh (_get_mesh_info(mesh, dims))
            spmd = self._spmd(name, getattr(given, "spmd_mesh", None), dims)
            return result.placement, self._infos.setdefault(_groups(spmd.dp), spmd.dp), spmd
        if self.spmd is not None:
            raise NotImplementedError(
                f"shard_placement_fn returned a mesh_info without dp_mesh_dims for {name!r} "
                f"({where()}) in a fully_shard call with dp_mesh_dims: not supported by this "
                "implementation; build it for the parameter's full SPMD mesh, as torch's "
                "_get_mesh_info(mesh, DataParallelMeshDims(...)) does"
            )
        return result.placement, self._info(name, given), None

    def composer(self, info: MeshInfo) -> MeshComposer:
        """The tensor-parallel composer joining parameters' meshes to ``info``'s mesh."""
        composer = self._composers.get(id(info))
        if composer is None:
            composer = self._composers[id(info)] = MeshComposer(info)
        return composer

    def _spmd(self, name: str, full: Any, dims: Any) -> SpmdMesh:
        if not isinstance(full, DeviceMesh):
            raise NotImplementedError(
                f"shard_placement_fn's mesh_info for {name!r} ({where()}) names dp_mesh_dims "
                "but holds no full SPMD mesh (spmd_mesh); build it with torch's "
                "_get_mesh_info(mesh, DataParallelMeshDims(...))"
            )
        key = (id(full), repr(getattr(dims, "shard", None)), repr(getattr(dims, "replicate", None)))
        known = self._spmds.get(key)
        if known is None or known[0] is not full:
            known = self._spmds[key] = (full, spmd_mesh(full, dims))
        return known[1]

    def _info(self, name: str, given: Any) -> MeshInfo:
        mesh = given if isinstance(given, DeviceMesh) else _torch_mesh(name, given)
        info = mesh_info(mesh)
        return self._infos.setdefault(_groups(info), info)


def _groups(info: MeshInfo) -> tuple[int, int]:
    return id(info.shard_group), id(info.replicate_group)


def _torch_mesh(name: str, given: Any) -> DeviceMesh:
    """The mesh of a torch ``FSDPMeshInfo`` / ``HSDPMeshInfo``, checked to be laid out as
    ours reads a mesh (1-D: shard; 2-D: replicate then shard)."""
    mesh = getattr(given, "mesh", None)
    shard_dim = getattr(given, "shard_mesh_dim", None)
    replicate_dim = getattr(given, "replicate_mesh_dim", None)
    if not isinstance(mesh, DeviceMesh) or shard_dim is None:
        raise NotImplementedError(
            f"shard_placement_fn returned a ShardPlacementResult for {name!r} ({where()}) "
            f"whose mesh_info is {type(given).__name__}: a mesh to shard over is needed "
            "(torch's FSDPMeshInfo or HSDPMeshInfo, or a DeviceMesh); replication alone "
            "(DDPMeshInfo) is not supported by this implementation"
        )
    layout = (shard_dim, replicate_dim)
    if (mesh.ndim, layout) not in ((1, (0, None)), (2, (1, 0))):
        raise NotImplementedError(
            f"shard_placement_fn's mesh_info for {name!r} ({where()}) shards over dim "
            f"{shard_dim} and replicates over dim {replicate_dim} of a {mesh.ndim}-D mesh: this "
            "implementation takes a 1-D mesh to shard over, or a 2-D one that replicates over "
            "dim 0 and shards over dim 1 (torch's HSDP layout); slice or reorder the mesh so"
        )
    return mesh
