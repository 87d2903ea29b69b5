"""The SHARDED layout: each original parameter cut into ``Shard(0)`` chunks, as DTensors.

ckpt's SHARDED model and optimizer state dicts hold every original parameter of an
fsdp unit as this rank's dimension-0 chunk, a ``DTensor``; this module is that
format: the chunk bounds (``chunk_bounds``, ``chunk_shape``, and ``chunk_intervals``
where each chunk lies in its unit's flat tensor), a full tensor to this rank's chunk
(``to_dtensor``), a chunk to a DTensor (``chunk_dtensor``, over ``mesh_for`` the
unit's group), the test whether a loaded DTensor is chunked that way
(``is_chunked_like_ours``) and any value back to a full tensor (``full_value``).
What it is made from (a unit's parameters, shapes, flat ranges and group) comes
from fsdp's public :mod:`fsdp.units`; ``_wrappers/fsdp1_unit_exchange.py`` moves flat shards to
chunks and back without gathering a unit.

[Note: SHARDED is chunked per original parameter]
A rank's flat shard starts wherever ``rank * shard_numel`` falls, usually in the middle
of a parameter, so the flat shards are not a sharding of the original parameters that a
``DTensor`` can describe (DTensor's ``Shard(0)`` is ``torch.chunk`` along dimension 0).
torch's FSDP1 has the same problem and solves it the same way: for a sharded state
dict each unit is gathered (one unit at a time) and every original parameter is cut
into ``world_size`` chunks of ``ceil(dim0 / world_size)`` rows. That is what
torch's FSDP1, ``fully_shard`` (FSDP2) and DCP all understand, so checkpoints move
between them and load at any world size; DCP reshards by row offsets on load.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp.units import UnitParam

__all__ = [
    "Interval",
    "chunk_bounds",
    "chunk_dtensor",
    "chunk_intervals",
    "chunk_shape",
    "full_value",
    "is_chunked_like_ours",
    "mesh_for",
    "to_dtensor",
]


def chunk_bounds(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` rows of ``rank``'s chunk: ``torch.chunk``/``Shard(0)`` semantics.

    Every rank gets ``ceil(dim0 / world_size)`` rows except at the end, where chunks
    may be shorter or empty (``dim0=5`` over 4 ranks: 2, 2, 1, 0 rows).
    """
    size = math.ceil(dim0 / world_size) if dim0 else 0
    start = min(rank * size, dim0)
    return start, min(start + size, dim0)


Interval = tuple[int, int]  # [start, end) in the unpadded flat tensor


def chunk_shape(shape: torch.Size, world_size: int, rank: int) -> torch.Size:
    """Shape of ``rank``'s ``Shard(0)`` chunk of a tensor of ``shape`` (0-dim: itself)."""
    if len(shape) == 0:
        return shape
    start, end = chunk_bounds(shape[0], world_size, rank)
    return torch.Size((end - start, *shape[1:]))


def chunk_intervals(
    entries: Sequence[UnitParam], world_size: int, rank: int, scalars_everywhere: bool
) -> list[Interval]:
    """``rank``'s chunk of each parameter as an interval of its unit's flat tensor, in
    parameter order (a chunk is a run of whole rows, so it is contiguous there).

    A 0-dim parameter is replicated, not chunked: every rank needs it when chunks are
    made (``scalars_everywhere``), and only rank 0 supplies it when a shard is rebuilt.
    """
    out: list[Interval] = []
    for e in entries:
        if len(e.shape) == 0:
            out.append((e.start, e.end) if scalars_everywhere or rank == 0 else (e.end, e.end))
            continue
        row = math.prod(e.shape[1:])
        start, end = chunk_bounds(e.shape[0], world_size, rank)
        out.append((e.start + start * row, e.start + end * row))
    return out


_meshes: dict[tuple[int, str], DeviceMesh] = {}


def mesh_for(group: Any, device_type: str) -> DeviceMesh:
    """A 1-D DeviceMesh over ``group`` (cached: a mesh is made once per group and device)."""
    key = (id(group), device_type)
    mesh = _meshes.get(key)
    if mesh is None:
        mesh = DeviceMesh.from_group(group, device_type)
        _meshes[key] = mesh
    return mesh


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride: list[int] = []
    acc = 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


def to_dtensor(full: Tensor, group: Any, device: torch.device) -> DTensor:
    """This rank's dimension-0 chunk of ``full`` as a DTensor (a copy on ``device``).

    See [Note: SHARDED is chunked per original parameter]. A 0-dim tensor is replicated.
    No communication: every rank already holds ``full``.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if full.dim() == 0:
        return chunk_dtensor(full.detach().to(device, copy=True), full.shape, group)
    start, end = chunk_bounds(full.shape[0], world_size, rank)
    return chunk_dtensor(full.detach()[start:end].to(device, copy=True), full.shape, group)


def chunk_dtensor(local: Tensor, shape: torch.Size, group: Any) -> DTensor:
    """``local``, this rank's dimension-0 chunk of a tensor of ``shape``, as a DTensor.

    The mesh is the group's on ``local``'s device; a 0-dim ``local`` is replicated.
    ``local`` is used as is (no copy).
    """
    mesh = mesh_for(group, local.device.type)
    if len(shape) == 0:
        return DTensor.from_local(local, mesh, [Replicate()], run_check=False)
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=shape, stride=_contiguous_stride(shape)
    )


def is_chunked_like_ours(value: Any, group: Any) -> bool:
    """Whether ``value`` is a DTensor whose local tensor is this rank's chunk as
    :func:`chunk_dtensor` makes it: a 1-D mesh over ``group``'s ranks in order,
    ``Shard(0)`` (``Replicate()`` when 0-dim). Decided from global metadata only, so
    every rank decides alike."""
    if not isinstance(value, DTensor) or value.device_mesh.ndim != 1:
        return False
    placement = Replicate() if value.dim() == 0 else Shard(0)
    if tuple(value.placements) != (placement,):
        return False
    ranks = value.device_mesh.mesh.flatten().tolist()
    return bool(ranks == dist.get_process_group_ranks(group))


def full_value(value: Any) -> Tensor:
    """The full tensor behind a state-dict value: a DTensor is gathered (a collective)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, Tensor):
        return value
    raise TypeError(f"expected a tensor or DTensor in the state dict, got {type(value).__name__}")
