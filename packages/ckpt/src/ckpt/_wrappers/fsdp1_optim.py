"""Optimizer state of an fsdp model, keyed by the parameters' FQNs; the seed's API.

An optimizer over an fsdp model steps FlatParameters, so its own ``state_dict()`` has
one entry per flat shard (``exp_avg`` of ``shard_numel`` elements). The state dicts
here have one entry per *original* parameter instead, in the layout of
``torch.optim.Optimizer.state_dict()`` with names for indices::

    {"state": {"blocks.0.fc1.weight": {"step": tensor(3.), "exp_avg": <[13, 6]>, ...}, ...},
     "param_groups": [{"lr": 0.01, ..., "params": ["emb.weight", "blocks.0.fc1.weight", ...]}]}

* full: every value is the whole tensor (``rank0_only``: on rank 0, others get ``{}``);
* sharded: tensors are ``DTensor`` dimension-0 chunks, exactly like the model's
  SHARDED state dict (see [Note: SHARDED is chunked per original parameter]).

Both forms load at any world size, into fsdp (``optim_state_dict_to_load``) and into
``zero_optim``/plain optimizers (``ckpt._wrappers.zero``), because nothing in them depends on
the flat layout. A state value is *per element* (split and concatenated with the
parameters) when it is a tensor laid out like the flat shard; anything else (``step``,
a 0-dim tensor) is *per parameter* and copied to each original parameter.

Under ``use_orig_params=True`` the optimizer steps the original parameters (each this
rank's piece of the flat shard) instead; ``ckpt._wrappers.fsdp1_orig_params_optim``
turns their state
into the same FQN-keyed form and back, through the same per-unit gathers, so the
forms above do not depend on the mode a checkpoint was written in.

[Note: optimizer state collectives]
Turning flat shards into per-parameter tensors gathers each unit for a full state
dict, or moves them to chunks by an all-to-all for a sharded one (and back on load;
other DTensors are gathered), so every function here is a collective: call it on every rank,
with the same model and optimizer. Units are visited in the same order everywhere.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ckpt._comm import device_of, on_device
from ckpt._wrappers.fqns import tied_names
from ckpt._wrappers.fsdp1_orig_params_optim import (
    load_orig_param_state,
    orig_param_runs,
    orig_state_from_runs,
    orig_unit_state,
)
from ckpt._wrappers.fsdp1_runs import shard_from_runs, unit_runs, unit_template
from ckpt._wrappers.fsdp1_unit_exchange import chunks_to_shard, shard_to_chunks
from ckpt._wrappers.loadable_values import LoadableState
from ckpt._wrappers.optim_dict_forms import check_form, check_groups, copy_value, rename_tied
from ckpt._wrappers.sharded_chunks import (
    chunk_dtensor,
    full_value,
    is_chunked_like_ours,
    to_dtensor,
)
from flatparam import shard_flat
from fsdp import to_fsdp_type, unwrapped_name
from fsdp.api import OptimStateKeyType, StateDictType
from fsdp.units import FlatUnit, flat_units, gather_flat

__all__ = [
    "flatten_sharded_optim_state_dict",
    "fsdp_optim_runs",
    "fsdp_optim_state_dict",
    "full_optim_state_dict",
    "init_optim_state",
    "load_fsdp_optim_state_dict",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "param_names_by_group",
    "rekey_optim_state_dict",
    "scatter_full_optim_state_dict",
    "shard_full_optim_state_dict",
    "sharded_optim_state_dict",
]


@dataclass(frozen=True)
class _Slot:
    """One tensor the optimizer steps: a unit's FlatParameter, an original parameter of a
    ``use_orig_params=True`` unit, or a plain parameter."""

    param: Tensor
    unit: FlatUnit | None  # None: a parameter outside every unit
    fqn: str  # the plain parameter's name (unused for a unit)
    index: int | None = None  # an original parameter: its index in the unit

    def fqns(self) -> list[str]:
        if self.unit is None:
            return [self.fqn]
        if self.index is not None:
            return [self.unit.params[self.index].fqn]
        return self.unit.fqns()


def _slots(model: nn.Module) -> dict[int, _Slot]:
    """id(tensor the optimizer holds) -> what it stands for."""
    out: dict[int, _Slot] = {}
    for unit in flat_units(model):
        if unit.orig_params is not None:
            for i, p in enumerate(unit.orig_params):
                out[id(p)] = _Slot(p, unit, "", i)
            continue
        out[id(unit.flat_param)] = _Slot(unit.flat_param, unit, "")
    for name, p in model.named_parameters():
        if id(p) not in out:
            out[id(p)] = _Slot(p, None, unwrapped_name(name))
    return out


def _optim_params(optim: torch.optim.Optimizer) -> list[list[Tensor]]:
    return [list(g["params"]) for g in optim.param_groups]


def _slot_of(slots: Mapping[int, _Slot], p: Tensor) -> _Slot:
    slot = slots.get(id(p))
    if slot is None:
        raise ValueError(
            f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not a parameter "
            "of the model; pass the model whose parameters the optimizer was built from "
            "(after wrapping)"
        )
    return slot


def param_names_by_group(
    model: nn.Module, optim: torch.optim.Optimizer
) -> list[list[tuple[str, bool]]]:
    """Per parameter group of ``optim``: (FQN, requires_grad) of each original parameter
    it steps, a FlatParameter counting for each parameter it holds, in flat order."""
    slots = _slots(model)
    return [
        [(fqn, p.requires_grad) for p in ps for fqn in _slot_of(slots, p).fqns()]
        for ps in _optim_params(optim)
    ]


def _is_flat_state(value: Any, unit: FlatUnit) -> bool:
    return (
        isinstance(value, Tensor)
        and value.dim() == 1
        and value.numel() == unit.layout.shard_numel
        and value.numel() > 0
    ) or (
        isinstance(value, Tensor)
        and value.dim() == 1
        and not unit.sharded
        and value.numel() == unit.layout.full_numel
    )


def _unit_state(
    unit: FlatUnit, flat_state: Mapping[str, Any], sharded: bool, device: torch.device | None
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(fqn, state) for every parameter of a unit, from the flat parameter's state."""
    per_param: dict[str, dict[str, Any]] = {e.fqn: {} for e in unit.params}
    group, dev = unit.sharding.group, device or unit.sharding.device
    for key, value in flat_state.items():
        if _is_flat_state(value, unit) and sharded and unit.sharded:
            # Chunks straight from the shards: see [Note: a unit's bytes move once].
            chunks = shard_to_chunks(unit, value, dev)  # collective
            for e, chunk in zip(unit.params, chunks, strict=True):
                per_param[e.fqn][key] = chunk_dtensor(chunk, e.shape, group)
        elif _is_flat_state(value, unit):
            full = gather_flat(unit, value)  # collective, see [Note: ...collectives]
            for e in unit.params:
                piece = full[e.start : e.end].view(e.shape)
                if sharded:
                    per_param[e.fqn][key] = to_dtensor(piece, group, dev)
                else:
                    per_param[e.fqn][key] = copy_value(piece, device)
            del full
        else:
            for e in unit.params:
                per_param[e.fqn][key] = copy_value(value, device)
    yield from per_param.items()


