"""Where a checkpoint's files live before, during and after its commit.

[Note: atomic commit]
A checkpoint at ``P`` is written into the sibling directory ``.<P.name>.<token>.partial``
(same parent, so the same filesystem; ``token`` is drawn by rank 0 for this save, so
no two saves share one: [Note: one writer per checkpoint] in ``_format/lease.py``). Every
rank writes and fsyncs its own files there; when all ranks are done, rank 0 writes the
manifest, fsyncs the directory and renames it to ``P`` (one ``rename(2)``, atomic on
POSIX filesystems), then fsyncs the parent so the new name is durable. Hence:

* ``P`` exists and holds a manifest  <=>  the save committed; its files are complete.
* A process killed at any point before the rename leaves ``P`` untouched (absent, or
  the previous checkpoint) and a ``.<P.name>.<token>.partial`` directory that is never
  loaded, is reported by ``load``/``CheckpointManager``, and is removed by the next
  save.
* Overwriting moves the old checkpoint aside to ``.<P.name>.<token>.old`` first (a
  rename onto a non-empty directory is impossible), renames the new one in, then
  deletes the old one. A kill between the two renames leaves ``P`` absent but both the
  complete old and new checkpoints beside it; ``load`` names them.
* Removing a checkpoint (pruning) first renames it to ``.<P.name>.<token>.deleting``,
  so a half-deleted directory never looks committed.
* The commit replaces only what the save saw at its start ([Note: one writer per
  checkpoint], rule 3): a checkpoint another writer committed meanwhile stays.

Leftovers of saves before tokens (``.<P.name>.partial``, ...) are recognised as well.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
from pathlib import Path

from ckpt._errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointInUseError,
    NotACheckpointError,
    PartialCheckpointError,
)
from ckpt._format.manifest import MANIFEST_NAME

__all__ = [
    "Occupant",
    "commit",
    "is_committed",
    "leftover_target",
    "leftovers",
    "leftovers_of",
    "make_parent",
    "new_token",
    "not_a_checkpoint",
    "occupant",
    "partial_path",
    "prepare_partial",
    "remove",
]

# ``.<name>[.<token>].<kind>``: the token is 16 hex digits (absent in older leftovers).
_LEFTOVER = re.compile(
    r"^\.(?P<name>.+?)(?:\.(?P<token>[0-9a-f]{16}))?\.(?P<kind>partial|old|deleting)$"
)

# What occupies a target: None (nothing) or its manifest's (inode, size, mtime in ns).
Occupant = tuple[int, int, int] | None


def new_token() -> str:
    """A fresh save token: 16 hex digits."""
    return secrets.token_hex(8)


def partial_path(path: Path, token: str) -> Path:
    """The uncommitted directory the save ``token`` to ``path`` writes into."""
    return path.parent / f".{path.name}.{token}.partial"


def _aside(path: Path, token: str, kind: str) -> Path:
    return path.parent / f".{path.name}.{token}.{kind}"


def is_committed(path: Path) -> bool:
    """Whether ``path`` is a committed ckpt checkpoint (a directory with a manifest)."""
    return (path / MANIFEST_NAME).is_file()


def occupant(path: Path) -> Occupant:
    """What is committed at ``path`` now: None, or its manifest's identity."""
    try:
        st = (path / MANIFEST_NAME).stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def leftover_target(leftover: Path) -> tuple[str, str] | None:
    """``(target name, kind)`` of a leftover directory's name, or None if it is none."""
    m = _LEFTOVER.match(leftover.name)
    return None if m is None else (m.group("name"), m.group("kind"))


def leftovers(root: Path) -> list[Path]:
    """Directories in ``root`` that interrupted saves, overwrites or prunes left behind
    (or that a running save is writing)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _LEFTOVER.match(p.name) and p.is_dir())


def leftovers_of(path: Path, *kinds: str) -> list[Path]:
    """The leftovers of saves to ``path`` (of the given kinds, or all), oldest first."""
    found = []
    for p in leftovers(path.parent):
        parsed = leftover_target(p)
        if parsed is not None and parsed[0] == path.name and (not kinds or parsed[1] in kinds):
            found.append(p)
    return sorted(found, key=_mtime)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0  # removed meanwhile


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (created or renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Delete a checkpoint or leftover directory; rename first so a kill mid-way
    leaves a leftover, never a half-deleted directory under a committed name."""
    if not path.exists():
        return
    target = path
    if not path.name.startswith("."):
        target = _aside(path, new_token(), "deleting")
        path.rename(target)
    shutil.rmtree(target)


