"""A full disk, said as such: before writing where the size is known, and from the OS
error (or torch's rendering of it) where it is not.

[Note: naming a full disk]
A save onto a full filesystem fails deep inside DCP: ``torch.save`` of a tensor into
a data file loses the OS's ``ENOSPC`` on its way through torch's C++ zip writer and
surfaces as ``[enforce fail at inline_container.cc:...] . unexpected pos 704 vs 598``,
which says nothing about disks. So:

1. Before anything is written, :class:`SpaceCheckingWriter` (DCP's file writer) sums
   the bytes of every rank's final write plan in DCP's global planning step, which
   runs on the coordinator after replicated items were assigned to one rank each, and
   compares the sum with what the filesystem gives an unprivileged writer
   (``statvfs``'s ``f_bavail``). Too little raises :class:`~ckpt.DiskFullError` with
   both numbers, on every rank, and nothing is written.
2. Whatever the plan cannot know (the pickled size of non-tensor values, other
   writers filling the disk meanwhile, a quota) is recognised in the failure
   (``is_disk_full``: ``ENOSPC``/``EDQUOT`` anywhere in the exception chain or in a
   DCP failure of any rank, or torch's "unexpected pos") and re-raised as a
   ``DiskFullError`` once the partial directory is removed, so that the free bytes it
   reports are what a retry would have.

Either way nothing of the failed save is left and the previous checkpoint is intact
(the save never touched it: [Note: atomic commit] in ``_format/layout.py``). ``ckpt export``
checks its (exactly known) output size the same way.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from ckpt._errors import DiskFullError

__all__ = [
    "SpaceCheckingWriter",
    "check_space",
    "disk_full",
    "found_disk_full",
    "free_bytes",
    "is_disk_full",
    "plan_bytes",
    "rank_failures",
]

# Bytes DCP adds per stored item beyond a tensor's data (torch.save's zip framing of
# one tensor, about 1 KiB), and what a non-tensor value is assumed to take: an estimate.
_PER_ITEM = 1536
# torch's C++ zip writer's message when the stream stops taking bytes.
_TORCH_SHORT_WRITE = "unexpected pos"
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged process may still write on ``path``'s filesystem (the
    nearest existing ancestor's, for a path not created yet)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def check_space(path: Path, needed: int, what: str = "checkpoint", at: Path | None = None) -> None:
    """Raise ``DiskFullError`` (naming ``path``) when the filesystem of ``at`` (default
    ``path``) has fewer than ``needed`` bytes free."""
    free = free_bytes(at if at is not None else path)
    if needed > free:
        raise DiskFullError(path, needed, free, what)


def plan_bytes(plans: list[SavePlan]) -> int:
    """About how many bytes writing ``plans`` (every rank's, after DCP's global step)
    puts on disk: each tensor chunk's data plus framing; each value a fixed guess."""
    total = 0
    for plan in plans:
        for item in plan.items:
            total += _PER_ITEM
            if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
                sizes = item.tensor_data.chunk.sizes
                total += math.prod(sizes) * item.tensor_data.properties.dtype.itemsize
    return total


class SpaceCheckingWriter(FileSystemWriter):
    """DCP's file writer that refuses, before writing, a plan larger than the free
    space ([Note: naming a full disk]); ``needed`` keeps the estimate for a later
    ``DiskFullError``. ``report_path`` is the checkpoint's own path, which errors name
    (the writer writes into its partial sibling)."""

    report_path: Path
    needed: int | None

    def __init__(self, path: Path, report_path: Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.report_path = report_path
        self.needed = None

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.needed = plan_bytes(plans)
        check_space(self.report_path, self.needed, at=Path(self.path))
        return super().prepare_global_plan(plans)


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or anything in its cause/context chain, or a DCP failure of
    any rank) is the filesystem running out of space."""
    seen: set[int] = set()
    todo: list[BaseException] = [error]
    while todo:
        exc = todo.pop()
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, DiskFullError):
            return True
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return True
        text = str(exc)
        if _TORCH_SHORT_WRITE in text or os.strerror(errno.ENOSPC) in text:
            return True
        todo.extend(rank_failures(exc))
        todo.extend(linked for linked in (exc.__cause__, exc.__context__) if linked is not None)
    return False


def found_disk_full(error: BaseException) -> DiskFullError | None:
    """The ``DiskFullError`` raised by some rank's planning step inside ``error``."""
    if isinstance(error, DiskFullError):
        return error
    return next((f for f in rank_failures(error) if isinstance(f, DiskFullError)), None)


def rank_failures(error: BaseException) -> list[BaseException]:
    """Each rank's exception inside DCP's ``CheckpointException`` (its ``failures``: rank
    -> (exception, traceback)); none for any other error."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, Mapping):
        return []
    firsts = (f[0] if isinstance(f, tuple) else f for f in failures.values())
    return [f for f in firsts if isinstance(f, BaseException)]


def disk_full(path: Path, needed: int | None, what: str = "checkpoint") -> DiskFullError:
    """The error for a write to ``path`` that ran out of space (the free bytes measured
    now: call it after removing what the failed write left, so they are a retry's)."""
    return DiskFullError(path, needed, free_bytes(path), what)