def _named_groups(
    param_groups: Sequence[Mapping[str, Any]],
    params: Sequence[Sequence[Tensor]],
    slots: Mapping[int, _Slot],
) -> list[dict[str, Any]]:
    out = []
    for group, ps in zip(param_groups, params, strict=True):
        entry = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        entry["params"] = [fqn for p in ps for fqn in _slot_of(slots, p).fqns()]
        out.append(entry)
    return out


def fsdp_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    *,
    sharded: bool,
    rank0_only: bool = False,
    offload_to_cpu: bool = True,
    optim_state_dict: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The FQN-keyed optimizer state of an fsdp model: full or sharded (DTensor).

    ``optim_state_dict`` is ``optim.state_dict()`` if not given. A collective (see
    [Note: optimizer state collectives]).
    """
    osd = optim.state_dict() if optim_state_dict is None else optim_state_dict
    slots = _slots(model)
    params = _optim_params(optim)
    device = torch.device("cpu") if offload_to_cpu else None
    keep = not (rank0_only and not sharded and dist.get_rank() != 0)
    saved_state = osd["state"]
    flat_index = [p for ps in params for p in ps]
    # Original parameters (use_orig_params=True): this rank's state of each, by unit.
    orig_local: dict[int, dict[int, Any]] = {}
    for index, p in enumerate(flat_index):
        slot = _slot_of(slots, p)
        if slot.index is not None:
            assert slot.unit is not None
            per_unit = orig_local.setdefault(id(slot.unit.flat_param), {})
            if saved_state.get(index) is not None:
                per_unit[slot.index] = saved_state[index]
    orig_done: dict[int, dict[int, dict[str, Any]]] = {}
    state: dict[str, dict[str, Any]] = {}
    for index, p in enumerate(flat_index):
        slot = _slot_of(slots, p)
        if slot.unit is not None and slot.index is not None:
            # The whole unit at its first parameter: the same order on every rank.
            key = id(slot.unit.flat_param)
            if key not in orig_done:
                orig_done[key] = orig_unit_state(
                    slot.unit, orig_local[key], sharded=sharded, device=device
                )
            value = orig_done[key].get(slot.index)
            if value is not None and keep:
                state[slot.fqns()[0]] = value
            continue
        slot_state = saved_state.get(index)
        if slot_state is None:
            continue
        if slot.unit is None:
            state[slot.fqn] = {k: copy_value(v, device) for k, v in slot_state.items()}
            continue
        for fqn, value in _unit_state(slot.unit, slot_state, sharded, device):
            if keep:
                state[fqn] = value
    if not keep:
        return {}
    return {"state": state, "param_groups": _named_groups(osd["param_groups"], params, slots)}


def _flat_unit_runs(
    unit: FlatUnit, saved: Mapping[str, Any], template: bool
) -> dict[str, dict[str, Any]]:
    """FQN -> this rank's runs of each parameter of a flat unit (``use_orig_params=False``)
    and its per-parameter values, by reference or as a load's template."""
    per_param: dict[str, dict[str, Any]] = {e.fqn: {} for e in unit.params}
    for key, value in saved.items():
        if _is_flat_state(value, unit):
            runs = unit_template(unit, value.dtype) if template else unit_runs(unit, value)
            for i, run in runs.items():
                per_param[unit.params[i].fqn][key] = run
        else:
            kept = (
                value.detach().to("cpu", copy=True)
                if template and isinstance(value, Tensor)
                else value
            )
            for e in unit.params:
                per_param[e.fqn][key] = kept
    return {fqn: state for fqn, state in per_param.items() if state}


