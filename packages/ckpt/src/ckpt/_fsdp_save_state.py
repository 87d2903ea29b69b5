"""What an fsdp rank writes at ``ckpt.save``: its own pieces, by reference, no collective.

[Note: capture, then copy or write]
``ckpt.save`` and ``ckpt.async_save`` start alike: every object in ``state`` is turned
into the dict DCP writes, by reference to the object's own tensors and without any
communication (the *capture*). A synchronous save writes that dict at once; an
asynchronous one first copies its tensors into host buffers kept for the next save
(``_staging.py``), returns, and writes the copy in the background. For our FSDP1 model
and its optimizer the capture is each unit's flat shard as the runs of the original
parameters it holds ([Note: flat pieces] in ``_pieces.py``): a parameter this rank
holds whole is a plain view of the shard, one it holds part of is a
:class:`~ckpt._pieces.FlatPieces`, one it holds nothing of is absent on this rank (the
ranks that hold it write it). The optimizer's per-element state (``exp_avg``, laid out
like the shard, or like each original parameter's piece under ``use_orig_params=True``)
is cut the same way; per-parameter values (``step``) are written under every
parameter of the unit (DCP keeps one copy of equal keys).

Nothing here depends on the other ranks, so it cannot wait for them: a value that cannot
be written as a run (optimizer state shaped unlike the parameter's piece) becomes a
:class:`CaptureProblem` leaf, which the save planner raises in DCP's local planning
step, from where DCP reports it on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ckpt._fsdp_optim_state import (
    _is_flat_state,
    _named_groups,
    _optim_params,
    _slot_of,
    _slots,
)
from ckpt._orig_optim_state import local_pieces
from ckpt._pieces import FlatPieces
from ckpt._save_planner import CaptureProblem
from fsdp.units import FlatUnit

__all__ = ["fsdp_optim_capture", "unit_capture"]


def _run(local: Tensor, shape: torch.Size, start: int) -> Tensor | FlatPieces:
    """``local`` (1-D, elements ``[start, start + numel)`` of a tensor of ``shape``): a
    plain view when it is the whole tensor, else the run as pieces."""
    if start == 0 and local.numel() == math.prod(shape):
        return local.view(shape)
    return FlatPieces(local, shape, start)


def unit_capture(unit: FlatUnit, flat: Tensor) -> dict[int, Tensor | FlatPieces]:
    """Parameter index -> what this rank writes of it, from ``flat`` (laid out like
    ``unit.flat_param``: the shard itself or an optimizer moment of it). Parameters this
    rank holds nothing of are left out, except empty ones (every rank writes those)."""
    flat = flat.detach()
    if not unit.sharded:
        return {i: flat[e.start : e.end].view(e.shape) for i, e in enumerate(unit.params)}
    out: dict[int, Tensor | FlatPieces] = {}
    for piece in unit.local_pieces():
        local = flat[piece.shard_offset : piece.shard_offset + piece.numel]
        shape = unit.params[piece.param_index].shape
        out[piece.param_index] = _run(local, shape, piece.param_start)
    for i, e in enumerate(unit.params):
        if e.numel == 0:
            out[i] = flat.new_empty(e.shape)
    return out


def _flat_unit_state(unit: FlatUnit, saved: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """FQN -> state of each parameter of a flat unit (``use_orig_params=False``)."""
    per_param: dict[str, dict[str, Any]] = {e.fqn: {} for e in unit.params}
    for key, value in saved.items():
        if _is_flat_state(value, unit):
            for i, run in unit_capture(unit, value).items():
                per_param[unit.params[i].fqn][key] = run
        else:
            for e in unit.params:
                per_param[e.fqn][key] = value
    return {fqn: state for fqn, state in per_param.items() if state}


def _orig_param_state(unit: FlatUnit, index: int, saved: Mapping[str, Any]) -> dict[str, Any]:
    """The state of original parameter ``index`` of a ``use_orig_params=True`` unit, from
    this rank's optimizer state of its piece (1-D; the whole parameter when unsharded)."""
    entry = unit.params[index]
    piece = local_pieces(unit).get(index)
    out: dict[str, Any] = {}
    for key, value in saved.items():
        if not isinstance(value, Tensor) or value.dim() == 0:
            out[key] = value  # per parameter (step)
        elif entry.numel == 0:
            out[key] = value.new_empty(entry.shape)
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
            out[key] = _run(value.detach().reshape(-1), entry.shape, piece.param_start)
    return out


def fsdp_optim_capture(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The FQN-keyed optimizer state of an fsdp model as this rank writes it (see
    [Note: capture, then copy or write]): no collective, tensors by reference."""
    osd = optim.state_dict()
    slots = _slots(model)
    params = _optim_params(optim)
    state: dict[str, dict[str, Any]] = {}
    for index, p in enumerate(p for ps in params for p in ps):
        saved = osd["state"].get(index)
        if saved is None:
            continue
        slot = _slot_of(slots, p)
        if slot.unit is None:
            state[slot.fqn] = dict(saved)
        elif slot.index is None:
            state.update(_flat_unit_state(slot.unit, saved))
        else:
            fqn = slot.unit.params[slot.index].fqn
            state[fqn] = _orig_param_state(slot.unit, slot.index, saved)
    return {"state": state, "param_groups": _named_groups(osd["param_groups"], params, slots)}
