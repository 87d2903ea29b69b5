"""The exceptions ckpt raises, one class per thing a user can do something about.

Every class derives from :class:`CheckpointError`, so ``except ckpt.CheckpointError``
catches all of them; the subclasses carry the details as attributes so a training
script can react (fall back to an earlier step, report the bad file) without parsing
messages.
"""

from __future__ import annotations

import errno
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from flatparam import CollectiveError

__all__ = [
    "CheckpointCollectiveError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInUseError",
    "CorruptCheckpointError",
    "DiskFullError",
    "FileProblem",
    "NotACheckpointError",
    "OlderStepError",
    "PartialCheckpointError",
    "ShapeMismatch",
    "SignatureError",
    "StateDictMismatchError",
    "UnsafeCheckpointError",
]

# How many keys an error message lists before it says "... and N more".
_MAX_LISTED = 20


def _listing(items: Sequence[str], limit: int = _MAX_LISTED) -> str:
    shown = ", ".join(items[:limit])
    if len(items) > limit:
        shown += f", ... and {len(items) - limit} more"
    return shown


_E = TypeVar("_E", bound="CheckpointError")


class CheckpointError(RuntimeError):
    """Base class of every error ckpt raises about a checkpoint or a state.

    Catch this to handle all checkpoint failures in one place, e.g. to fall back to
    an earlier step when the newest one cannot be loaded.

    An error crosses processes (one rank's decision sent to all, an asynchronous save's
    thread), so it pickles: by calling its class again with the arguments it was made
    with, which ``__new__`` keeps; no subclass needs a ``__reduce__`` of its own.
    """

    _made_with: tuple[tuple[Any, ...], dict[str, Any]]

    def __new__(cls: type[_E], *args: Any, **kwargs: Any) -> _E:
        # The built-in base that lays the object out: OSError's for an OSError subclass.
        builtin = [b for b in cls.__mro__ if b.__module__ == "builtins"]
        self: _E = max(builtin, key=lambda b: b.__basicsize__).__new__(cls, *args)
        self._made_with = (args, kwargs)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        args, kwargs = self._made_with
        return (functools.partial(type(self), **kwargs), args)


class NotACheckpointError(CheckpointError):
    """The path holds no committed ckpt checkpoint.

    Raised by ``load``/``verify`` when the path is missing, is a file, or is a
    directory without a ckpt manifest, so that a typo in a path never looks like a
    corrupt checkpoint.
    """

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path} is not a ckpt checkpoint: {reason}")


class PartialCheckpointError(NotACheckpointError):
    """The path was never committed, but an interrupted save left its files beside it.

    A save that was killed before its commit leaves a ``.<name>.<token>.partial`` directory;
    it is never loaded (it may lack files), and the next save to the same path or a
    :class:`~ckpt.CheckpointManager` save removes it.
    """

    def __init__(self, path: Path, partial: Path) -> None:
        self.partial = partial
        super().__init__(
            path,
            f"a save to it was interrupted before its commit and left the uncommitted "
            f"directory {partial}, which is never loaded; load an earlier checkpoint "
            f"(CheckpointManager.steps() lists the committed ones) and save again",
        )


class CheckpointExistsError(CheckpointError, FileExistsError):
    """``save`` was asked to write over something that already exists.

    Saving over a committed checkpoint must be asked for (``overwrite=True``) so that
    a wrong step number never silently replaces a good checkpoint; anything at the
    path that is not a ckpt checkpoint is never replaced.
    """


class OlderStepError(CheckpointError):
    """A ``CheckpointManager`` save of a step older than the folder's newest checkpoint.

    A job that saves steps behind the folder's newest is almost always the wrong job
    (a second one given the same folder, a script restarted from scratch): its own
    ``keep_last`` would then prune the newer steps it never made. ``step`` and
    ``newest`` hold both numbers; ``allow_older=True`` saves it anyway (a run resumed
    from an older step on purpose).
    """

    def __init__(self, root: Path, step: int, newest: int) -> None:
        self.root = root
        self.step = step
        self.newest = newest
        super().__init__(
            f"refusing to save step {step} into {root}: its newest committed checkpoint is "
            f"step {newest}, and a job saves steps forward; nothing was saved. If this run "
            f"resumed from an older step on purpose, pass allow_older=True (its pruning then "
            f"keeps the newest steps, never the one just saved); if it is a new run, give "
            f"it another folder or resume it from step {newest} (load_latest)"
        )


def _bytes(n: int) -> str:
    """``1288490188`` -> ``'1288490188 bytes (1.2 GiB)'``: exact for scripts, readable
    for people."""
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} bytes" if abs(n) < 1024 else f"{n} bytes ({value:.1f} {unit})"
    raise AssertionError("unreachable")