def fsdp_optim_runs(
    model: nn.Module, optim: torch.optim.Optimizer, *, template: bool = False
) -> dict[str, Any]:
    """The FQN-keyed optimizer state of an fsdp model as this rank's runs, without a
    collective: by reference for a save ([Note: capture, then copy or write] in
    ``_wrappers/fsdp1_runs.py``), or fresh host tensors of the same layout for a load to fill
    (``template``, [Note: loading runs]). A value that cannot be a run is a
    ``CaptureProblem`` in its place, which the planner raises on every rank."""
    osd = optim.state_dict()
    slots = _slots(model)
    params = _optim_params(optim)
    device = torch.device("cpu") if template else None
    state: dict[str, dict[str, Any]] = {}
    for index, p in enumerate(p for ps in params for p in ps):
        saved = osd["state"].get(index)
        if saved is None:
            continue
        slot = _slot_of(slots, p)
        if slot.unit is None:
            state[slot.fqn] = (
                {k: copy_value(v, device) for k, v in saved.items()} if template else dict(saved)
            )
        elif slot.index is None:
            state.update(_flat_unit_runs(slot.unit, saved, template))
        else:
            fqn = slot.unit.params[slot.index].fqn
            state[fqn] = orig_param_runs(slot.unit, slot.index, saved, template=template)
    return {"state": state, "param_groups": _named_groups(osd["param_groups"], params, slots)}


def _flat_state_of_unit(
    unit: FlatUnit, named_state: Mapping[str, Mapping[str, Any]], what: str
) -> dict[str, Any] | None:
    """A unit's flat state (this rank's shard) from per-FQN states; None if none saved."""
    present = [e.fqn in named_state for e in unit.params]
    if not any(present):
        return None
    if not all(present):
        lacking = [e.fqn for e, ok in zip(unit.params, present, strict=True) if not ok]
        raise ValueError(  # torch's words first: its tests match them from the start
            "All unflattened parameters comprising a single flat parameter must have scalar "
            f"state with the same value and dtype, but {what} finds state for some parameters "
            f"of a unit and none for {lacking}: the optimizer state dict is not from this model"
        )
    states = [named_state[e.fqn] for e in unit.params]
    keys = list(states[0])
    flat_param = unit.flat_param
    out: dict[str, Any] = {}
    for key in keys:
        values = [s.get(key) for s in states]
        per_element = any(isinstance(v, Tensor) and v.dim() > 0 for v in values)
        if not per_element:
            first = values[0]
            out[key] = copy_value(first, None)
            continue
        for e, v in zip(unit.params, values, strict=True):
            if not isinstance(v, Tensor) or tuple(v.shape) != tuple(e.shape):
                got = f"shape {tuple(v.shape)}" if isinstance(v, Tensor) else type(v).__name__
                raise ValueError(
                    f"{what}: state {key!r} of {e.fqn} has {got}, the "
                    f"parameter has shape {tuple(e.shape)}"
                )
        group = unit.sharding.group
        if unit.sharded and all(is_chunked_like_ours(v, group) for v in values):
            # Chunks as a sharded save made them: see [Note: a unit's bytes move once].
            chunks = [v.to_local() for v in values if isinstance(v, DTensor)]
            out[key] = chunks_to_shard(unit, chunks, chunks[0].dtype)
            continue
        parts = [  # collective for a DTensor: every rank, same order
            full_value(v).reshape(-1).to(flat_param.device) for v in values
        ]
        flat = torch.cat(parts)
        if unit.sharded:
            flat = shard_flat(flat, unit.layout, unit.shard_index)
        out[key] = flat
    return out


