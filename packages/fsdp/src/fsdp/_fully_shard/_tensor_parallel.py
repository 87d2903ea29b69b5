"""Parameters already ``DTensor`` s on another mesh: ``fully_shard`` over tensor parallelism.

[Note: fully_shard over tensor parallelism]
torchtitan's 2-D recipe: one mesh ``(dp, tp)``;
``parallelize_module(block, mesh["tp"], plan)`` makes a block's linear weights
``DTensor`` s on the tp mesh (``Shard(0)`` for ``ColwiseParallel``, ``Shard(1)``
for ``RowwiseParallel``, ``Replicate()`` for the latter's bias), and then
``fully_shard(block, mesh=mesh["dp"])`` shards them over dp. As in torch's FSDP2,
such a parameter has three forms:

- *cut*: what ``fully_shard`` cuts over dp is the parameter's tp-local tensor
  (this rank's tp piece, possibly of another shape on each tp rank), exactly as
  it cuts a plain parameter: its :class:`~flatparam.ChunkLayout` entry has the
  local shape, and every collective of ``fully_shard`` runs over dp only;
- *sharded*: a ``DTensor`` of the parameter's global shape on the mesh
  ``(dp..., tp...)`` (``DeviceMesh._concatenate`` of the two, so both must be
  slices of one root mesh) with placements ``(dp placement, *tp placements)``
  (``(Replicate(), dp placement, *tp placements)`` under HSDP), whose local
  tensor is this rank's dp chunk of its tp piece. When the dp cut and a tp
  ``Shard`` fall on the same dimension, the dp placement is
  ``_StridedShard(dim, split_factor=tp shards of dim)``: the dp chunk is taken
  inside each tp piece, not of the whole dimension as ``Shard(dim)`` first on
  the mesh would mean;
- *unsharded*: a ``DTensor`` on the tp mesh with the tp placements whose local
  tensor is the all-gathered tp piece, so the module's tp hooks and ops see the
  parameter they saw before ``fully_shard``.

The gradient of the unsharded ``DTensor`` (redistributed to the tp placements
should autograd have left it otherwise) gives its local tensor to the
reduce-scatter over dp, and the reduced chunk becomes the sharded gradient,
with the sharded parameter's mesh and placements. The tp collectives stay
inside ``DTensor``'s ops; ``fully_shard`` never communicates over tp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from fsdp._fully_shard._mesh import MeshInfo

__all__ = [
    "MeshComposer",
    "MeshCompositionError",
    "TensorParallelSpec",
    "check_dtensor_param",
    "wrap_local",
]


def wrap_local(
    local: Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: torch.Size,
    stride: tuple[int, ...],
) -> DTensor:
    """``local`` as this rank's part of a ``DTensor`` of ``shape`` and ``stride``, sharing
    its memory: no check and no communication (the caller knows the layout)."""
    with torch.no_grad():
        return DTensor.from_local(
            local, mesh, tuple(placements), run_check=False, shape=shape, stride=stride
        )


class MeshCompositionError(ValueError, RuntimeError):
    """``fully_shard``'s mesh cannot be joined to a parameter's tensor-parallel mesh.

    A ``ValueError`` (a wrong argument), and the ``RuntimeError`` torch's
    ``fully_shard`` raises for the same meshes (from ``DeviceMesh``), so code
    written against torch catches it too.
    """


@dataclass(frozen=True)
class TensorParallelSpec:
    """A parameter's ``DTensor`` layout before ``fully_shard``: its unsharded form."""

    mesh: DeviceMesh  # the tp mesh (1-D, or 2-D for EP + TP as torch allows)
    placements: tuple[Placement, ...]  # Shard(d) or Replicate() per tp mesh dim
    shape: torch.Size  # global shape
    stride: tuple[int, ...]  # global stride (contiguous)
    # Mesh dims whose gradient placement is kept as autograd left it (a full SPMD mesh's
    # data-parallel dims, reduced by fully_shard itself: [Note: full-SPMD meshes]).
    keep_grad_dims: frozenset[int] = frozenset()

    def shards_along(self, dim: int) -> int:
        """How many tp pieces dimension ``dim`` is cut into (1: not cut by tp)."""
        count = 1
        for i, placement in enumerate(self.placements):
            if isinstance(placement, Shard) and placement.dim == dim:
                count *= self.mesh.size(i)
        return count

    def to_dtensor(self, local: Tensor) -> DTensor:
        """``local`` (a gathered tp piece) as the unsharded ``DTensor``, sharing its memory."""
        return wrap_local(local, self.mesh, self.placements, self.shape, self.stride)

    def local_grad(self, grad: Tensor) -> Tensor:
        """The tp-local tensor of the unsharded parameter's gradient, in the tp placements.

        Autograd gives a ``DTensor`` gradient the parameter's placements in
        every plan we know of; a ``Partial`` one (a custom op's) is reduced
        over tp first, as torch's FSDP2 does, so the dp reduction sums
        complete tp pieces.
        """
        wait = getattr(grad, "wait", None)
        if not isinstance(grad, DTensor) and callable(wait):
            grad = wait()  # an AsyncCollectiveTensor
        if not isinstance(grad, DTensor):
            raise AssertionError(
                f"the gradient of a tensor-parallel parameter is a {type(grad).__name__}, "
                "expected a DTensor on the parameter's tp mesh"
            )
        target = tuple(
            grad.placements[i] if i in self.keep_grad_dims else placement
            for i, placement in enumerate(self.placements)
        )
        if tuple(grad.placements) != target:
            grad = grad.redistribute(self.mesh, target)
        local: Tensor = grad._local_tensor
        wait = getattr(local, "wait", None)
        if callable(wait) and type(local) is not Tensor:
            local = wait()
        return local


