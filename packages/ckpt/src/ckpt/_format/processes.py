"""Who a process is (host, pid, start time), and whether it still runs.

Two things need it: a save's lease names its owner, and a lease whose owner died is
recovered (``_format/lease.py``); a collective of a save or load that fails names the peer
that died or is stopped (``_commit/peer_faults.py``). A pid alone is not an identity: pids
are reused, so the process's start time (Linux ``/proc/<pid>/stat``, field 22, in
clock ticks since boot) goes with it, and a process with the same pid but another
start time is another process. Only processes on this host can be looked at; for
any other, :func:`state` says ``"unknown"``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Literal

__all__ = ["ProcessId", "State", "state"]

State = Literal["running", "stopped", "gone", "unknown"]


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` split after the command name (which may hold spaces), so
    index 0 is the state letter (field 3), index 6 the flags (field 9) and index 19
    the start time (field 22)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


# The kernel's PF_EXITING task flag: set when a process starts to exit (killed,
# or returning), before it closes its files and sockets and becomes a zombie. A peer
# whose connection just closed is found exiting, not yet a zombie.
_PF_EXITING = 0x4


def _exiting(fields: list[str]) -> bool:
    """Whether the flags (field 9, index 6 after the name) say the process exits."""
    try:
        return bool(int(fields[6]) & _PF_EXITING)
    except (IndexError, ValueError):
        return False


@dataclass(frozen=True)
class ProcessId:
    """A process: its host, pid and start time (``""`` where it cannot be read)."""

    host: str
    pid: int
    started: str

    @classmethod
    def this(cls) -> ProcessId:
        """This process."""
        fields = _stat_fields(os.getpid())
        started = fields[19] if fields is not None and len(fields) > 19 else ""
        return cls(socket.gethostname(), os.getpid(), started)

    def describe(self) -> str:
        """``pid 123 on host h`` (``on this host`` for this host)."""
        here = "this host" if self.host == socket.gethostname() else f"host {self.host}"
        return f"pid {self.pid} on {here}"


def state(process: ProcessId) -> State:
    """Whether ``process`` runs, is stopped (SIGSTOP, a debugger), is gone (exited,
    killed, a zombie, or its pid now belongs to another process), or cannot be told
    (another host, or no ``/proc`` to look at)."""
    if process.host != socket.gethostname():
        return "unknown"
    try:
        os.kill(process.pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        pass  # another user's process: it exists
    fields = _stat_fields(process.pid)
    if fields is None:
        return "unknown" if not os.path.isdir("/proc") else "gone"
    if process.started and len(fields) > 19 and fields[19] != process.started:
        return "gone"  # the pid was reused
    letter = fields[0] if fields else ""
    if letter in ("Z", "X", "x") or _exiting(fields):
        return "gone"
    if letter in ("T", "t"):
        return "stopped"
    return "running"