def _flat_state_from_runs(
    unit: FlatUnit, named_state: Mapping[str, Mapping[str, Any]], current: Mapping[str, Any]
) -> dict[str, Any] | None:
    """A flat unit's state (this rank's shard) from its runs, as the load template made
    them; ``current`` (the optimizer's own state of the unit) says which keys are per
    element (a 0-dim parameter's run is a 0-dim tensor too)."""
    states = [named_state.get(e.fqn) for e in unit.params]
    if not any(states):
        return None
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for s in states if s for k in s):
        values = {i: s[key] for i, s in enumerate(states) if s is not None and key in s}
        now = current.get(key)
        if isinstance(now, Tensor) and _is_flat_state(now, unit):
            out[key] = shard_from_runs(unit, values, now.dtype, now.device)
            continue
        first = next(iter(values.values()))
        out[key] = copy_value(first, None)
    return out


def load_fsdp_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    named: Mapping[str, Any],
    what: str = "optim_state_dict_to_load",
    *,
    runs: bool = False,
) -> dict[str, Any]:
    """The ``optim.load_state_dict`` input (integer keys, flat shards) from an FQN-keyed one.

    Accepts the full and the sharded form (DTensor values are gathered: a collective),
    or with ``runs`` this rank's runs as ckpt's load template made them ([Note: loading
    runs] in ``_wrappers/fsdp1_runs.py``; no collective).
    """
    check_form(named, what)
    named = rename_tied(named, tied_names(model), what)
    # ShardedTensor and tensor-like values convert per parameter as the loop reaches them.
    named = {**named, "state": LoadableState(named["state"])}
    slots = _slots(model)
    params = _optim_params(optim)
    names = [[fqn for p in ps for fqn in _slot_of(slots, p).fqns()] for ps in params]
    check_groups(named, names, what)
    state: dict[int, Any] = {}
    index = 0
    for ps in params:
        for p in ps:
            slot = _slot_of(slots, p)
            current = optim.state.get(p, {})
            if slot.unit is not None and slot.index is not None:
                fqn = slot.fqns()[0]
                saved = named["state"].get(fqn)
                if runs:
                    piece = orig_state_from_runs(slot.unit, slot.index, saved, current)
                else:
                    piece = load_orig_param_state(slot.unit, slot.index, saved, what)
                if piece is not None:
                    state[index] = piece
            elif slot.unit is None:
                saved = named["state"].get(slot.fqn)
                if saved is not None:
                    state[index] = {
                        k: full_value(v).detach().clone() if isinstance(v, Tensor) else v
                        for k, v in saved.items()
                    }
            else:
                if runs:
                    flat = _flat_state_from_runs(slot.unit, named["state"], current)
                else:
                    flat = _flat_state_of_unit(slot.unit, named["state"], what)
                if flat is not None:
                    state[index] = flat
            index += 1
    groups = []
    start = 0
    for group, ps in zip(named["param_groups"], params, strict=True):
        entry = {k: v for k, v in group.items() if k != "params"}
        entry["params"] = list(range(start, start + len(ps)))
        start += len(ps)
        groups.append(entry)
    return {"state": state, "param_groups": groups}