def check_dtensor_param(name: str, param: DTensor) -> None:
    """Refuse a ``DTensor`` parameter ``fully_shard`` cannot take over, naming the fix."""
    placements = tuple(param.placements)
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(
            f"parameter {name!r} is a DTensor with a Partial placement {placements}: a "
            "parameter holds pending sums on its tp ranks, which fully_shard cannot shard. "
            "Reduce it first (param = nn.Parameter(param.redistribute(placements=[Replicate() "
            "if isinstance(p, Partial) else p for p in param.placements]))) or give the "
            "parallel plan Shard/Replicate parameters"
        )
    other = [p for p in placements if type(p) not in (Shard, Replicate)]
    if other:
        raise NotImplementedError(
            f"parameter {name!r} is a DTensor with placements {placements}: fully_shard "
            "composes with tensor/expert parallelism whose parameters are Shard(dim) or "
            f"Replicate() on their mesh, not {other[0]!r} (is it already sharded by another "
            "fully_shard? apply fully_shard once per parameter)"
        )
    if param.device_mesh.ndim > 2:
        raise NotImplementedError(
            f"parameter {name!r} is a DTensor on a {param.device_mesh.ndim}-D mesh: fully_shard "
            "composes with a 1-D tensor-parallel mesh or a 2-D (expert, tensor) one, as "
            "torch's; pass the parameters' model-parallel mesh as at most 2 dimensions"
        )
    if param.device_mesh.mesh_dim_names is None:
        raise ValueError(
            f"parameter {name!r} is a DTensor on a mesh without mesh_dim_names: fully_shard "
            "combines it with its data-parallel mesh by name. Build one mesh with names, e.g. "
            "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), parallelize "
            "over mesh['tp'] and pass mesh=mesh['dp'] to fully_shard"
        )
    if not param._local_tensor.is_contiguous():
        raise NotImplementedError(
            f"FSDP does not support non-contiguous parameters yet: {name}'s local tensor has "
            f"shape {tuple(param._local_tensor.shape)} and stride "
            f"{param._local_tensor.stride()}; make it contiguous before fully_shard"
        )