class DiskFullError(CheckpointError):
    """The filesystem under ``path`` has no room for what is being written.

    Raised before writing when the size is known and too large (``needed`` bytes, of
    which ``free`` are available), or in place of the OS's (or torch's) error when a
    write ran out of space (``needed`` None when unknown); see [Note: naming a full
    disk] in ``_format/disk_space.py``. Nothing of the failed write is left; an earlier
    checkpoint is untouched. Free space there, or write elsewhere. ``errno`` is
    ``errno.ENOSPC``, as on the OSError it stands for.
    """

    def __init__(self, path: Path, needed: int | None, free: int, what: str = "checkpoint") -> None:
        self.path = path
        self.needed = needed
        self.free = free
        self.what = what
        self.errno = errno.ENOSPC
        need = (
            f"the {what} needs about {_bytes(needed)}"
            if needed is not None
            else f"the {what} did not fit"
        )
        kept = (
            "nothing of this save was kept (an earlier checkpoint is intact)"
            if what == "checkpoint"
            else f"nothing of this {what} was kept"
        )
        super().__init__(
            f"no space left on device at {path}: {need}, {_bytes(free)} are free; {kept}. "
            "Free space on that filesystem or write elsewhere"
        )


@dataclass(frozen=True)
class FileProblem:
    """One file of a checkpoint that does not match its manifest.

    ``kind`` is one of ``"missing"``, ``"unexpected"``, ``"size"``, ``"checksum"``
    and ``"unreadable"``; ``detail`` says what was expected and what was found.
    """

    name: str
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {self.kind}: {self.detail}"


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files do not match the manifest written when it was committed.

    Nothing was loaded. ``problems`` names every file that is missing, extra,
    truncated or altered, so the damage can be located without re-running.
    """

    def __init__(self, path: Path, problems: Sequence[FileProblem]) -> None:
        self.path = path
        self.problems = tuple(problems)
        lines = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(
            f"checkpoint {path} failed verification ({len(self.problems)} problem(s)); "
            f"nothing was loaded:\n{lines}\n"
            f"Load an earlier checkpoint or restore these files; pass verify=False only "
            f"if you know the files are intact."
        )


def file_problem(path: Path, name: str, kind: str, detail: str) -> CorruptCheckpointError:
    """A :class:`CorruptCheckpointError` about one file (``name``) of checkpoint ``path``."""
    return CorruptCheckpointError(path, [FileProblem(name, kind, detail)])


@dataclass(frozen=True)
class ShapeMismatch:
    """One key whose tensor has another global shape in the checkpoint than here."""

    key: str
    checkpoint_shape: tuple[int, ...]
    local_shape: tuple[int, ...]

    def __str__(self) -> str:
        return (
            f"{self.key}: checkpoint has shape {list(self.checkpoint_shape)}, "
            f"the state being loaded has {list(self.local_shape)}"
        )


class StateDictMismatchError(CheckpointError):
    """The checkpoint's keys or shapes do not fit the state it is loaded into.

    Nothing was loaded. ``missing`` are keys the state needs that the checkpoint lacks,
    ``unexpected`` are keys in the checkpoint no rank asked for, ``shape_mismatches``
    pair a key with both shapes and ``kind_mismatches`` are keys that are a tensor on
    one side and a plain object on the other.
    """

    def __init__(
        self,
        path: Path,
        *,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        shape_mismatches: Sequence[ShapeMismatch] = (),
        kind_mismatches: Sequence[str] = (),
        other_model: bool = False,
        dtype_mismatches: Sequence[str] = (),
        absent_entries: Sequence[str] = (),
        local_state_dict: bool = False,
    ) -> None:
        self.path = path
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)
        self.shape_mismatches = tuple(shape_mismatches)
        self.kind_mismatches = tuple(kind_mismatches)
        self.other_model = other_model
        self.dtype_mismatches = tuple(dtype_mismatches)
        self.absent_entries = tuple(absent_entries)
        self.local_state_dict = local_state_dict
        parts = [f"checkpoint {path} does not fit the state being loaded; nothing was loaded."]
        if self.absent_entries:
            names = ", ".join(repr(e) for e in self.absent_entries)
            parts.append(
                f"The checkpoint has no {names} entry at all: it was saved without it. Leave "
                "it out of the state you load (or pass strict=False to keep its current value)."
            )
        if local_state_dict:
            parts.append(
                "One side is an FSDP LOCAL_STATE_DICT (flat-parameter keys ending in "
                "'_flat_param') and the other is not: load with the state_dict_type the "
                "checkpoint was saved with (ckpt.state_dict_type(model, StateDictType.X))."
            )
        if other_model:
            parts.append(
                "Most keys differ: this looks like a checkpoint of another model "
                "(or of the same model under other module names)."
            )
        if self.missing:
            parts.append(
                f"Missing from the checkpoint ({len(self.missing)}): {_listing(self.missing)}"
            )
        if self.unexpected:
            parts.append(
                f"Unexpected in the checkpoint ({len(self.unexpected)}): "
                f"{_listing(self.unexpected)}"
            )
        if self.shape_mismatches:
            shown = [str(m) for m in self.shape_mismatches]
            parts.append(f"Shape mismatches ({len(shown)}): {_listing(shown, 10)}")
        if self.kind_mismatches:
            parts.append(
                f"Tensor in one, plain object in the other ({len(self.kind_mismatches)}): "
                f"{_listing(self.kind_mismatches)}"
            )
        if self.dtype_mismatches:
            parts.append(
                f"Dtype mismatches ({len(self.dtype_mismatches)}), which would be cast "
                f"silently: {_listing(self.dtype_mismatches, 10)}. Convert the model "
                "(model.to(dtype)) to the checkpoint's dtype before loading, or convert after."
            )
        if (self.missing or self.unexpected) and not self.shape_mismatches and not other_model:
            parts.append("Pass strict=False to load only the keys both sides have.")
        super().__init__("\n".join(parts))


class UnsafeCheckpointError(CheckpointError):
    """The checkpoint holds a pickle that would run code (or read outside itself).

    Nothing of it was executed: ckpt unpickles DCP's ``.metadata`` admitting only the
    types DCP writes there, and non-tensor values with ``torch.load(weights_only=True)``
    semantics (see [Note: no code from a checkpoint] in ``_format/safe_unpickling.py``). ``item``
    is the file or state key, ``found`` what was refused. If you wrote the checkpoint
    yourself and the value is a type you trust, pass it in ``safe_globals=[...]``.
    """

    def __init__(self, path: Path, item: str, found: str, why: str) -> None:
        self.path = path
        self.item = item
        self.found = found
        self.why = why
        super().__init__(
            f"checkpoint {path}: {item} refers to {found}: {why}. Nothing from it was run "
            f"or loaded; do not load this checkpoint unless you know who wrote it."
        )


class SignatureError(CheckpointError):
    """A load or verify with a ``key`` found the manifest unsigned or signed otherwise.

    The keyed manifest (HMAC-SHA256 over the manifest, whose BLAKE2b digests cover
    every file) is checked before any file is unpickled; a mismatch means the
    checkpoint was not written by a holder of the key, or was changed since.
    """

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(
            f"checkpoint {path} failed the keyed-manifest check: {reason}; nothing was "
            f"read. Check the key, or load it without key= only if you trust its source."
        )


class CheckpointInUseError(CheckpointError):
    """Another writer holds the checkpoint being saved, or committed it meanwhile.

    Two jobs saving into one folder (a job started twice, two shells) would write into
    and rename each other's directories; so a save first takes a lease on its target
    (``.<name>.lease`` beside it, see [Note: one writer per checkpoint] in
    ``_format/lease.py``) and the second writer gets this error before it writes anything.
    ``owner`` describes the other writer (host, pid, since when) when known, ``lease``
    is the lease file. Nothing of this save was kept.

    A :class:`~ckpt.CheckpointManager` raises it too, at a job's first save or load in a
    folder that another job's manager holds ([Note: one job per folder] in
    ``_format/job_lease.py``); ``fix`` then says what to do instead of the default.
    """

    def __init__(
        self, path: Path, owner: str, lease: Path | None, detail: str = "", fix: str = ""
    ) -> None:
        self.path = path
        self.owner = owner
        self.lease = lease
        self.detail = detail
        if fix:
            super().__init__(f"{detail}. Fix: {fix}.")
            return
        what = detail or f"another save is writing it: {owner}"
        fix = (
            "Two writers on one checkpoint folder damage each other's checkpoints: stop the "
            "other job or save to another folder"
        )
        if lease is not None:
            fix += (
                f"; if that process is gone (it ran on another host, so its death cannot "
                f"be seen from here), remove {lease}"
            )
        super().__init__(f"cannot save {path}: {what}; nothing of this save was kept. {fix}.")


class CheckpointCollectiveError(CheckpointError, CollectiveError):
    """A peer rank died, hung or went elsewhere while a checkpoint was saved or loaded.

    Both a :class:`CheckpointError` and a :class:`~flatparam.CollectiveError` (chained
    to the backend's error). Besides the collective's ``rank``, ``operation`` and
    ``phase`` (``"save (writing)"``, ...), it carries ``path`` (the checkpoint),
    ``step`` (``"agreement"``, ``"preparing"``, ``"planning"``, ``"writing"``,
    ``"commit"``, ``"verifying"``, ``"reading"``; ``""`` when not known) and
    ``missing_ranks``: the ranks found dead or stopped (empty when it could not be
    told, e.g. the peer runs on another host). See [Note: naming a fault inside a
    checkpoint] in ``_commit/peer_faults.py``.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        operation: str,
        target: str,
        phase: str,
        path: Path | None = None,
        step: str = "",
        missing_ranks: tuple[int, ...] = (),
    ) -> None:
        CollectiveError.__init__(
            self, message, rank=rank, operation=operation, target=target, phase=phase
        )
        self.path = path
        self.step = step
        self.missing_ranks = tuple(missing_ranks)
