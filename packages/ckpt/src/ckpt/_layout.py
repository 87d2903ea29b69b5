"""Where a checkpoint's files live before, during and after its commit.

[Note: atomic commit]
A checkpoint at ``P`` is written into the sibling directory ``.<P.name>.partial`` (same
parent, so the same filesystem). Every rank writes and fsyncs its own files there; when
all ranks are done, rank 0 writes the manifest, fsyncs the directory and renames it to
``P`` (one ``rename(2)``, atomic on POSIX filesystems), then fsyncs the parent so the
new name is durable. Hence:

* ``P`` exists and holds a manifest  <=>  the save committed; its files are complete.
* A process killed at any point before the rename leaves ``P`` untouched (absent, or
  the previous checkpoint) and a ``.<P.name>.partial`` directory that is never loaded,
  is reported by ``load``/``CheckpointManager``, and is removed by the next save.
* Overwriting moves the old checkpoint aside to ``.<P.name>.old`` first (a rename onto
  a non-empty directory is impossible), renames the new one in, then deletes the old
  one. A kill between the two renames leaves ``P`` absent but both the complete old
  and new checkpoints beside it; ``load`` names them.
* Removing a checkpoint (pruning) first renames it to ``.<P.name>.deleting``, so a
  half-deleted directory never looks committed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ckpt._errors import (
    CheckpointError,
    CheckpointExistsError,
    NotACheckpointError,
    PartialCheckpointError,
)
from ckpt._manifest import MANIFEST_NAME

__all__ = [
    "commit",
    "deleting_path",
    "is_committed",
    "leftovers",
    "not_a_checkpoint",
    "old_path",
    "partial_path",
    "prepare_partial",
    "remove",
]

_SUFFIXES = (".partial", ".old", ".deleting")


def partial_path(path: Path) -> Path:
    """The uncommitted directory a save to ``path`` writes into."""
    return path.parent / f".{path.name}.partial"


def old_path(path: Path) -> Path:
    """Where an overwrite parks the previous checkpoint until the new one is in."""
    return path.parent / f".{path.name}.old"


def deleting_path(path: Path) -> Path:
    """Where a checkpoint is moved before it is deleted."""
    return path.parent / f".{path.name}.deleting"


def is_committed(path: Path) -> bool:
    """Whether ``path`` is a committed ckpt checkpoint (a directory with a manifest)."""
    return (path / MANIFEST_NAME).is_file()


def leftovers(root: Path) -> list[Path]:
    """Directories in ``root`` that interrupted saves, overwrites or prunes left behind."""
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.name.startswith(".") and p.name.endswith(_SUFFIXES) and p.is_dir()
    )


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
        target = deleting_path(path)
        if target.exists():
            shutil.rmtree(target)
        path.rename(target)
    shutil.rmtree(target)


def prepare_partial(path: Path, overwrite: bool) -> list[Path]:
    """Check ``path`` may be saved to and create an empty partial directory for it.

    Runs on rank 0 only. Returns the stale leftovers it removed (a previous
    interrupted save to the same path) so the caller can report them.
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
    for stale in (partial_path(path), old_path(path) if path.exists() else None):
        if stale is not None and stale.exists():
            shutil.rmtree(stale)
            removed.append(stale)
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise CheckpointError(
            f"cannot save a checkpoint to {path}: {blocker} is a file, not a directory; "
            "choose a path whose parent directories are directories (or remove that file)"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial_path(path).mkdir()
    except OSError as e:
        raise CheckpointError(
            f"cannot save a checkpoint to {path}: creating its directory failed ({e}); "
            "choose a path you may write to"
        ) from e
    return removed


def commit(path: Path) -> None:
    """Make the finished partial directory of ``path`` appear at ``path`` (rank 0 only).

    See [Note: atomic commit]. The caller has written and synced every file and the
    manifest inside the partial directory.
    """
    partial = partial_path(path)
    fsync_dir(partial)
    if path.exists():
        old = old_path(path)
        if old.exists():
            shutil.rmtree(old)
        path.rename(old)
        partial.rename(path)
        fsync_dir(path.parent)
        shutil.rmtree(old)
    else:
        partial.rename(path)
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
    partial = partial_path(path)
    old = old_path(path)
    if old.is_dir():
        also = f", and the new one at {partial}" if partial.is_dir() else ""
        return NotACheckpointError(
            path,
            f"an overwrite of it was interrupted between its two renames; the previous "
            f"checkpoint is intact at {old}{also}; rename it back to {path.name}",
        )
    if partial.is_dir():
        return PartialCheckpointError(path, partial)
    return NotACheckpointError(path, "no such file or directory")
