"""Step-numbered checkpoints under one directory, for training loops.

``root/step_<N>`` holds the checkpoint of step N (zero-padded to 8 digits so ``ls``
sorts them). Only committed directories count (see [Note: atomic commit]); what
interrupted saves or prunes left behind is reported, never loaded, and removed by the
next save. Old checkpoints are pruned only after a new one is committed and the ones
kept were checked, so at least one good checkpoint exists at every moment; another
writer in the same root never loses a running save or its checkpoint to the pruning
([Note: one writer per checkpoint] in ``_format/lease.py``).

A manager holds its root for its job from its first save or load to ``close()`` ([Note:
one job per folder] in ``_format/job_lease.py``), and saves steps forward only: a step
older than the root's newest committed one is refused (:class:`~ckpt.OlderStepError`)
unless asked for (``allow_older=True``), and the newest itself only with
``overwrite=True``. Both checks run on rank 0 inside the save's own preparation, so
they cost no collective.
"""

from __future__ import annotations

import contextlib
import re
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch.distributed as dist

from ckpt._comm import Comm, device_of, on_device
from ckpt._commit.save_load import (
    AsyncSave,
    CheckpointInfo,
    PathLike,
    _as_path,
    async_save,
    load,
    save,
    wait_pending,
)
from ckpt._errors import (
    CheckpointError,
    CheckpointInUseError,
    NotACheckpointError,
    OlderStepError,
)
from ckpt._format import layout
from ckpt._format.file_checks import manifest_size_problems
from ckpt._format.job_lease import hold_folder, let_go
from ckpt._format.lease import Lease, acquire
from ckpt._format.manifest import Checksum, read_manifest

__all__ = ["CheckpointManager"]

