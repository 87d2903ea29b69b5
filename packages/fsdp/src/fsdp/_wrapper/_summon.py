"""Full parameters outside forward/backward: ``summon_full_params`` per unit.

[Note: summoned parameters]
Summoning a unit gathers its *full-precision* parameters (the sharded master
values, whatever the mixed-precision setting) into a fresh tensor, registers
the original parameters on their modules as ``nn.Parameter`` views of it and
unregisters the FlatParameter from the FSDP instance, so the model looks
unwrapped: ``named_parameters()`` gives the original names (the FSDP instance
strips its ``_fsdp_wrapped_module.`` prefix in this state) and ``state_dict()``
the original keys. On exit, with ``writeback``, this rank's chunk of the
(possibly modified) full tensor is copied back into the FlatParameter; then
everything is undone. For an unsharded unit the views alias the FlatParameter
itself, so changes persist even without ``writeback`` (documented behaviour).
Any gathered compute copy the unit still held from a forward is freed on exit,
since it may now be stale; the next forward or backward gathers again.
Under ``use_orig_params=True`` nothing is registered or unregistered: the
original parameters themselves point at the full views inside (and, with
``with_grads``, their ``.grad`` at the gathered full gradient), and at their
local pieces again on exit (see [Note: original parameter views]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Sequence

import torch
from torch import Tensor, nn

from fsdp._runtime._common import FLAT_PARAM, FROZEN_FLAT_PARAM, TrainingState, TrainingStateError
from fsdp._wrapper._flat_param_unit import ShardState
from fsdp._wrapper._fsdp_state import FSDPState, get_fsdp_state

__all__ = ["summon_full_params", "summon_unit"]


@contextlib.contextmanager
def summon_unit(
    state: FSDPState,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool = False,
) -> Generator[None, None, None]:
    """Summon one FSDP instance's parameters (see [Note: summoned parameters])."""
    _assert_summonable(state)
    unit = state.unit
    state.training_state = TrainingState.SUMMON_FULL_PARAMS
    try:
        if unit is None:
            yield
            return
        if unit.state is ShardState.UNSHARDING:
            unit.wait_for_unshard()
        parts = unit.parts()  # a frozen part is summoned alongside (see [Note: frozen part])
        fulls: list[tuple[Tensor, Tensor | None]] = []
        for part in parts:
            if part.orig is not None:
                part.orig.sync_data()  # the shard must hold what the user last wrote
                part.orig.sync_grads()
            full = part.gather_full_precision()  # a collective: every rank takes part
            full_grad = part.gather_full_grad() if with_grads else None  # also a collective
            fulls.append((full, full_grad))
        if rank0_only and unit.config.rank != 0:
            del fulls
            yield
            return
        if offload_to_cpu and unit.config.shard:
            fulls = [(full.cpu(), grad) for full, grad in fulls]
        fsdp_module = state.module
        registered_flat = fsdp_module._parameters.pop(FLAT_PARAM, None) is not None
        fsdp_module._parameters.pop(FROZEN_FLAT_PARAM, None)
        registered = [
            part.register_full_params(full, full_grad, with_grads)
            for part, (full, full_grad) in zip(parts, fulls, strict=True)
        ]
        try:
            yield
        finally:
            for part, params, (full, full_grad) in zip(parts, registered, fulls, strict=True):
                if writeback:
                    _take_in_replaced_data(params, part.flat_param._param_shapes, full)
                    part.write_back(full)
                    if full_grad is not None:
                        part.write_back_grad(full_grad)
                part.unregister_full_params()
            if registered_flat:
                fsdp_module._parameters[FLAT_PARAM] = unit.flat_param
                if unit.frozen_part is not None:
                    fsdp_module._parameters[FROZEN_FLAT_PARAM] = unit.frozen_part.flat_param
            if unit.state is not ShardState.SHARDED and not unit.aliased:
                unit.reshard()
    finally:
        state.training_state = TrainingState.IDLE


class _RankZeroWritebackError(NotImplementedError, ValueError):
    """torch's FSDP raises ``NotImplementedError`` for this; ours raised ``ValueError``."""


class _SummonStateError(TrainingStateError, AssertionError):
    """A summon inside forward/backward or inside another summon: torch's FSDP raises
    ``AssertionError``, ours ``TrainingStateError`` (a ``ValueError``); both catch it."""