def init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Give an optimizer that never stepped its state tensors (a step changing nothing).

    Loading into an optimizer (``ckpt.load``) needs state of the right shapes to fill;
    a fresh one has none. One step with zero gradients and a zero learning rate makes
    it, as DCP's helpers do; the loaded state then replaces it. Collective for
    ``zero_optim`` (its step broadcasts): call on every rank.
    """
    if any(optim.state.values()):
        return
    saved_grads: list[tuple[Tensor, Tensor | None]] = []
    lrs = []
    for group in optim.param_groups:
        lrs.append(group["lr"])
        group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], Tensor) else 0.0
        for p in group["params"]:
            saved_grads.append((p, p.grad))
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    try:
        optim.step()
    finally:
        for group, lr in zip(optim.param_groups, lrs, strict=True):
            group["lr"] = lr
        for p, grad in saved_grads:
            p.grad = grad


# --- the seed's API (FullyShardedDataParallel's static methods delegate here) ----------------


def _settings(model: nn.Module) -> tuple[StateDictType, bool, bool]:
    from ckpt._wrappers.fsdp1_state_dict_type import get_state_dict_type

    settings = get_state_dict_type(model)
    config = settings.optim_state_dict_config
    return (
        settings.state_dict_type,
        bool(getattr(config, "rank0_only", False)),
        bool(getattr(config, "offload_to_cpu", True)),
    )


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    group: Any = None,
) -> dict[str, Any]:
    """The optimizer state keyed by FQNs, in the form of the model's state-dict type.

    FULL: full tensors (``FullOptimStateDictConfig(rank0_only)``: rank 0 only);
    SHARDED: ``DTensor`` chunks; LOCAL: ``optim.state_dict()`` unchanged (flat
    shards by index, loadable only at the same world size). ``offload_to_cpu`` of
    the optimizer config puts the tensors on the CPU. A collective.
    """
    sd_type, rank0_only, offload = _settings(model)
    if sd_type is StateDictType.LOCAL_STATE_DICT:
        # The flat shards by index, as optim.state_dict() has them, but copied: the
        # optimizer's own tensors would change under the next step.
        local = optim.state_dict() if optim_state_dict is None else optim_state_dict
        device = torch.device("cpu") if offload else None
        return {
            "state": {
                i: {k: copy_value(v, device) for k, v in s.items()}
                for i, s in local["state"].items()
            },
            "param_groups": copy.deepcopy(local["param_groups"]),
        }
    return fsdp_optim_state_dict(
        model,
        optim,
        sharded=sd_type is StateDictType.SHARDED_STATE_DICT,
        rank0_only=rank0_only,
        offload_to_cpu=offload,
        optim_state_dict=optim_state_dict,
    )


def optim_state_dict_to_load(  # noqa: PLR0917 (torch's FSDP signature)
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: Any = None,
) -> dict[str, Any]:
    """What ``optim.load_state_dict`` takes, from an :func:`optim_state_dict` result.

    Full and sharded inputs are both accepted (whatever the saving world size);
    ``load_directly`` also loads it. A collective.
    """
    if is_named_optimizer:
        raise NotImplementedError(
            "is_named_optimizer=True (TorchRec's KeyedOptimizer) is not supported"
        )
    sd_type, _, _ = _settings(model)
    if sd_type is StateDictType.LOCAL_STATE_DICT:
        result = optim_state_dict
    else:
        result = load_fsdp_optim_state_dict(model, optim, optim_state_dict)
    if load_directly:
        optim.load_state_dict(result)
    return result


def full_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_input: Any = None,
    rank0_only: bool = True,
    group: Any = None,
) -> dict[str, Any]:
    """The full FQN-keyed optimizer state on the CPU (rank 0 only by default)."""
    _with_optim_input(optim_input, optim)
    return fsdp_optim_state_dict(model, optim, sharded=False, rank0_only=rank0_only)


def sharded_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, group: Any = None
) -> dict[str, Any]:
    """The FQN-keyed optimizer state with ``DTensor`` chunks (CPU)."""
    return fsdp_optim_state_dict(model, optim, sharded=True)


def shard_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any],
    model: nn.Module,
    optim_input: Any = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """This rank's flat optimizer state dict from a full one held by every rank."""
    given = _with_optim_input(optim_input, optim)
    target = given if given is not None else _model_order_optimizer(model)
    return load_fsdp_optim_state_dict(model, target, full_optim_state_dict)