_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointManager:
    """Save, find, load and prune ``root/step_<N>`` checkpoints.

    ``keep_last=K`` keeps the K newest committed checkpoints (None keeps all); the
    oldest are removed by rank 0 right after a newer one commits. Every method that
    saves or loads is collective: call it on every rank with the same arguments.

    The manager's job holds ``root`` from its first save or load until :meth:`close`
    (or the manager's collection, or the process's exit): another job's manager gets
    :class:`~ckpt.CheckpointInUseError` at its first save or load there ([Note: one job
    per folder]). Use it as a context manager to let go at the end of a block.

    Example::

        manager = CheckpointManager("checkpoints", keep_last=3)
        state = {"model": model, "optim": optimizer}
        start = manager.load_latest(state) or 0     # resume, or start fresh
        for step in range(start + 1, steps + 1):
            train_one_step()
            if step % 100 == 0:
                manager.async_save(step, state)      # training continues meanwhile
        manager.wait()
    """

    root: Path
    keep_last: int | None
    checksum: Checksum | str | None
    key: bytes | str | None
    process_group: dist.ProcessGroup | None

    def __init__(
        self,
        root: PathLike,
        *,
        keep_last: int | None = None,
        checksum: Checksum | str | None = None,
        key: bytes | str | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or keep_last < 1):
            raise ValueError(f"keep_last must be None (keep all) or >= 1, got {keep_last!r}")
        self.root = _as_path(root)
        self.keep_last = keep_last
        self.checksum = checksum
        self.key = key  # signs every save and is required by every load (keyed manifest)
        self.process_group = process_group
        self._holding: weakref.finalize[Any, Any] | None = None  # rank 0's hold on root

    def _hold(self) -> None:
        """Rank 0, inside a save's or load's own first step: hold ``root`` for this job
        (once; see [Note: one job per folder])."""
        if self._holding is not None and self._holding.alive:
            return
        for gone in hold_folder(self.root, layout.new_token()):
            warnings.warn(
                f"ckpt: took over {self.root} from a job that is gone: {gone}", stacklevel=6
            )
        self._holding = weakref.finalize(self, let_go, self.root)

    def close(self) -> None:
        """Let go of ``root`` (rank 0's lease; a no-op on other ranks and when not held).

        Waits for a running asynchronous save first. Another job may use the folder
        afterwards; this manager takes it again at its next save or load."""
        wait_pending()
        if self._holding is not None:
            self._holding()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def path(self, step: int) -> Path:
        """The directory of ``step``'s checkpoint (whether or not it exists)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        return self.root / f"step_{step:08d}"

    def steps(self) -> list[int]:
        """The steps with a committed checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m is not None and layout.is_committed(p):
                found.append(int(m.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        """The newest committed step, or None when there is none yet."""
        steps = self.steps()
        return steps[-1] if steps else None

    def partial(self) -> list[Path]:
        """Directories left by interrupted saves, overwrites or prunes, or written by
        another writer's running save (never loaded)."""
        return layout.leftovers(self.root)

    def _prune(self, saved: Path) -> None:
        """Rank 0, after committing ``saved`` (holding its lease): drop leftovers and
        all but the newest ``keep_last`` checkpoints, never ``saved`` itself (a step
        saved with ``allow_older=True`` may be older than those kept).

        Another writer may save into the same root (a job started twice): each
        leftover and each checkpoint is removed only under its own lease, so a save
        that is running (its partial directory, the checkpoint it overwrites) is left
        alone. Old checkpoints go only once the newest ``keep_last`` were checked
        against their manifests (every file there, of its size) and ``saved`` is one
        of those or older: a damaged checkpoint never counts as kept, and nothing is
        deleted while too few whole ones remain.
        """
        for leftover in self.partial():
            parsed = layout.leftover_target(leftover)
            if parsed is None:
                continue
            name, kind = parsed
            target = self.root / name
            if target == saved or (kind == "old" and not target.exists()):
                continue  # this save cleaned its own; an interrupted overwrite's only copy
            with _lease_or_none(target) as lease:
                if lease is None:
                    continue  # a save to it is running
                if kind == "partial":
                    warnings.warn(
                        f"ckpt: removing {leftover}, left by a save that was interrupted "
                        f"before its commit",
                        stacklevel=2,
                    )
                layout.remove(leftover)
        if self.keep_last is None:
            return
        steps = self.steps()
        kept: list[int] = []
        for step in reversed(steps):
            if len(kept) == self.keep_last:
                break
            problems = _size_problems(self.path(step))
            if problems:
                warnings.warn(
                    f"ckpt: {self.path(step)} is damaged ({problems}); it does not count as "
                    f"one of the {self.keep_last} checkpoints to keep, and is not deleted",
                    stacklevel=2,
                )
                continue
            kept.append(step)
        if len(kept) < self.keep_last:
            return  # too few whole checkpoints: delete nothing
        for step in steps:
            if step >= kept[-1]:
                break
            if self.path(step) == saved:
                continue
            with _lease_or_none(self.path(step)) as lease:
                if lease is not None:
                    layout.remove(self.path(step))

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        overwrite: bool = False,
        allow_older: bool = False,
    ) -> CheckpointInfo:
        """Save ``state`` as ``step`` and commit it, then prune; collective.

        ``step`` must be newer than the root's newest committed step: the newest itself
        is replaced only with ``overwrite=True``, an older step is saved only with
        ``allow_older=True`` (a run resumed from an older step on purpose), else
        :class:`~ckpt.CheckpointExistsError` / :class:`~ckpt.OlderStepError`.
        """
        options = self._save_options(step, overwrite, allow_older)
        return save(state, self.path(step), overwrite=overwrite, **options)

    def async_save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        overwrite: bool = False,
        allow_older: bool = False,
    ) -> AsyncSave:
        """Save ``state`` as ``step`` in the background; prunes after it commits. The
        step is checked as by :meth:`save`, before ``async_save`` returns."""
        options = self._save_options(step, overwrite, allow_older)
        return async_save(state, self.path(step), overwrite=overwrite, **options)

    def _save_options(self, step: int, overwrite: bool, allow_older: bool) -> dict[str, Any]:
        path = self.path(step)  # validates the step on every rank
        return {
            "checksum": self.checksum,
            "key": self.key,
            "process_group": self.process_group,
            "_on_prepare": self._before_save(step, overwrite, allow_older),
            "_on_commit": lambda: self._prune(path),
        }

    def _before_save(self, step: int, overwrite: bool, allow_older: bool) -> Callable[[], None]:
        """Rank 0's checks inside the save's preparation: the folder's lease, then the
        step against the newest committed one."""

        def check() -> None:
            self._hold()
            newest = self.latest()
            if newest is None or step > newest or (step == newest and overwrite):
                return  # equal without overwrite: the save's own "exists" error
            if step < newest and not allow_older:
                raise OlderStepError(self.root, step, newest)

        return check

    def wait(self) -> CheckpointInfo | None:
        """Wait for a running asynchronous save (see ``ckpt.wait_pending``)."""
        return wait_pending()

    def load(self, state: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> int:
        """Load ``step`` (default: the newest committed) into ``state``; returns the step.

        Keyword arguments go to ``ckpt.load`` (``strict``, ``verify``). Raises
        ``NotACheckpointError`` when there is no committed checkpoint to load.
        """
        chosen = self._choose(step, state)
        if chosen is None:
            raise NotACheckpointError(self.root, "it holds no committed step_<N> checkpoint yet")
        kwargs.setdefault("key", self.key)
        load(state, self.path(chosen), process_group=self.process_group, **kwargs)
        return chosen

    def load_latest(self, state: Mapping[str, Any], **kwargs: Any) -> int | None:
        """Load the newest committed checkpoint and return its step; None if there is none.

        The resume idiom: ``start = manager.load_latest(state) or 0``.
        """
        chosen = self._choose(None, state)
        if chosen is None:
            return None
        kwargs.setdefault("key", self.key)
        load(state, self.path(chosen), process_group=self.process_group, **kwargs)
        return chosen

    def _choose(self, step: int | None, state: Mapping[str, Any]) -> int | None:
        """Rank 0 picks the step (all ranks must load the same one); reports leftovers.

        The decision travels on the device of ``state``'s model, as in ``load``.
        """
        wait_pending()
        comm = Comm.of(self.process_group)

        def pick() -> int | None:
            self._hold()
            leftovers = self.partial()
            if leftovers:
                warnings.warn(
                    f"ckpt: ignoring {', '.join(map(str, leftovers))} (left by interrupted "
                    f"saves; the next save removes them)",
                    stacklevel=5,
                )
            if step is not None:
                self.path(step)  # validates
                return step
            return self.latest()

        with on_device(device_of(state)):
            return comm.run_on_coordinator(f"choose a checkpoint in {self.root}", pick)

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.root)!r}, keep_last={self.keep_last})"


@contextlib.contextmanager
def _lease_or_none(target: Path) -> Iterator[Lease | None]:
    """The lease on ``target`` for the block, or None when a save holds it."""
    try:
        lease, _ = acquire(target, layout.new_token())
    except CheckpointInUseError:
        yield None
        return
    try:
        yield lease
    finally:
        lease.release()


def _size_problems(path: Path) -> str:
    """What is wrong with ``path``'s files by size against its manifest; "" if nothing."""
    try:
        problems = manifest_size_problems(path, read_manifest(path))
    except (CheckpointError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return "; ".join(map(str, problems))
