"""Checkpoints behind two functions, ``save_checkpoint`` and ``load_checkpoint``, on
the ckpt package (``ckpt.CheckpointManager``: step-numbered, atomic, verified).

ckpt knows every wrapper train.py builds: our FSDP (its SHARDED state dict, each rank
writing its chunks of every parameter, resharded on load at any world size) with the
optimizer over it (state keyed by parameter names, sharded the same way), our
ZeroRedundancyOptimizer (each rank's own parameters' state), and DDP with a plain
optimizer. Keys are the unwrapped model's parameter names, so a checkpoint loads at any
world size and, as it happens, under another wrapper.

[Note: what a checkpoint holds]
- ``model``, ``optim``: the model's and the optimizer's state, as ckpt saves them.
- ``trainer``: a JSON string, identical on every rank: the step, the data sampler's
  position, the metrics history, the world size and the model shape.
- ``rng.rank{r}``: each rank's torch RNG state (CPU, and CUDA when present). Restored
  when the world size is unchanged; at another world size the ranks are new, so they
  are re-seeded from (seed, step, rank) instead (this only matters with dropout).

With ``--snapshot-every N`` the same state also goes into host memory every N steps
(``ckpt.MemorySnapshots``: this rank's shard in ``/dev/shm`` and a replica in another
machine's), and a restarted job resumes from whichever of memory and disk holds the
newer step (``load_snapshot``).

Layout: ``<root>/step_00000300/`` per checkpoint, with ckpt's manifest of checksums.
ckpt writes it into a hidden ``.step_00000300.partial`` sibling and renames it once
every rank has finished, so a visible step folder is always complete; it removes the
debris of a killed save and all but the newest ``--keep-checkpoints``.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ckpt
from ckpt import CheckpointManager

__all__ = [
    "CheckpointError",
    "Found",
    "checkpoint_state",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_snapshot",
    "move_aside",
    "remove_checkpoints",
    "save_checkpoint",
    "scan_checkpoints",
]

_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ckpt.CheckpointError):
    """A checkpoint that cannot be used for this run, with the reason.

    A subclass of ckpt's own error, so ``except CheckpointError`` also catches what
    ckpt raises (a corrupt file, a missing key) with its message intact."""


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints under ``root``, oldest first (reads the folder only: no
    collective, so it is safe in an error handler)."""
    manager = CheckpointManager(root)
    return [(step, manager.path(step)) for step in manager.steps()]


@dataclass(frozen=True)
class Found:
    """A ``step_N`` folder under the checkpoint root, committed or not."""

    step: int
    path: Path
    committed: bool  # holds ckpt's manifest; False: damaged or never finished


def scan_checkpoints(root: Path) -> list[Found]:
    """Every ``step_N`` folder under ``root``, newest first, whether or not ckpt
    considers it committed, so that resuming can say why it passes one over (ckpt's own
    list silently holds only the committed ones)."""
    if not root.is_dir():
        return []
    committed = set(CheckpointManager(root).steps())
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match is not None and path.is_dir():
            step = int(match.group(1))
            found.append(Found(step, path, step in committed))
    return sorted(found, key=lambda f: f.step, reverse=True)


def move_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to ``NAME.damaged`` (``.damaged2``, ... if taken),
    out of the way of the save that will reach its step again; rank 0 alone."""
    target = path.with_name(f"{path.name}.damaged")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged{n}")
    path.rename(target)
    return target


def latest_checkpoint(root: Path) -> Path | None:
    """The newest committed checkpoint, or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def remove_checkpoints(root: Path) -> None:
    """Delete every checkpoint under ``root``, damaged ones too, and what interrupted
    saves left (rank 0 alone, for ``--overwrite``)."""
    for path in [f.path for f in scan_checkpoints(root)] + CheckpointManager(root).partial():
        shutil.rmtree(path)


