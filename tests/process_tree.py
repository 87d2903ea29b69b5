"""Killing a launch and everything under it.

torch's elastic agent starts its ranks in sessions of their own, so a kill of the
launcher (or of its process group) leaves a hung rank running after the test gave up
on it, holding its ports and a core for the rest of the run. The tree is found by
parent pid in ``/proc``, repeatedly, until it stops growing.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

__all__ = ["kill_tree"]


def _parent(stat: Path) -> tuple[int, int] | None:
    try:
        # The command name may hold spaces and parentheses: the fields after it count.
        return int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None  # gone meanwhile


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and every process descended from it."""
    family, grew = {root}, True
    while grew:
        grew = False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            pair = _parent(stat)
            if pair is not None and pair[1] in family and pair[0] not in family:
                family.add(pair[0])
                grew = True
    for pid in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