class MeshComposer:
    """The meshes of one ``fully_shard`` call's ``DTensor`` parameters: each tp mesh
    joined to the dp mesh once (see [Note: fully_shard over tensor parallelism])."""

    def __init__(self, dp: MeshInfo) -> None:
        self.dp = dp
        self._joined: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}  # id(tp) -> (tp, dp+tp)

    def spec(self, param: DTensor) -> TensorParallelSpec:
        """``param``'s layout before ``fully_shard`` (its unsharded form)."""
        return TensorParallelSpec(
            mesh=param.device_mesh,
            placements=tuple(param.placements),
            shape=param.shape,
            stride=tuple(param.stride()),
        )

    def sharded_form(
        self, name: str, tp: TensorParallelSpec, shard: Shard
    ) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        """The sharded ``DTensor``'s mesh and placements for a tp parameter cut over dp
        along ``shard.dim`` of its tp piece."""
        mesh = self._join(name, tp.mesh)
        split = tp.shards_along(shard.dim)
        dp_placement: Placement = (
            _StridedShard(shard.dim, split_factor=split) if split > 1 else shard
        )
        return mesh, (*self.dp.placements(dp_placement), *tp.placements)

    def _join(self, name: str, tp_mesh: DeviceMesh) -> DeviceMesh:
        known = self._joined.get(id(tp_mesh))
        if known is not None and known[0] is tp_mesh:
            return known[1]
        dp_mesh = self.dp.mesh
        if tp_mesh.device_type != dp_mesh.device_type:
            raise MeshCompositionError(
                f"parameter {name!r} is a DTensor on a {tp_mesh.device_type!r} mesh and "
                f"fully_shard's mesh is {dp_mesh.device_type!r}: both meshes must be slices of "
                f"one mesh on one device type: {_RECIPE}"
            )
        if dp_mesh.mesh_dim_names is None:
            raise MeshCompositionError(
                f"parameter {name!r} is a DTensor on the mesh {tp_mesh}, and fully_shard's mesh "
                f"{dp_mesh} has no mesh_dim_names, so the two cannot be joined: build one mesh "
                f"with names and slice both from it: {_RECIPE}"
            )
        joined = _concatenate(name, dp_mesh, tp_mesh)
        self._joined[id(tp_mesh)] = (tp_mesh, joined)
        return joined


_RECIPE = (
    "mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')); "
    "parallelize_module(model, mesh['tp'], plan); fully_shard(module, mesh=mesh['dp'])"
)


def _concatenate(name: str, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``(dp dims..., tp dims...)`` over the ranks of both, from their root mesh.

    Two mistakes stop it, each named with its fix: a ``fully_shard`` mesh that
    shares ranks with the tp mesh (the tp mesh itself, or the whole ``(dp, tp)``
    mesh passed instead of its dp slice), found from the meshes' public rank
    tensors, and meshes sliced from two different roots, which only
    ``DeviceMesh._concatenate`` itself can tell.
    """
    shared = set(dp_mesh.mesh.flatten().tolist()) & set(tp_mesh.mesh.flatten().tolist())
    if len(shared) > 1:
        raise MeshCompositionError(
            f"parameter {name!r} is a DTensor on the model-parallel mesh {tp_mesh}, which "
            f"shares ranks {sorted(shared)} with fully_shard's mesh {dp_mesh}: fully_shard "
            "shards over data-parallel ranks, a mesh dimension the parameter is not already "
            "placed on. Pass the data-parallel slice of the mesh the model was parallelised "
            f"from: {_RECIPE}"
        )
    concatenate: Any = DeviceMesh._concatenate  # private in torch 2.13: what torch's FSDP2 uses
    try:
        joined: DeviceMesh = concatenate([dp_mesh, tp_mesh])
    except RuntimeError as exc:
        raise MeshCompositionError(
            f"parameter {name!r} is a DTensor on {tp_mesh}, which was sliced from a different "
            f"root mesh than fully_shard's mesh {dp_mesh} (DeviceMesh: {exc}), so no mesh "
            "holds both and the sharded parameter has nowhere to live. Slice both from one "
            f"mesh built once with init_device_mesh: {_RECIPE}"
        ) from exc
    return joined