def _rng_state() -> dict[str, torch.Tensor]:
    """This rank's RNG state under keys that only this rank has (DCP writes each
    rank's own copy)."""
    rank = dist.get_rank()
    state = {f"rng.rank{rank}": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[f"cuda_rng.rank{rank}"] = torch.cuda.get_rng_state()
    return state


def checkpoint_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any]
) -> dict[str, Any]:
    """What a checkpoint or a snapshot holds (see [Note: what a checkpoint holds])."""
    return {
        "model": model,
        "optim": optimizer,
        "trainer": json.dumps(trainer_state),
        **_rng_state(),
    }


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    keep: int,
) -> Path:
    """Save a checkpoint of step ``step`` (collective: every rank calls it) and keep
    only the newest ``keep``. Returns the checkpoint's folder.

    A checkpoint of the same step is replaced (``overwrite``), and a step older than the
    folder's newest is saved (``allow_older``): both happen only when a run that was
    resumed from an older step (``--resume STEP``) reaches them again, and the newer one
    is the one to continue from."""
    state = checkpoint_state(model, optimizer, trainer_state)
    manager = CheckpointManager(root, keep_last=keep)
    info = manager.save(step, state, overwrite=True, allow_older=True)
    return info.path


def _check_model_shape(where: str, trainer: dict[str, Any], model_shape: dict[str, int]) -> None:
    """Name the hyperparameter that differs, instead of a list of mismatched tensors."""
    saved_shape = trainer["model_shape"]
    if saved_shape != model_shape:
        diff = ", ".join(
            f"{key}: checkpoint {saved_shape.get(key)} vs this run {value}"
            for key, value in model_shape.items()
            if saved_shape.get(key) != value
        )
        raise CheckpointError(
            f"{where} is a checkpoint of another model ({diff}); "
            "resume with the checkpoint's model options or start a new --checkpoint-dir"
        )


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_shape: dict[str, int],
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``model`` and ``optimizer`` (collective),
    restore this rank's RNG state where it exists (see [Note: what a checkpoint
    holds]), and return the trainer state, with ``rng_restored`` added.

    The trainer state is read first (and every file checked against the manifest), so
    a checkpoint of another model says which hyperparameter differs before anything is
    loaded."""

    def read_head(head: dict[str, Any]) -> None:
        ckpt.load(head, path)

    def read_rest(state: dict[str, Any]) -> None:
        ckpt.load(state, path, verify=False)  # verified just above

    return _load_in_two(
        str(path), read_head, read_rest, model=model, optimizer=optimizer, model_shape=model_shape
    )


def load_snapshot(
    snapshots: ckpt.MemorySnapshots,
    found: ckpt.Found,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_shape: dict[str, int],
) -> dict[str, Any]:
    """``load_checkpoint`` for a snapshot in memory (``found`` by
    ``snapshots.find_latest()``): the same state, read from the surviving machines."""
    return _load_in_two(
        f"the snapshot of step {found.step}",
        lambda head: snapshots.load(head, found),
        lambda state: snapshots.load(state, found),
        model=model,
        optimizer=optimizer,
        model_shape=model_shape,
    )


def _load_in_two(
    where: str,
    read_head: Callable[[dict[str, Any]], Any],
    read_rest: Callable[[dict[str, Any]], Any],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_shape: dict[str, int],
) -> dict[str, Any]:
    """The trainer state first (its model shape checked), then the model, the
    optimizer and, at the same world size, this rank's RNG state."""
    head: dict[str, Any] = {"trainer": ""}
    try:
        read_head(head)
    except ckpt.StateDictMismatchError as exc:
        raise CheckpointError(
            f"{where} holds no trainer state: not a checkpoint of train.py ({exc})"
        ) from exc
    trainer: dict[str, Any] = json.loads(head["trainer"])
    _check_model_shape(where, trainer, model_shape)

    state: dict[str, Any] = {"model": model, "optim": optimizer}
    same_world = trainer["world_size"] == dist.get_world_size()
    rng = _rng_state() if same_world else {}
    state.update(rng)
    read_rest(state)
    for key in rng:
        if key.startswith("rng."):
            torch.set_rng_state(state[key])
        else:
            torch.cuda.set_rng_state(state[key])
    trainer["rng_restored"] = bool(rng)
    return trainer