# torch's words for a summon in the wrong state, which its tests match.
_TORCH_SUMMON_STATE = {
    TrainingState.FORWARD_BACKWARD: "Cannot manually unshard parameters during forward/backward",
    TrainingState.SUMMON_FULL_PARAMS: (
        "Cannot manually unshard parameters when already unsharding parameters"
    ),
}


def _assert_summonable(state: FSDPState) -> None:
    try:
        state.assert_state(TrainingState.IDLE, "summon_full_params")
    except TrainingStateError as e:
        raise _SummonStateError(f"{_TORCH_SUMMON_STATE[state.training_state]}: {e}") from None


def _take_in_replaced_data(
    params: list[nn.Parameter], shapes: Sequence[torch.Size], full: Tensor
) -> None:
    """Copy into ``full`` what the user put in a parameter by ``p.data = t`` (writeback).

    The summoned parameters are views of ``full`` (``shapes[i]`` is parameter
    ``i``'s, in flat order); an in-place write reaches ``full``, but
    ``p.data = t`` swaps the parameter's storage and would be lost. ``t`` is
    taken in when it has the parameter's shape and dtype, else refused, so
    that a write inside ``writeback=True`` is never silently dropped.
    """
    base = full.untyped_storage().data_ptr()
    offset = 0
    for p, shape in zip(params, shapes, strict=True):
        numel = shape.numel()
        if p.untyped_storage().data_ptr() != base:
            if p.shape != shape or p.dtype != full.dtype:
                raise ValueError(
                    f"inside summon_full_params(writeback=True) a parameter's .data was "
                    f"replaced by a tensor of shape {tuple(p.shape)} and dtype {p.dtype}, but "
                    f"the parameter has shape {tuple(shape)} and dtype {full.dtype}: write back "
                    "needs the same shape and dtype. Use p.data.copy_(t) (or p.copy_(t) under "
                    "torch.no_grad()), which updates the parameter in place"
                )
            full[offset : offset + numel].copy_(p.detach().reshape(-1))
        offset += numel


def _states_in_scope(module: nn.Module, recurse: bool) -> list[FSDPState]:
    """The FSDP instances a summon covers: all of them, or the outermost ones."""
    out: list[FSDPState] = []
    stack = [module]
    while stack:
        m = stack.pop()
        s = get_fsdp_state(m)
        if s is not None:
            out.append(s)
            if not recurse:
                continue
        stack.extend(reversed([c for c in m._modules.values() if c is not None]))
    return out


@contextlib.contextmanager
def summon_full_params(  # noqa: PLR0917 (torch's FSDP signature)
    module: nn.Module,
    recurse: bool,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Generator[None, None, None]:
    """The body of ``FullyShardedDataParallel.summon_full_params`` (see there)."""
    states = _states_in_scope(module, recurse)
    if with_grads:
        plain = [s for s in states if s.unit is not None and s.unit.orig is None]
        if plain:
            raise NotImplementedError(
                "summon_full_params(with_grads=True) needs use_orig_params=True (the gradients "
                "are shown on the original parameters), but this model was wrapped with "
                "use_orig_params=False; wrap it with use_orig_params=True (with_grads=True, "
                f"use_orig_params=False, offload_to_cpu={offload_to_cpu} is not supported yet)"
            )
        if offload_to_cpu:
            raise NotImplementedError(
                "summon_full_params(with_grads=True, offload_to_cpu=True) is not supported "
                "(as in torch's FSDP: with_grads=True, use_orig_params=True, "
                "offload_to_cpu=True is not supported yet); pass offload_to_cpu=False"
            )
    if rank0_only and writeback:
        raise _RankZeroWritebackError(
            "summon_full_params(rank0_only=True, writeback=True) is not supported (writeback=True "
            "and rank0_only=True is not supported yet, in torch's words): only rank 0 would "
            "hold full parameters, so writes could not be made consistent across ranks. Pass "
            "writeback=False."
        )
    for s in states:
        _assert_summonable(s)
    with contextlib.ExitStack() as stack:
        for s in states:
            stack.enter_context(summon_unit(s, writeback, rank0_only, offload_to_cpu, with_grads))
        yield
