"""Step-numbered checkpoints under one directory, for training loops.

``root/step_<N>`` holds the checkpoint of step N (zero-padded to 8 digits so ``ls``
sorts them). Only committed directories count (see [Note: atomic commit]); what
interrupted saves or prunes left behind is reported, never loaded, and removed by the
next save. Old checkpoints are pruned only after a new one is committed, so at least
one good checkpoint exists at every moment.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ckpt import _layout
from ckpt._checkpoint import (
    AsyncSave,
    CheckpointInfo,
    PathLike,
    _as_path,
    async_save,
    load,
    save,
    wait_pending,
)
from ckpt._comm import Comm, device_of, on_device
from ckpt._errors import NotACheckpointError
from ckpt._manifest import Checksum

__all__ = ["CheckpointManager"]

_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointManager:
    """Save, find, load and prune ``root/step_<N>`` checkpoints.

    ``keep_last=K`` keeps the K newest committed checkpoints (None keeps all); the
    oldest are removed by rank 0 right after a newer one commits. Every method that
    saves or loads is collective: call it on every rank with the same arguments.

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
            if m is not None and _layout.is_committed(p):
                found.append(int(m.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        """The newest committed step, or None when there is none yet."""
        steps = self.steps()
        return steps[-1] if steps else None

    def partial(self) -> list[Path]:
        """Directories left by interrupted saves, overwrites or prunes (never loaded)."""
        return _layout.leftovers(self.root)

    def _prune(self) -> None:
        """Rank 0, after a commit: drop leftovers and all but the newest ``keep_last``."""
        for leftover in self.partial():
            name, _, kind = leftover.name[1:].rpartition(".")
            if kind == "old" and not (self.root / name).exists():
                continue  # an interrupted overwrite: the only copy of that step; keep it
            if kind == "partial":
                warnings.warn(
                    f"ckpt: removing {leftover}, left by a save that was interrupted before "
                    f"its commit",
                    stacklevel=2,
                )
            _layout.remove(leftover)
        if self.keep_last is None:
            return
        steps = self.steps()
        for step in steps[: max(0, len(steps) - self.keep_last)]:
            _layout.remove(self.path(step))

    def save(
        self, step: int, state: Mapping[str, Any], *, overwrite: bool = False
    ) -> CheckpointInfo:
        """Save ``state`` as ``step`` and commit it, then prune; collective."""
        return save(
            state,
            self.path(step),
            overwrite=overwrite,
            checksum=self.checksum,
            key=self.key,
            process_group=self.process_group,
            _on_commit=self._prune,
        )

    def async_save(
        self, step: int, state: Mapping[str, Any], *, overwrite: bool = False
    ) -> AsyncSave:
        """Save ``state`` as ``step`` in the background; prunes after it commits."""
        return async_save(
            state,
            self.path(step),
            overwrite=overwrite,
            checksum=self.checksum,
            key=self.key,
            process_group=self.process_group,
            _on_commit=self._prune,
        )

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
