"""What ckpt needs to know about an fsdp model: its units, their parameters, their shards.

Every state-dict type and the optimizer state dicts are built from the same three
facts about each FSDP instance ("unit"): the FQN prefix of its wrapped module in the
unwrapped model, the original parameters its FlatParameter holds (name, shape,
``[start, end)`` in the flat tensor), and how the flat tensor is split over ranks
(:class:`flatparam.ShardLayout`). This module reads them off an fsdp model and
provides the two conversions everything else is made of:

* flat shard -> full flat tensor (``gather_flat``: one all-gather per unit), split into
  the original parameters (``param_views``);
* one original parameter's full tensor -> this rank's ``DTensor`` chunk on
  dimension 0 (``to_dtensor``), and any DTensor/tensor -> the full tensor
  (``full_value``).

The model state dicts skip the full tensors where they can: ``_unit_exchange.py``
moves flat shards to chunks and back directly.

[Note: SHARDED is chunked per original parameter]
A rank's flat shard starts wherever ``rank * shard_numel`` falls, usually in the middle
of a parameter, so the flat shards are not a sharding of the original parameters that a
``DTensor`` can describe (DTensor's ``Shard(0)`` is ``torch.chunk`` along dimension 0).
torch's FSDP1 has the same problem and solves it the same way: for a sharded state
dict each unit is gathered (one unit at a time) and every original parameter is cut
into ``world_size`` chunks of ``ceil(dim0 / world_size)`` rows. That is what
torch's FSDP1, ``fully_shard`` (FSDP2) and DCP all understand, so checkpoints move
between them and load at any world size; DCP reshards by row offsets on load.

The functions keep working once ``use_orig_params=True`` lands: they only use the
unit's FlatParameter, its ``_param_infos`` and its layout, which both modes share.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from flatparam import unpad_flat
from fsdp._collectives import all_gather_into
from fsdp._common import FSDP_PREFIX, clean_fqn
from fsdp._flat_param_unit import FlatParamUnit
from fsdp._fsdp_state import FSDPState, get_fsdp_state

__all__ = [
    "ParamEntry",
    "UnitView",
    "chunk_bounds",
    "chunk_dtensor",
    "full_value",
    "gather_flat",
    "is_chunked_like_ours",
    "mesh_for",
    "param_entries",
    "to_dtensor",
    "units_of",
]


@dataclass(frozen=True)
class ParamEntry:
    """One original parameter inside a unit's flat tensor: ``flat[start:end].view(shape)``."""

    name: str  # FQN relative to the FSDP instance (its wrapped module), unwrapped
    aliases: tuple[str, ...]  # other names of the same parameter (tied weights)
    shape: torch.Size
    start: int  # offset in the unpadded flat tensor, inclusive
    end: int  # exclusive


@dataclass(frozen=True)
class UnitView:
    """One FSDP instance with a unit, as ckpt sees it."""

    prefix: str  # FQN prefix of the instance in the unwrapped model ("" or "blocks.0.")
    state: FSDPState
    unit: FlatParamUnit
    entries: tuple[ParamEntry, ...]

    def fqns(self) -> list[str]:
        """Unwrapped FQNs of the unit's parameters, in flat order (aliases not included)."""
        return [self.prefix + e.name for e in self.entries]


def _join(module_name: str, name: str) -> str:
    return clean_fqn(f"{module_name}.{name}" if module_name else name)


def param_entries(unit: FlatParamUnit) -> tuple[ParamEntry, ...]:
    """The original parameters of ``unit`` in flat order, with their tied aliases."""
    flat = unit.flat_param
    infos = flat._param_infos
    aliases: dict[tuple[int, str], list[str]] = {}
    for s in flat._shared_param_infos:
        key = (id(s.prim_module), s.prim_param_name)
        aliases.setdefault(key, []).append(_join(s.module_name, s.param_name))
    out: list[ParamEntry] = []
    for i, info in enumerate(infos):
        start, end = unit.layout.param_bounds(i)
        out.append(
            ParamEntry(
                name=_join(info.module_name, info.param_name),
                aliases=tuple(aliases.get((id(info.module), info.param_name), ())),
                shape=flat._param_shapes[i],
                start=start,
                end=end,
            )
        )
    return tuple(out)


def units_of(model: nn.Module) -> Iterator[UnitView]:
    """Every FSDP instance's unit in ``model``, in module (pre-)order, each part apart."""
    for name, module in model.named_modules():
        state = get_fsdp_state(module)
        if state is None or state.unit is None:
            continue
        prefix = clean_fqn(name + ".") if name else ""
        # A unit's frozen part is a unit of its own here (fsdp's [Note: frozen part]).
        for part in state.unit.parts():
            yield UnitView(prefix, state, part, param_entries(part))


def gather_flat(unit: FlatParamUnit, shard: Tensor) -> Tensor:
    """The full unpadded flat tensor (1D, ``full_numel``) from every rank's ``shard``.

    ``shard`` is laid out like ``unit.flat_param`` (this rank's padded chunk, e.g. an
    Adam moment of the FlatParameter). A collective over the unit's group for sharded
    units; an unsharded unit's tensor is returned as is. The result is on the compute
    device (the device collectives use).
    """
    if not unit.config.shard:
        return shard
    device = unit.config.compute_device
    padded = torch.empty(unit.layout.padded_numel, dtype=shard.dtype, device=device)
    all_gather_into(padded, shard.detach().to(device), unit.config.group).wait()
    return unpad_flat(padded, unit.layout)


def chunk_bounds(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` rows of ``rank``'s chunk: ``torch.chunk``/``Shard(0)`` semantics.

    Every rank gets ``ceil(dim0 / world_size)`` rows except at the end, where chunks
    may be shorter or empty (``dim0=5`` over 4 ranks: 2, 2, 1, 0 rows).
    """
    size = math.ceil(dim0 / world_size) if dim0 else 0
    start = min(rank * size, dim0)
    return start, min(start + size, dim0)


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


def inner_key(prefix: str) -> str:
    """Where nn.Module.state_dict puts keys below an FSDP instance at ``prefix``."""
    return prefix + FSDP_PREFIX
