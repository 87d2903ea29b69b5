"""Optimizer state of units wrapped with ``use_orig_params=True``, per original parameter.

Under ``use_orig_params=True`` the optimizer steps the original parameters, and each is
a 1-D view of this rank's piece of the unit's flat shard (see [Note: original parameter
views] in fsdp's ``_orig_params.py``), possibly empty. So its per-element state
(``exp_avg`` ...) is a 1-D piece at the same offsets in the shard, and a parameter
whose piece is empty, that is frozen, or that the optimizer does not hold, has no
state on this rank. This module converts between that and the FQN-keyed state of
``ckpt._wrappers.fsdp1_optim`` (whole parameters, or ``DTensor`` dimension-0 chunks),
through the same flat path as ``use_orig_params=False``:

* saving: for each state key, this rank's pieces are put at their offsets in a
  flat-shard-shaped tensor (zeros in padding and where a parameter has no state),
  and that tensor becomes each parameter's state: all-gathered (``gather_flat``) and
  cut at ``[start, end)`` for a full state dict, turned into dimension-0 chunks by
  one all-to-all for a sharded one (``shard_to_chunks``);
* loading: each parameter's full state (a gathered DTensor, or a full tensor) is cut
  back to this rank's piece of it; a parameter with an empty piece gets no state, as
  the optimizer of an uninterrupted run has none for it.

[Note: which parameters have state is per rank]
Adam-like optimizers create state for a parameter on its first step with a gradient,
and under ``use_orig_params`` a rank whose piece of a parameter is empty gives it no
gradient, so one rank may hold ``exp_avg`` for a parameter that another rank has no
state for at all. The gathers are collectives over the unit's group and must be the
same on every rank, so before gathering, each rank describes its state (per
parameter, per key: a per-element tensor and its dtype, or a per-parameter value
such as ``step``) and the descriptions are exchanged (one ``all_gather_object`` per
sharded unit). Every rank then runs the same gathers, one per (key, dtype). A value
that fits neither kind (a tensor shaped unlike the parameter's piece) is reported
through the same exchange, so that every rank raises the same error rather than
some ranks waiting in a gather.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ckpt._comm import on_device
from ckpt._format.flat_pieces import FlatPieces
from ckpt._format.save_planner import CaptureProblem
from ckpt._wrappers.fsdp1_runs import as_run
from ckpt._wrappers.fsdp1_unit_exchange import shard_to_chunks
from ckpt._wrappers.sharded_chunks import chunk_dtensor, full_value, to_dtensor
from fsdp.units import FlatUnit, gather_flat

__all__ = [
    "LocalPiece",
    "load_orig_param_state",
    "local_pieces",
    "orig_param_runs",
    "orig_state_from_runs",
    "orig_unit_state",
]


@dataclass(frozen=True)
class LocalPiece:
    """The part of one original parameter this rank holds (its optimizer sees it whole).

    ``flat[shard_start:shard_end]`` of this rank's flat shard (or of the whole flat
    tensor for an unsharded unit) is ``param.reshape(-1)[param_start:param_end]``, and
    the optimizer sees it with shape ``shape``: 1-D when sharded, the parameter's
    shape when unsharded.
    """

    shard_start: int
    param_start: int
    numel: int
    shape: torch.Size

    @property
    def shard_end(self) -> int:
        return self.shard_start + self.numel

    @property
    def param_end(self) -> int:
        return self.param_start + self.numel


def local_pieces(unit: FlatUnit) -> dict[int, LocalPiece]:
    """Parameter index -> this rank's non-empty piece of it (absent when empty)."""
    return {
        p.param_index: LocalPiece(
            p.shard_offset,
            p.param_start,
            p.numel,
            torch.Size([p.numel]) if unit.sharded else unit.params[p.param_index].shape,
        )
        for p in unit.local_pieces()
    }


# A description of one state value: ("elem", dtype) for a per-element tensor laid out
# like the parameter's piece, ("value", v) for a per-parameter value, ("bad", text) for
# neither. See [Note: which parameters have state is per rank].
_Desc = tuple[str, Any]


def _describe(value: Any, piece: LocalPiece | None) -> _Desc:
    """What kind of state ``value`` is, for the exchange between ranks (small: no data)."""
    if isinstance(value, Tensor) and value.dim() > 0:
        shape = piece.shape if piece is not None else torch.Size([0])
        if tuple(value.shape) == tuple(shape) or (piece is None and value.numel() == 0):
            return ("elem", value.dtype)  # no piece here: empty (any shape, e.g. (0, 5))
        return ("bad", f"shape {tuple(value.shape)}, the parameter's local piece {tuple(shape)}")
    if isinstance(value, Tensor):
        return ("value", value.detach().clone())
    return ("value", copy.deepcopy(value))


