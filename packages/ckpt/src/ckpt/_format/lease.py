"""One writer per checkpoint: the lease a save takes on its target.

[Note: one writer per checkpoint]
Two jobs saving into one folder (a job started twice by a scheduler while the first
drains, two shells) used to write into the same ``.<name>.partial`` directory, and
one renamed it while the other still wrote: committed checkpoints with files missing.
Three rules keep every committed checkpoint whole, whatever the interleaving:

1. A save takes a lease on its target before it writes anything: rank 0 creates
   ``.<name>.lease`` beside the target, holding its owner (host, pid, process start
   time, the save's token, since when), with ``link(2)`` of a fully written file, so
   the lease appears atomically and whole. A second writer finds it and raises
   :class:`~ckpt.CheckpointInUseError` naming the owner and the fix. The lease goes
   when the save commits or fails. A lease whose owner is gone (same host, its pid
   dead or reused: see ``_format/processes.py``) is recovered: it was left by a killed save.
   A lease from another host cannot be judged from here and is reported.
2. Every save writes into a directory of its own, ``.<name>.<token>.partial``
   (``_format/layout.py``): rank 0 draws the token and shares it with the ranks, so even two
   writers that both believe they hold the lease never share files.
3. The commit refuses to replace what it did not see at the start: the occupant of
   the target (absent, or the committed checkpoint whose manifest it found) must be
   unchanged, and a rename onto a checkpoint committed meanwhile fails.

Rule 1 gives the early, clear error; rules 2 and 3 hold even when it is bypassed (a
lease file deleted by hand, two recoveries of one stale lease racing). The manager's
pruning takes the lease of each checkpoint before it deletes it (``_commit/manager.py``).

The same lease, on a whole folder and held for a job's lifetime, keeps a second job out
of a ``CheckpointManager``'s folder ([Note: one job per folder] in
``_format/job_lease.py``); it is renewed while the job runs (its file's mtime), so a
lease from another host that stopped being renewed can be judged after all: it expired.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ckpt._errors import CheckpointInUseError
from ckpt._format.processes import ProcessId, state

__all__ = [
    "Lease",
    "LeaseOwner",
    "acquire",
    "clock_time",
    "lease_file",
    "process_start_time",
    "renewed_at",
]

# How many times a save tries to take a lease that keeps changing hands under it.
_TRIES = 3


def lease_file(target: Path) -> Path:
    """The lease of a save to ``target``."""
    return target.parent / f".{target.name}.lease"


def clock_time(seconds: float) -> str:
    """``2026-01-01 12:00:00`` of a ``time.time()`` value, local time."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def process_start_time() -> float:
    """When this process started (``time.time()`` scale), from ``/proc``; now if unknown."""
    try:
        with open("/proc/self/stat", encoding="ascii", errors="replace") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


@dataclass(frozen=True)
class LeaseOwner:
    """Who holds a lease: the process, its save's token and since when (``time.time()``)."""

    process: ProcessId
    token: str
    since: float
    started_at: float = 0.0  # when the owner process started (``time.time()``); 0: unknown

    def describe(self) -> str:
        """``pid 123 on this host (save 1a2b..., since 2026-01-01 12:00:00)``, with the
        process's start time when the lease records it."""
        if not self.process.host:
            return "an unknown writer (its lease file is unreadable)"
        started = f"started {clock_time(self.started_at)}, " if self.started_at else ""
        since = clock_time(self.since)
        return f"{self.process.describe()} ({started}save {self.token}, since {since})"

    def to_json(self) -> str:
        p = self.process
        return json.dumps(
            {"host": p.host, "pid": p.pid, "started": p.started, "token": self.token,
             "since": self.since, "started_at": self.started_at}
        )  # fmt: skip

    @classmethod
    def read(cls, file: Path) -> LeaseOwner | None:
        """The owner written in ``file``; None if there is no such file; an unknown
        owner (empty host) if it cannot be parsed."""
        try:
            text = file.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError:
            text = ""
        try:
            d = json.loads(text)
            process = ProcessId(str(d["host"]), int(d["pid"]), str(d["started"]))
            started_at = float(d.get("started_at", 0.0))
            return cls(process, str(d["token"]), float(d["since"]), started_at)
        except (ValueError, KeyError, TypeError):
            return cls(ProcessId("", 0, ""), "", 0.0)