def prepare_partial(path: Path, overwrite: bool, token: str) -> tuple[list[Path], Occupant]:
    """Check ``path`` may be saved to and create the save's empty partial directory.

    Runs on rank 0 only, holding the lease on ``path``. Returns the stale leftovers it
    removed (of earlier saves to the same path, which no one writes any more, since
    this save holds the lease) so the caller can report them, and what is committed
    at ``path`` now, which the commit must find unchanged.
    """
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise CheckpointExistsError(
                f"cannot save a checkpoint to {path}: a file is there; choose another path"
            )
        if not is_committed(path):
            raise CheckpointExistsError(
                f"cannot save a checkpoint to {path}: the directory exists and is not a ckpt "
                f"checkpoint, and ckpt never replaces what it did not write; choose another "
                f"path or remove it"
            )
        if not overwrite:
            raise CheckpointExistsError(
                f"a checkpoint already exists at {path}; pass overwrite=True to replace it "
                f"(atomically) or save to a new path"
            )
    removed: list[Path] = []
    stale_kinds = ("partial", "deleting", "old") if path.exists() else ("partial", "deleting")
    for stale in leftovers_of(path, *stale_kinds):
        shutil.rmtree(stale, ignore_errors=True)
        removed.append(stale)
    _mkdir(path, partial_path(path, token))
    return removed, occupant(path)


def make_parent(path: Path) -> None:
    """Create ``path``'s parent directories, or name why they cannot be (rank 0)."""
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise CheckpointError(
            f"cannot save a checkpoint to {path}: {blocker} is a file, not a directory; "
            "choose a path whose parent directories are directories (or remove that file)"
        )
    _mkdir(path, path.parent, parents=True)


def _mkdir(path: Path, directory: Path, parents: bool = False) -> None:
    """Create ``directory`` for a save to ``path``, or say why it cannot be (rank 0)."""
    try:
        directory.mkdir(parents=parents, exist_ok=parents)
    except OSError as e:
        raise CheckpointError(
            f"cannot save a checkpoint to {path}: creating its directory failed ({e}); "
            "choose a path you may write to"
        ) from e


def _replaced_meanwhile(path: Path) -> CheckpointInUseError:
    return CheckpointInUseError(
        path,
        "another writer",
        None,
        "another writer committed a checkpoint there while this save was written, "
        "and a commit never replaces a checkpoint it did not see at its start",
    )


def commit(path: Path, token: str, expected: Occupant) -> None:
    """Make the save ``token``'s finished partial directory appear at ``path`` (rank 0).

    See [Note: atomic commit]. The caller has written and synced every file and the
    manifest inside the partial directory; ``expected`` is what :func:`prepare_partial`
    found at ``path``. Raises :class:`CheckpointInUseError` if that changed.
    """
    partial = partial_path(path, token)
    fsync_dir(partial)
    if occupant(path) != expected:
        raise _replaced_meanwhile(path)
    if expected is not None:
        old = _aside(path, token, "old")
        path.rename(old)
        try:
            partial.rename(path)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise _replaced_meanwhile(path) from None
        fsync_dir(path.parent)
        shutil.rmtree(old)
    else:
        try:
            partial.rename(path)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
            raise _replaced_meanwhile(path) from None
    fsync_dir(path.parent)


def not_a_checkpoint(path: Path) -> NotACheckpointError:
    """The most useful error for a ``path`` that is not a committed checkpoint."""
    if path.is_dir():
        if (path / ".metadata").is_file():
            return NotACheckpointError(
                path,
                "it is a torch.distributed.checkpoint directory without a ckpt manifest "
                "(written by DCP directly, not by ckpt.save), so its integrity cannot be "
                "verified; pass verify=False to load it anyway",
            )
        return NotACheckpointError(path, f"the directory has no {MANIFEST_NAME}")
    if path.exists():
        return NotACheckpointError(path, "it is a file, not a checkpoint directory")
    partials = leftovers_of(path, "partial")
    olds = leftovers_of(path, "old")
    if olds:
        also = f", and the new one at {partials[-1]}" if partials else ""
        return NotACheckpointError(
            path,
            f"an overwrite of it was interrupted between its two renames; the previous "
            f"checkpoint is intact at {olds[-1]}{also}; rename it back to {path.name}",
        )
    if partials:
        return PartialCheckpointError(path, partials[-1])
    return NotACheckpointError(path, "no such file or directory")
