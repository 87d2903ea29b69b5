"""One job per checkpoint folder: the lease a ``CheckpointManager`` holds while it lives.

[Note: one job per folder]
A save's lease ([Note: one writer per checkpoint] in ``_format/lease.py``) keeps every
committed checkpoint whole, but lasts one save: two jobs given the same folder (a
scheduler restarting a job while the first still drains) took turns, each told
"saved", each pruning the other's steps with its own ``keep_last``. A folder's history
is one job's, so the whole folder is leased, for the job's lifetime:

* rank 0 of a manager takes ``<folder>/.ckpt-job.lease`` (the same lease file as a
  save's: owner host, pid, process start time, since when) at the job's first save or
  load there, inside that call's own rank-0 step (no collective of its own), and holds
  it until ``close()``, the manager's collection or the process's exit;
* a second job's first save or load raises :class:`~ckpt.CheckpointInUseError` naming
  the holder and the fix, before it reads or writes anything;
* managers of one process share the lease (a process is one job: a script that makes a
  manager per save, or one to load and another to save, is not a second job); the file
  goes when the last of them lets go;
* a daemon thread renews every held lease every :data:`RENEW_EVERY_S` (the file's
  mtime), so the lease says the job is alive; a lease whose process is gone from this
  host (killed: ``_format/processes.py``) is recovered with a warning, and one from
  another host, which cannot be looked at from here, once it was not renewed for
  :data:`EXPIRES_AFTER_S`.

The lease is advisory for anything but ckpt: a job that bypasses it (a lease file
deleted by hand) still cannot damage a committed checkpoint (the save's own lease and
commit rules hold).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ckpt._errors import CheckpointInUseError
from ckpt._format.lease import Lease, LeaseOwner, acquire, clock_time, renewed_at

__all__ = [
    "EXPIRES_AFTER_S",
    "JOB_LEASE_NAME",
    "RENEW_EVERY_S",
    "hold_folder",
    "job_lease_file",
    "let_go",
    "renew_held",
]

JOB_LEASE_NAME = ".ckpt-job.lease"
# How often a held folder lease is renewed, and after how long without renewal a lease
# from another host is taken for abandoned (several renewals missed: a job that is alive
# renews it however loaded its host).
RENEW_EVERY_S = 10.0
EXPIRES_AFTER_S = 120.0


def job_lease_file(root: Path) -> Path:
    """The lease of the job that saves to and loads from ``root``."""
    return root / JOB_LEASE_NAME


@dataclass
class _Held:
    """A folder lease of this process and how many managers hold it."""

    lease: Lease
    holders: int


class _Leases:
    """This process's folder leases, by real path, and the thread that renews them."""

    lock = threading.Lock()
    held: dict[str, _Held] = {}  # noqa: RUF012 - process-wide by design
    renewer: threading.Thread | None = None


def _key(root: Path) -> str:
    return os.path.realpath(root)


def hold_folder(root: Path, token: str) -> list[str]:
    """Take (or share, within this process) the lease on ``root``; rank 0 only.

    Returns the jobs whose abandoned leases it recovered, described, for the caller to
    report.
    Raises :class:`CheckpointInUseError` naming the job that holds it.
    """
    key = _key(root)
    with _Leases.lock:
        held = _Leases.held.get(key)
        if held is not None and held.lease.held():
            held.holders += 1
            return []
        root.mkdir(parents=True, exist_ok=True)
        file = job_lease_file(root)
        try:
            lease, recovered = acquire(root, token, file=file, expires_after=EXPIRES_AFTER_S)
        except CheckpointInUseError as e:
            raise _in_use(root, file, e.owner) from None
        _Leases.held[key] = _Held(lease, 1)
        _start_renewer()
    return [_describe(owner, None) for owner in recovered]


def let_go(root: Path) -> None:
    """One holder of ``root``'s lease lets go; the last one removes it (idempotent for
    a folder this process does not hold)."""
    key = _key(root)
    with _Leases.lock:
        held = _Leases.held.get(key)
        if held is None:
            return
        held.holders -= 1
        if held.holders <= 0:
            del _Leases.held[key]
            held.lease.release()


def _describe(owner: LeaseOwner, renewed: float | None) -> str:
    """``pid 123 on host h (started ..., holding it since ..., renewed 4 s ago)``."""
    started = f"started {clock_time(owner.started_at)}, " if owner.started_at else ""
    ago = "" if renewed is None else f", renewed {max(0.0, time.time() - renewed):.0f} s ago"
    since = clock_time(owner.since)
    return f"{owner.process.describe()} ({started}holding it since {since}{ago})"


def _holder(file: Path, fallback: str) -> str:
    """The job that holds ``file``'s lease, described; ``fallback`` if unreadable."""
    owner = LeaseOwner.read(file)
    renewed = renewed_at(file)
    if owner is None or not owner.process.host or renewed is None:
        return fallback
    return _describe(owner, renewed)


def _in_use(root: Path, file: Path, fallback: str) -> CheckpointInUseError:
    owner = _holder(file, fallback)
    detail = (
        f"cannot use the checkpoint folder {root}: another job holds it, {owner}. One job "
        f"saves to and loads from a folder at a time (two would overwrite and prune each "
        f"other's steps); nothing was saved or loaded"
    )
    fix = (
        f"stop that job or let it finish (it lets go when its CheckpointManager is closed "
        f"or its process exits), or give this job another folder; a job that died on this "
        f"host is noticed by itself, and one on another host once its lease goes "
        f"{EXPIRES_AFTER_S:.0f} s without renewal (or remove {file} if you know it is gone)"
    )
    return CheckpointInUseError(root, owner, file, detail, fix)


def renew_held() -> None:
    """Renew every lease this process holds (the renewer's round); forget those another
    job took over (it found this process gone or the lease expired)."""
    with _Leases.lock:
        for key, held in list(_Leases.held.items()):
            if not held.lease.renew():
                del _Leases.held[key]


def _renew_all() -> None:
    """The renewer thread's loop."""
    while True:
        time.sleep(RENEW_EVERY_S)
        renew_held()


def _start_renewer() -> None:
    """Start the renewing thread once per process (the caller holds the lock)."""
    if _Leases.renewer is None or not _Leases.renewer.is_alive():
        _Leases.renewer = threading.Thread(target=_renew_all, name="ckpt-lease", daemon=True)
        _Leases.renewer.start()


@atexit.register
def _release_all() -> None:
    """At exit, every lease this process still holds goes (a killed process's lease is
    recovered by the next job instead)."""
    with _Leases.lock:
        for held in _Leases.held.values():
            held.lease.release()
        _Leases.held.clear()


def _forget_in_child() -> None:
    """A forked child (a data loader's worker) is not the job: it holds no lease, so it
    neither renews nor releases its parent's."""
    _Leases.lock = threading.Lock()
    _Leases.held = {}
    _Leases.renewer = None


os.register_at_fork(after_in_child=_forget_in_child)
