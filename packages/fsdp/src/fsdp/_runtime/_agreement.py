"""The check, before the first collective of a model, that every rank built the same one.

Ranks that built different models (another width, depth or wrap) or passed
different options would otherwise meet in collectives of different sizes: gloo
then aborts the process (``Received data size doesn't match expected size``)
and other backends hang until the timeout. Each front end describes what must
match as a fingerprint (a dict of strings: the wrapper's in
``_wrapper/_agreement.py``, ``fully_shard``'s in ``_fully_shard/_state.py``);
:func:`check_agree` compares it across the ranks of each group in one
all-to-all of a few bytes and raises :class:`~flatparam.RankDisagreementError`
naming what differs on which rank (see [Note: agreement step] in flatparam's
``_agreement.py``). An all-to-all because a training loop never issues one, so
a rank one step ahead cannot pair its collective with this one.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from flatparam import check_fingerprints_agree
from fsdp._runtime._collective_failure import backend_failures

__all__ = ["check_agree", "group_size"]


def check_agree(
    label: str,
    fingerprint: Mapping[str, str],
    groups: Sequence[Any],
    *,
    device: torch.device,
    where: str,
    fixes: Mapping[str, str],
    default_fix: str,
) -> None:
    """Raise the same error on every rank of each group whose ``fingerprint`` differs.

    ``device``: where the exchange's tensors live (the compute device for
    NCCL, whose collectives need device tensors; the CPU otherwise).
    """
    for group in groups:
        size = group_size(group)
        if group is None or size <= 1:
            continue
        on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        check_fingerprints_agree(
            label,
            dict(fingerprint),
            world_size=size,
            all_to_all=functools.partial(_all_to_all, group=group, what=label),
            device=on,
            where=where,
            fixes=dict(fixes),
            default_fix=default_fix,
        )


def _all_to_all(output: torch.Tensor, input: torch.Tensor, *, group: Any, what: str) -> None:
    with backend_failures("all_to_all", f"the {what} agreement step"):
        dist.all_to_all_single(output, input, group=group)


def group_size(group: Any) -> int:
    """Ranks in ``group`` (1 for None)."""
    return 1 if group is None else int(dist.get_world_size(group))
