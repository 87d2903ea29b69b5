"""Translating optimizer state between the full layout and a rank's local layout.

Pure functions of a :class:`~zero_optim._partition.Partition` and plain dicts, so
resharding a saved state to another world size is tested without a process group.

[Note: state dict layouts]
The *full* layout is exactly ``torch.optim.Optimizer.state_dict()``'s for the
wrapper's parameter groups: parameters are numbered ``0, 1, ...`` through the
groups in order (parameter ``i`` of group ``g`` has global index
``offset[g] + i`` with ``offset[g] = sum(len(group k) for k < g)``), ``"state"``
maps a global index to that parameter's state, and each of ``"param_groups"``
holds the group's hyperparameters and its list of global indices.

A rank's *local* layout is its local optimizer's ``state_dict()``: the same
structure over the parameters it owns, numbered in local-optimizer order
(:meth:`Partition.owned`), with one (possibly empty) group per wrapper group.
Nothing else about the world size is stored, so a full state dict saved with
one world size loads with any other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from zero_optim._partition import Partition

__all__ = [
    "check_full_state_dict",
    "check_state_shapes",
    "cpu_copy",
    "full_state_dict",
    "local_state_dict",
    "owned_global_indices",
]


def owned_global_indices(
    partition: Partition, rank: int, group_lengths: Sequence[int]
) -> list[int]:
    """Global index of each parameter ``rank`` owns, in local-optimizer order."""
    offsets = [sum(group_lengths[:g]) for g in range(len(group_lengths))]
    return [offsets[g] + i for g, i in partition.owned(rank)]


def check_full_state_dict(state_dict: Mapping[str, Any], group_lengths: Sequence[int]) -> None:
    """Raise a ``ValueError`` naming the mismatch if ``state_dict`` does not fit.

    It fits when it has the full layout for parameter groups of ``group_lengths``
    (see [Note: state dict layouts]).
    """
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError(
            "load_state_dict() expects a full optimizer state dict with 'state' and "
            "'param_groups' keys, as returned by ZeroRedundancyOptimizer.state_dict() "
            "(after consolidate_state_dict()) or torch.optim.Optimizer.state_dict()"
        )
    groups = state_dict["param_groups"]
    if len(groups) != len(group_lengths):
        raise ValueError(
            f"the state dict has {len(groups)} parameter groups but this optimizer has "
            f"{len(group_lengths)}: load a state dict saved from the same parameter groups"
        )
    total = sum(group_lengths)
    for g, (group, length) in enumerate(zip(groups, group_lengths, strict=True)):
        if len(group["params"]) != length:
            raise ValueError(
                f"parameter group {g} of the state dict has {len(group['params'])} "
                f"parameters but this optimizer's group {g} has {length}"
            )
    bad = [k for k in state_dict["state"] if not (isinstance(k, int) and 0 <= k < total)]
    if bad:
        raise ValueError(
            f"the state dict has state for parameter indices {bad[:5]}, outside 0..{total - 1}"
        )


# Per-element states of torch's optimizers: each has its parameter's shape.
_PER_ELEMENT_STATES = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "momentum_buffer",
        "sum",
        "square_avg",
        "acc_delta",
        "grad_avg",
        "exp_inf",
        "prev",
        "step_size",
        "ax",
    }
)


def check_state_shapes(state_dict: Mapping[str, Any], params: Sequence[Tensor]) -> None:
    """Raise a ``ValueError`` if a per-element state does not have its parameter's shape.

    Such a state dict belongs to another model; loading it would succeed and the
    next ``step()`` fail with a bare tensor-size error on some rank.
    """
    for index, entry in state_dict["state"].items():
        if not isinstance(entry, Mapping):
            continue
        expected = tuple(params[index].shape)
        for name, value in entry.items():
            wrong = isinstance(value, Tensor) and tuple(value.shape) != expected
            if wrong and name in _PER_ELEMENT_STATES:
                raise ValueError(
                    f"the state dict's {name!r} of parameter {index} has shape "
                    f"{tuple(value.shape)} but that parameter has shape {expected}: the "
                    "state dict was saved from another model; load one saved from this "
                    "model (same sizes, same parameter order)"
                )


def local_state_dict(
    state_dict: Mapping[str, Any],
    partition: Partition,
    rank: int,
    group_lengths: Sequence[int],
) -> dict[str, Any]:
    """The part of a full ``state_dict`` that ``rank``'s local optimizer loads.

    Values are shared with ``state_dict``, not copied; the caller copies.
    """
    global_ids = owned_global_indices(partition, rank, group_lengths)
    full_state = state_dict["state"]
    state = {local: full_state[gid] for local, gid in enumerate(global_ids) if gid in full_state}
    param_groups = []
    start = 0
    for g, group in enumerate(state_dict["param_groups"]):
        n = len(partition.members[g][rank])
        local_group = {k: v for k, v in group.items() if k != "params"}
        local_group["params"] = list(range(start, start + n))
        param_groups.append(local_group)
        start += n
    return {"state": state, "param_groups": param_groups}


def full_state_dict(
    state: Mapping[int, Any], param_groups: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """Assemble the full layout from per-parameter state keyed by global index.

    ``param_groups`` are the wrapper's groups (with tensors in ``"params"``);
    their hyperparameters are copied and the tensors replaced by global indices.
    """
    packed = []
    start = 0
    for group in param_groups:
        entry = {k: v for k, v in group.items() if k != "params"}
        entry["params"] = list(range(start, start + len(group["params"])))
        packed.append(entry)
        start += len(group["params"])
    return {"state": dict(sorted(state.items())), "param_groups": packed}


def cpu_copy(value: Any) -> Any:
    """A deep copy of ``value`` with every tensor copied to the CPU.

    Used for state that leaves the local optimizer (consolidation) or enters it
    (loading): the copy never aliases live optimizer state, so saving a state
    dict and then stepping cannot change what was saved.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: cpu_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [cpu_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(cpu_copy(v) for v in value)
    return value