class Lease:
    """A held lease; :meth:`release` once the save committed or failed."""

    target: Path
    file: Path
    owner: LeaseOwner

    def __init__(self, target: Path, file: Path, owner: LeaseOwner) -> None:
        self.target = target
        self.file = file
        self.owner = owner

    def held(self) -> bool:
        """Whether the lease file still names this lease (nobody recovered it)."""
        current = LeaseOwner.read(self.file)
        return current is not None and current.token == self.owner.token

    def release(self) -> None:
        """Remove the lease file if it is still this save's (idempotent)."""
        if self.held():
            self.file.unlink(missing_ok=True)

    def renew(self) -> bool:
        """Mark the lease alive now (its file's mtime); False if it is no longer ours."""
        if not self.held():
            return False
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.file)
            return True
        return False


def renewed_at(file: Path) -> float | None:
    """When the lease in ``file`` was last renewed (taken, or touched since); None if
    there is no such file."""
    try:
        return file.stat().st_mtime
    except OSError:
        return None


def _gone(owner: LeaseOwner, file: Path, expires_after: float | None) -> bool:
    """Whether ``owner``'s lease may be taken over: its process is gone from this host,
    or (``expires_after``) it was not renewed for that many seconds."""
    if owner.process.host and state(owner.process) == "gone":
        return True
    if expires_after is None:
        return False
    renewed = renewed_at(file)
    return renewed is not None and time.time() - renewed > expires_after


def _place(source: Path, file: Path, text: str) -> None:
    """Create ``file`` with ``text`` atomically, or raise ``FileExistsError``.

    ``link(2)`` of a fully written file: a reader never sees a half-written lease.
    Where the filesystem has no hard links, an ``O_EXCL`` create written at once.
    """
    try:
        os.link(source, file)
        return
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _remove_stale(file: Path, stale: LeaseOwner, token: str) -> None:
    """Remove ``file`` if it still holds ``stale``'s lease.

    Moved aside first and read back, so a lease that another writer recovered and took
    meanwhile is put back rather than deleted (rules 2 and 3 of [Note: one writer per
    checkpoint] cover the remaining window).
    """
    grave = file.with_name(f"{file.name}.{token}.stale")
    try:
        os.rename(file, grave)
    except FileNotFoundError:
        return
    moved = LeaseOwner.read(grave)
    if moved is not None and moved.token != stale.token:
        with contextlib.suppress(OSError):  # else a third writer holds it now
            os.link(grave, file)
    grave.unlink(missing_ok=True)


def acquire(
    target: Path,
    token: str,
    *,
    file: Path | None = None,
    expires_after: float | None = None,
) -> tuple[Lease, list[LeaseOwner]]:
    """Take the lease on ``target`` for the save ``token`` (rank 0, before writing).

    Returns the lease and the owners of stale leases it recovered (gone processes of
    this host; with ``expires_after``, leases not renewed for that many seconds), for
    the caller to report. Raises :class:`CheckpointInUseError` when a live (or
    unknowable) writer holds it. ``file`` is the lease file (default
    :func:`lease_file`); its folder must exist.
    """
    file = lease_file(target) if file is None else file
    owner = LeaseOwner(ProcessId.this(), token, time.time(), process_start_time())
    text = owner.to_json()
    source = file.with_name(f"{file.name}.{token}.tmp")
    source.write_text(text, encoding="utf-8")
    recovered: list[LeaseOwner] = []
    try:
        for _ in range(_TRIES):
            try:
                _place(source, file, text)
                return Lease(target, file, owner), recovered
            except FileExistsError:
                pass
            other = LeaseOwner.read(file)
            if other is None:
                continue  # released meanwhile
            if not _gone(other, file, expires_after):
                raise CheckpointInUseError(target, other.describe(), file)
            _remove_stale(file, other, token)
            recovered.append(other)
        raise CheckpointInUseError(
            target,
            "other writers",
            file,
            "its lease changed hands while this save tried to take it: other writers are saving it",
        )
    finally:
        source.unlink(missing_ok=True)
