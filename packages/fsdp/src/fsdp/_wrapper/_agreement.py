"""The root's check, at lazy initialisation, that every rank built the same FSDP model.

Ranks that wrapped different models (another width, depth or wrap policy) or
passed different options (sharding strategy, mixed precision, use_orig_params)
would otherwise meet in collectives of different sizes: gloo then aborts the
process (``Received data size doesn't match expected size``) and other backends
hang until the timeout. :func:`check_ranks_agree` compares a fingerprint of the
tree across ranks first, in one all-to-all of a few bytes, and raises
:class:`~flatparam.RankDisagreementError` naming what differs on which rank
(see [Note: agreement step] in flatparam's ``_agreement.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fsdp._runtime._agreement import check_agree, group_size
from fsdp._runtime._collective_failure import unit_name

__all__ = ["check_broadcast_agrees", "check_ranks_agree", "fsdp_fingerprint", "unit_summary"]

_WHERE = "FullyShardedDataParallel (first forward, lazy initialisation)"
_FIXES = {
    "number of FSDP units": "Build the same model on every rank (same depth) and wrap it with "
    "the same auto_wrap_policy.",
    "unit ": "Build the same model on every rank (same sizes and dtypes, same "
    "requires_grad) and wrap it with the same auto_wrap_policy.",
}
_DEFAULT_FIX = "Pass the same FSDP arguments on every rank."


def unit_summary(unit: Any) -> str:
    """What must match about one unit: its parameters' names, sizes, dtype and device.

    Reads only the unit's parameter list (names and the flat parameter's
    per-parameter sizes); the one place to adapt if the unit layout changes.
    """
    if unit is None:
        return "no parameters"
    # A unit may carry a frozen part (see [Note: frozen part]): each part is summarised.
    return "; ".join(_part_summary(part) for part in unit.parts())


def _part_summary(unit: Any) -> str:
    flat = unit.flat_param
    names = [
        f"{i.module_name}.{i.param_name}" if i.module_name else i.param_name
        for i in unit.iter_param_infos()
    ]
    sizes = ", ".join(f"{n} {tuple(s)}" for n, s in zip(names, flat._param_shapes, strict=True))
    if len(sizes) > 160:
        sizes = sizes[:157] + "..."
    grad = "trainable" if flat.requires_grad else "frozen"
    return (
        f"{flat.full_numel:,} elements in {len(names)} params [{sizes}] "
        f"{str(unit.orig_dtype).removeprefix('torch.')} on {unit.config.compute_device.type} "
        f"({grad})"
    )


def fsdp_fingerprint(states: Sequence[Any]) -> dict[str, str]:
    """Every setting of an FSDP tree that must be equal on all ranks (root first)."""
    root = states[0].module
    fp: dict[str, str] = {
        "sharding_strategy": _name(getattr(root, "sharding_strategy", None)),
        "mixed_precision": repr(getattr(root, "mixed_precision", None)),
        "use_orig_params": str(getattr(root, "_use_orig_params", None)),
        "cpu_offload": repr(getattr(root, "cpu_offload", None)),
        "comm_policy": repr(getattr(root, "comm_policy", None)),
        "process group size": str(getattr(root, "world_size", None)),
        "replica group size": str(group_size(getattr(root, "_inter_node_pg", None))),
        "number of FSDP units": str(len(states)),
    }
    for i, s in enumerate(states):
        name = unit_name(s, root)
        fp[f"unit {i} ({name})"] = unit_summary(s.unit)
        strategy = getattr(s.module, "sharding_strategy", None)
        if s is not states[0] and strategy is not getattr(root, "sharding_strategy", None):
            fp[f"unit {i} ({name}) sharding_strategy"] = _name(strategy)
        policy = getattr(s.module, "comm_policy", None)
        if s is not states[0] and policy != getattr(root, "comm_policy", None):
            fp[f"unit {i} ({name}) comm_policy"] = repr(policy)
    return fp


def check_ranks_agree(states: Sequence[Any]) -> None:
    """Raise the same :class:`RankDisagreementError` on every rank whose tree differs."""
    root = states[0].module
    groups = [getattr(root, "process_group", None), getattr(root, "_inter_node_pg", None)]
    if all(group_size(g) <= 1 for g in groups):
        return
    check_agree(
        "fsdp lazy init",
        fsdp_fingerprint(states),
        groups,
        device=states[0].compute_device,
        where=_WHERE,
        fixes=_FIXES,
        default_fix=_DEFAULT_FIX,
    )


def check_broadcast_agrees(tensors: Sequence[torch.Tensor], groups: Sequence[Any]) -> None:
    """Before ``sync_module_states`` broadcasts: do all ranks hold tensors of the same sizes?

    The broadcast runs at construction, before the lazy initialisation's check;
    with another model on some rank its sizes would differ, which gloo answers by
    aborting the receiving process.
    """
    fingerprint = {"number of parameters and buffers": str(len(tensors))}
    for i, t in enumerate(tensors):
        dtype = str(t.dtype).removeprefix("torch.")
        fingerprint[f"parameter/buffer {i}"] = f"{tuple(t.shape)} {dtype} on {t.device.type}"
    check_agree(
        "fsdp sync_module_states",
        fingerprint,
        groups,
        device=tensors[0].device,
        where="FullyShardedDataParallel(sync_module_states=True) (construction)",
        fixes={},
        default_fix="Build the same model on every rank (same sizes and dtypes) before "
        "wrapping it.",
    )


def _name(value: Any) -> str:
    return str(getattr(value, "name", value))