def scatter_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any] | None,
    model: nn.Module,
    optim_input: Any = None,
    optim: torch.optim.Optimizer | None = None,
    group: Any = None,
) -> dict[str, Any]:
    """Like :func:`shard_full_optim_state_dict`, with the full dict only on rank 0.

    Rank 0 broadcasts it (as one pickled object) and every rank keeps its shard.
    """
    optim = _with_optim_input(optim_input, optim)
    box = [full_optim_state_dict if dist.get_rank(group) == 0 else None]
    src = dist.get_global_rank(group, 0) if group else 0
    with on_device(device_of({"model": model})):  # the model's device, not the current one
        dist.broadcast_object_list(box, src=src, group=group)
    if box[0] is None:
        raise ValueError("scatter_full_optim_state_dict: rank 0 passed no state dict")
    return shard_full_optim_state_dict(box[0], model, optim=optim)


def flatten_sharded_optim_state_dict(
    sharded_optim_state_dict: dict[str, Any],
    model: nn.Module,
    optim: torch.optim.Optimizer,
) -> dict[str, Any]:
    """This rank's flat optimizer state dict from a :func:`sharded_optim_state_dict`."""
    return load_fsdp_optim_state_dict(model, optim, sharded_optim_state_dict)


def rekey_optim_state_dict(
    optim_state_dict: dict[str, Any],
    optim_state_key_type: OptimStateKeyType,
    model: nn.Module,
    optim_input: Any = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Re-key a full optimizer state dict between FQNs and integer parameter ids.

    The ids are positions in ``optim``'s parameter groups (or ``model.parameters()``
    order without ``optim``), the names are ``model``'s (unwrapped); a flat parameter
    takes one id per original parameter it holds, so ids and names map one to one and
    a round trip (Lightning's Trainer saves by id) loses nothing. Use it to move a
    full state dict between an fsdp model and an unwrapped one.
    """
    optim = _with_optim_input(optim_input, optim)
    optim_state_key_type = to_fsdp_type(
        optim_state_key_type, OptimStateKeyType, "optim_state_key_type"
    )
    keys = list(optim_state_dict["state"])
    if any(type(k) is not type(keys[0]) for k in keys):
        raise ValueError(
            f"Invalid parameter keys: {optim_state_dict['state'].keys()}: the state dict mixes "
            "parameter names and ids; key it by one of them"
        )
    want_names = optim_state_key_type is OptimStateKeyType.PARAM_NAME
    if not keys or isinstance(keys[0], str) == want_names:
        return optim_state_dict
    if not want_names:  # names to ids: a tied parameter's by any of its names
        renames = tied_names(model)
        optim_state_dict = dict(rename_tied(optim_state_dict, renames, "rekey_optim_state_dict"))
    params = [p for ps in _optim_params(optim) for p in ps] if optim else list(model.parameters())
    slots = _slots(model)
    # One id per original parameter, in the order the optimizer's parameters hold them: a
    # flat parameter counts each original parameter it holds (torch's FSDP1 maps them all
    # to one id, which loses state; Lightning's Trainer round-trips through these ids).
    names = [fqn for p in params for fqn in _slot_of(slots, p).fqns()]
    id_to_name: dict[int, str] = dict(enumerate(names))
    name_to_id = {n: i for i, n in id_to_name.items()}
    table: Mapping[Any, Any] = id_to_name if want_names else name_to_id
    try:
        state = {table[k]: v for k, v in optim_state_dict["state"].items()}
        groups = []
        for group in optim_state_dict["param_groups"]:
            entry = copy.deepcopy({k: v for k, v in group.items() if k != "params"})
            entry["params"] = sorted(table[k] for k in group["params"])
            groups.append(entry)
    except KeyError as e:
        raise ValueError(
            f"rekey_optim_state_dict: the state dict names parameter {e.args[0]!r}, which "
            "this model/optimizer does not have"
        ) from None
    return {"state": state, "param_groups": groups}


def _with_optim_input(
    optim_input: Any, optim: torch.optim.Optimizer | None
) -> torch.optim.Optimizer | None:
    """torch's deprecated ``optim_input`` (the optimizer's parameters or groups), warned
    about in torch's words. Like ``optim``, it only says how the optimizer orders its
    parameters, so without ``optim`` a stand-in optimizer over it takes that role."""
    if optim_input is None:
        return optim
    warnings.warn(
        "The `optim_input` argument is deprecated and will be removed after PyTorch 1.13. "
        "You may remove it from your code without changing its functionality.",
        stacklevel=3,
    )
    if optim is not None:
        return optim
    return torch.optim.SGD(list(optim_input), lr=0.0)


def _model_order_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """A stand-in with one group of the model's parameters: the order torch assumes."""
    return torch.optim.SGD(list(model.parameters()), lr=0.0)
