"""The check, at every save and load, that all ranks make the same call.

Ranks that save to different paths would each wait for files the others never
write ("files disappeared while saving"); ranks that pass different
``overwrite=`` would be silently decided by rank 0; a rank that loads while
another saves would meet it in a collective of another size. One all-to-all of
a digest compares the call on every rank first (see [Note: agreement step] in
flatparam's ``_commit/agreement.py``) and every rank raises the same
:class:`CheckpointDisagreementError` naming what differs.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckpt._comm import Comm, backend_failures
from ckpt._errors import CheckpointError
from flatparam import RankDisagreementError, check_fingerprints_agree

__all__ = ["CheckpointDisagreementError", "check_ranks_agree"]

_FIXES = {
    "path": "Pass the same path on every rank: build it from values all ranks share (the "
    "step, a run name), not from the rank, the host or the time.",
}
_DEFAULT_FIX = "Pass the same arguments on every rank."


class CheckpointDisagreementError(CheckpointError, RankDisagreementError):
    """The ranks called ``save``/``load`` with different arguments (or not all of them).

    Both a :class:`CheckpointError` (ckpt's family) and a
    :class:`~flatparam.RankDisagreementError` (a ``ValueError``); every rank
    raises it with the same message.
    """

    def __init__(self, message: str, *, where: str, fields: Mapping[str, Any]) -> None:
        RankDisagreementError.__init__(self, message, where=where, fields=fields)


def check_ranks_agree(call: str, comm: Comm, path: Path, options: Mapping[str, object]) -> None:
    """Raise the same :class:`CheckpointDisagreementError` on every rank if the calls differ.

    ``call`` names the function (``"ckpt.save"``), so that a rank in another
    call is named as such. The state's keys may differ (per-rank entries are
    allowed); its content is checked by the load itself.
    """
    if not comm.distributed or comm.world_size == 1:
        return
    fingerprint = {"path": str(path), **{k: repr(v) for k, v in options.items()}}
    device = torch.device("cpu")
    if dist.get_backend(comm.group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    where = f"{call}({str(path)!r})"
    try:
        check_fingerprints_agree(
            call,
            fingerprint,
            world_size=comm.world_size,
            all_to_all=functools.partial(_all_to_all, group=comm.group, what=call),
            device=device,
            where=where,
            fixes=_FIXES,
            default_fix=_DEFAULT_FIX,
        )
    except RankDisagreementError as e:
        raise CheckpointDisagreementError(str(e), where=e.where, fields=e.fields) from None


def _all_to_all(output: torch.Tensor, input: torch.Tensor, *, group: Any, what: str) -> None:
    with backend_failures("all_to_all", f"the {what} agreement step (did every rank call it?)"):
        dist.all_to_all_single(output, input, group=group)