def _merged_descriptions(
    unit: FlatUnit,
    local: Mapping[int, Mapping[str, Any]],
    pieces: Mapping[int, LocalPiece],
) -> dict[int, dict[str, _Desc]]:
    """Parameter index -> key -> description, the same on every rank of the unit."""
    mine = {
        i: {key: _describe(v, pieces.get(i)) for key, v in state.items()}
        for i, state in local.items()
    }
    parts: list[Any] = [mine]
    if unit.sharded:
        group = unit.sharding.group
        parts = [None] * dist.get_world_size(group)
        with on_device(unit.sharding.device):  # not the current device
            dist.all_gather_object(parts, mine, group=group)
    # Merged in rank order, so that keys (and so the gathers) are in the same order on
    # every rank.
    merged: dict[int, dict[str, _Desc]] = {}
    for part in parts:
        for i, descs in part.items():
            slot = merged.setdefault(i, {})
            for key, desc in descs.items():
                prev = slot.get(key)
                if prev is None or desc[0] == "bad":
                    slot[key] = desc
                elif prev[0] != desc[0] or (desc[0] == "elem" and prev[1] != desc[1]):
                    slot[key] = ("bad", "a different kind or dtype on different ranks")
    for i in sorted(merged):
        for key, desc in merged[i].items():
            if desc[0] == "bad":
                name = unit.params[i].fqn
                raise ValueError(
                    f"optimizer state {key!r} of {name} has {desc[1]}; under use_orig_params=True "
                    "ckpt saves per-element state laid out like the parameter (exp_avg, ...) "
                    "and per-parameter values (step), not other shapes (e.g. factored moments)"
                )
    # A per-parameter value (step) this rank has is its own; others take the first rank's.
    for i, descs in mine.items():
        for key, desc in descs.items():
            if desc[0] == "value":
                merged[i][key] = desc
    return {i: merged[i] for i in sorted(merged)}


def orig_unit_state(
    unit: FlatUnit,
    local: Mapping[int, Mapping[str, Any]],
    *,
    sharded: bool,
    device: torch.device | None,
) -> dict[int, dict[str, Any]]:
    """Parameter index -> its FQN-keyed state (full tensors, or DTensor chunks if ``sharded``).

    ``local`` is this rank's optimizer state of the unit's original parameters (index in
    the unit -> state), for those that have state here. A collective over the unit's
    group for a sharded unit (see [Note: which parameters have state is per rank]);
    call it on every rank for the same units in the same order.
    """
    pieces = local_pieces(unit)
    merged = _merged_descriptions(unit, local, pieces)
    out: dict[int, dict[str, Any]] = {i: dict.fromkeys(descs) for i, descs in merged.items()}
    flats: list[tuple[str, torch.dtype]] = []
    for descs in merged.values():
        for key, (kind, what) in descs.items():
            if kind == "elem" and (key, what) not in flats:
                flats.append((key, what))
    size = unit.layout.shard_numel if unit.sharded else unit.layout.full_numel
    for key, dtype in flats:
        shard = torch.zeros(size, dtype=dtype, device=unit.flat_param.device)
        for i, state in local.items():
            piece = pieces.get(i)
            value = state.get(key)
            if piece is None or not isinstance(value, Tensor) or value.dtype != dtype:
                continue
            shard[piece.shard_start : piece.shard_end] = value.detach().reshape(-1)
        wanted = [i for i, descs in merged.items() if descs.get(key) == ("elem", dtype)]
        if sharded and unit.sharded:
            # Chunks straight from the shards: see [Note: a unit's bytes move once].
            dev = device or unit.sharding.device
            chunks = shard_to_chunks(unit, shard, dev)  # collective
            for i in wanted:
                e = unit.params[i]
                out[i][key] = chunk_dtensor(chunks[i], e.shape, unit.sharding.group)
            del chunks, shard
            continue
        full = gather_flat(unit, shard)  # collective, see [Note: optimizer state collectives]
        for i in wanted:
            e = unit.params[i]
            value = full[e.start : e.end].view(e.shape)
            if sharded:
                dev = device or unit.sharding.device
                out[i][key] = to_dtensor(value, unit.sharding.group, dev)
            else:
                out[i][key] = value.detach().to(device or value.device, copy=True)
        del full, shard
    for i, descs in merged.items():
        for key, (kind, what) in descs.items():
            if kind == "value":
                if isinstance(what, Tensor):
                    out[i][key] = what.detach().to(device or what.device, copy=True)
                else:
                    out[i][key] = copy.deepcopy(what)
    return out


