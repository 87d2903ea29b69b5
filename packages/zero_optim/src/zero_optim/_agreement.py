"""The check, at construction, that every rank built the same ZeroRedundancyOptimizer.

The partition of parameters over ranks is computed on each rank from the
parameter sizes; ranks with another model (or other parameter groups, another
optimizer class) would compute another partition and later broadcast tensors of
different sizes, which gloo answers by aborting the process. One all-to-all of a
digest compares a fingerprint first (see [Note: agreement step] in flatparam's
``_agreement.py``) and raises :class:`~flatparam.RankDisagreementError` naming
what differs.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from flatparam import check_fingerprints_agree, named_backend_failures

__all__ = ["check_ranks_agree", "zero_fingerprint"]

_WHERE = "ZeroRedundancyOptimizer (construction)"
_FIXES = {
    "parameter": "Build the same model on every rank (same sizes, dtypes and requires_grad) "
    "and pass its parameters in the same order.",
    "number of parameters": "Build the same model on every rank and pass the same parameters.",
    "param groups": "Pass the same parameter groups on every rank.",
}
_DEFAULT_FIX = "Pass the same ZeroRedundancyOptimizer arguments on every rank."


def zero_fingerprint(
    param_groups: Sequence[Mapping[str, Any]],
    optimizer_class: type,
    defaults: Mapping[str, Any],
    params_per_rank: Sequence[Sequence[Tensor]],
    options: Mapping[str, object],
) -> dict[str, str]:
    """Everything about the optimizer that must be equal on all ranks."""
    params = [p for g in param_groups for p in g["params"]]
    fp: dict[str, str] = {
        "optimizer_class": f"{optimizer_class.__module__}.{optimizer_class.__qualname__}",
        "defaults": repr(sorted(defaults.items())),
        **{k: repr(v) for k, v in options.items()},
        "param groups": repr([len(g["params"]) for g in param_groups]),
        "number of parameters": str(len(params)),
    }
    for i, p in enumerate(params):
        dtype = str(p.dtype).removeprefix("torch.")
        grad = "trainable" if p.requires_grad else "frozen"
        fp[f"parameter {i}"] = f"{tuple(p.shape)} {dtype} on {p.device.type} ({grad})"
    fp["partition (parameters per rank)"] = repr([len(ps) for ps in params_per_rank])
    return fp


def check_ranks_agree(
    fingerprint: Mapping[str, str], group: dist.ProcessGroup, rank: int, device: torch.device
) -> None:
    """Raise the same :class:`RankDisagreementError` on every rank if fingerprints differ."""
    if dist.get_backend(group) != "nccl":
        device = torch.device("cpu")
    check_fingerprints_agree(
        "ZeroRedundancyOptimizer construction",
        fingerprint,
        world_size=dist.get_world_size(group),
        all_to_all=functools.partial(_all_to_all, group=group, rank=rank),
        device=device,
        where=_WHERE,
        fixes=_FIXES,
        default_fix=_DEFAULT_FIX,
    )


def _all_to_all(output: Tensor, input: Tensor, *, group: Any, rank: int) -> None:
    what = "the ZeroRedundancyOptimizer agreement step"
    with named_backend_failures(rank, "all_to_all", what, "construction"):
        dist.all_to_all_single(output, input, group=group)
