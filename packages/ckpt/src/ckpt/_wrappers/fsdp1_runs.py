"""An fsdp rank's runs of its parameters: what it writes at ``ckpt.save`` and reads at
``ckpt.load``, without a collective.

[Note: capture, then copy or write]
``ckpt.save`` and ``ckpt.async_save`` start alike: every object in ``state`` is turned
into the dict DCP writes, by reference to the object's own tensors and without any
communication (the *capture*). A synchronous save writes that dict at once; an
asynchronous one first copies its tensors into host buffers kept for the next save
(``_commit/staging.py``), returns, and writes the copy in the background. For our FSDP1 model
and its optimizer the capture is each unit's flat shard as the runs of the original
parameters it holds ([Note: flat pieces] in ``_format/flat_pieces.py``): a parameter this rank
holds whole is a plain view of the shard, one it holds part of is a
:class:`~ckpt._format.flat_pieces.FlatPieces`, one it holds nothing of is absent on this rank (the
ranks that hold it write it). The optimizer's per-element state (``exp_avg``, laid out
like the shard, or like each original parameter's piece under ``use_orig_params=True``)
is cut the same way; per-parameter values (``step``) are written under every
parameter of the unit (DCP keeps one copy of equal keys).

Nothing here depends on the other ranks, so it cannot wait for them: a value that cannot
be written as a run (optimizer state shaped unlike the parameter's piece) becomes a
:class:`~ckpt._format.save_planner.CaptureProblem` leaf, which the planners raise in DCP's
local planning step, from where DCP reports it on every rank. The optimizer's runs are
made in ``_wrappers/fsdp1_optim.py`` (``fsdp_optim_runs``) and
``_wrappers/fsdp1_orig_params_optim.py``.

[Note: loading runs]
``ckpt.load`` reads the same way round: its template for an FSDP1 model and optimizer is
the runs this rank holds, as views of fresh host buffers laid out like the shards
(:func:`unit_template`), and DCP fills each run from whatever boxes the checkpoint has
(runs of another world size, ``torch.chunk`` rows of torch's FSDP1 or ``fully_shard``):
it reads only the bytes this rank holds. The filled buffers then go into the shards
(:func:`shard_from_runs`): no exchange between ranks and nothing gathered, where the
``DTensor``-chunk template needed an all-to-all per unit and state to make the chunks
and another to turn them back into shards. Nothing is written into the model before
every rank has read everything (the buffers are not the shards).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ckpt._format.flat_pieces import FlatPieces
from fsdp.units import FlatUnit

__all__ = ["as_run", "shard_from_runs", "unit_runs", "unit_template"]


def as_run(local: Tensor, shape: torch.Size, start: int) -> Tensor | FlatPieces:
    """``local`` (1-D, elements ``[start, start + numel)`` of a tensor of ``shape``): a
    plain view when it is the whole tensor, else the run as pieces."""
    if start == 0 and local.numel() == math.prod(shape):
        return local.view(shape)
    return FlatPieces(local, shape, start)


def unit_runs(unit: FlatUnit, flat: Tensor) -> dict[int, Tensor | FlatPieces]:
    """Parameter index -> this rank's run of it in ``flat`` (laid out like
    ``unit.flat_param``: the shard itself, an optimizer moment of it, a buffer for a
    load). Parameters this rank holds nothing of are left out, except empty ones (every
    rank has those)."""
    flat = flat.detach()
    if not unit.sharded:
        return {i: flat[e.start : e.end].view(e.shape) for i, e in enumerate(unit.params)}
    out: dict[int, Tensor | FlatPieces] = {}
    for piece in unit.local_pieces():
        local = flat[piece.shard_offset : piece.shard_offset + piece.numel]
        shape = unit.params[piece.param_index].shape
        out[piece.param_index] = as_run(local, shape, piece.param_start)
    for i, e in enumerate(unit.params):
        if e.numel == 0:
            out[i] = flat.new_empty(e.shape)
    return out


def _shard_numel(unit: FlatUnit) -> int:
    return unit.layout.shard_numel if unit.sharded else unit.layout.full_numel


def unit_template(unit: FlatUnit, dtype: torch.dtype) -> dict[int, Tensor | FlatPieces]:
    """:func:`unit_runs` of a fresh host buffer laid out like the shard, for DCP to fill
    (see [Note: loading runs])."""
    return unit_runs(unit, torch.empty(_shard_numel(unit), dtype=dtype))


def shard_from_runs(
    unit: FlatUnit, runs: Mapping[int, Any], dtype: torch.dtype, device: torch.device
) -> Tensor:
    """This rank's shard (padding zero) from its runs of the parameters (parameter
    index -> a plain tensor or :class:`~ckpt._format.flat_pieces.FlatPieces`, as :func:`unit_runs`
    made them; absent ones stay zero)."""
    shard = torch.zeros(_shard_numel(unit), dtype=dtype)
    pieces = {p.param_index: p for p in unit.local_pieces()}
    for index, value in runs.items():
        piece = pieces.get(index)
        if piece is None:
            continue
        local = value.local if isinstance(value, FlatPieces) else value.detach().reshape(-1)
        shard[piece.shard_offset : piece.shard_offset + piece.numel] = local
    return shard.to(device)