def load_orig_param_state(
    unit: FlatUnit, index: int, saved: Mapping[str, Any] | None, what: str
) -> dict[str, Any] | None:
    """This rank's optimizer state of original parameter ``index`` from its FQN-keyed state.

    ``saved`` is full (tensors of the parameter's shape) or sharded (DTensors: gathered
    here, a collective over the DTensor's mesh, so call it on every rank for the same
    parameters in the same order). ``None`` when nothing was saved or this rank holds
    no piece of the parameter (its optimizer never steps it here).
    """
    if saved is None:
        return None
    entry = unit.params[index]
    piece = local_pieces(unit).get(index)
    device = unit.flat_param.device
    out: dict[str, Any] = {}
    for key, value in saved.items():
        if not isinstance(value, Tensor):
            out[key] = copy.deepcopy(value)
            continue
        full = full_value(value)  # a collective for a DTensor: every rank, same order
        if full.dim() == 0:
            out[key] = full.detach().clone()
            continue
        if tuple(full.shape) != tuple(entry.shape):
            raise ValueError(
                f"{what}: state {key!r} of {entry.fqn} has shape "
                f"{tuple(full.shape)}, the parameter has {tuple(entry.shape)}"
            )
        if piece is not None:
            local = full.detach().reshape(-1)[piece.param_start : piece.param_end]
            out[key] = local.view(piece.shape).to(device, copy=True)
    return out if piece is not None else None


def orig_state_from_runs(
    unit: FlatUnit, index: int, saved: Mapping[str, Any] | None, current: Mapping[str, Any]
) -> dict[str, Any] | None:
    """This rank's optimizer state of original parameter ``index`` from its run, as ckpt's
    load template made it ([Note: loading runs] in ``_wrappers/fsdp1_runs.py``; no collective).

    ``current`` (the optimizer's own state of the parameter) says which keys are per
    element: a 0-dim parameter's run is a 0-dim tensor too. ``None`` when nothing was
    saved or this rank holds no piece of the parameter.
    """
    piece = local_pieces(unit).get(index)
    if saved is None or piece is None:
        return None
    device = unit.flat_param.device
    out: dict[str, Any] = {}
    for key, value in saved.items():
        now = current.get(key)
        if isinstance(value, FlatPieces):
            out[key] = value.local.view(piece.shape).to(device, copy=True)
        elif isinstance(value, Tensor) and isinstance(now, Tensor) and now.dim() > 0:
            out[key] = value.detach().reshape(piece.shape).to(device, copy=True)
        elif isinstance(value, Tensor):
            out[key] = value.detach().clone()
        else:
            out[key] = copy.deepcopy(value)
    return out


def orig_param_runs(
    unit: FlatUnit, index: int, saved: Mapping[str, Any], *, template: bool
) -> dict[str, Any]:
    """The state of original parameter ``index`` as this rank's run of it, from its
    optimizer state of its piece (1-D; the whole parameter when unsharded): by reference
    for a save, fresh host tensors of the same layout for a load (``template``); see
    [Note: capture, then copy or write] in ``_wrappers/fsdp1_runs.py``. No collective."""
    entry = unit.params[index]
    piece = local_pieces(unit).get(index)
    out: dict[str, Any] = {}
    for key, value in saved.items():
        if not isinstance(value, Tensor) or value.dim() == 0:  # per parameter (step)
            is_tensor = isinstance(value, Tensor)
            out[key] = value.detach().to("cpu", copy=True) if template and is_tensor else value
        elif entry.numel == 0:
            out[key] = value.new_empty(entry.shape, device="cpu")
        elif piece is None:
            if value.numel():
                out[key] = CaptureProblem(
                    f"optimizer state {key!r} of {entry.fqn} has {value.numel()} elements on a "
                    f"rank that holds none of the parameter"
                )
        elif tuple(value.shape) != tuple(piece.shape):
            out[key] = CaptureProblem(
                f"optimizer state {key!r} of {entry.fqn} has shape {tuple(value.shape)}, the "
                f"parameter's local piece {tuple(piece.shape)}; under use_orig_params=True ckpt "
                "saves per-element state laid out like the parameter (exp_avg, ...) and "
                "per-parameter values (step), not other shapes (e.g. factored moments)"
            )
        else:
            local = value.detach().reshape(-1)
            if template:
                local = torch.empty(local.numel(), dtype=local.dtype)
            out[key] = as_run(local, entry.shape, piece.param_start)
    return out
