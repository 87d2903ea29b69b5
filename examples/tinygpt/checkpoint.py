"""Checkpoints behind two functions, ``save_checkpoint`` and ``load_checkpoint``.

Today they use ``torch.distributed.checkpoint`` (DCP) directly with torch's
``get_state_dict``/``set_state_dict``, which understand plain and DDP models (and
torch's own FSDP); the ``ckpt`` package will take their place (its ``save``/``load``
and step-numbered manager) without the trainer noticing.

[Note: what a checkpoint holds]
- ``model``, ``optim``: state dicts keyed by the unwrapped model's parameter names
  (no ``module.`` prefixes), so a checkpoint loads under any wrapper and, because DCP
  reshards on load, at any world size.
- ``trainer``: JSON bytes, identical on every rank: the step, the data sampler's
  position, the metrics history, the world size and the model shape.
- ``rng.rank{r}``: each rank's torch RNG state (CPU, and CUDA when present). Restored
  when the world size is unchanged; at another world size the ranks are new, so they
  are re-seeded from (seed, step, rank) instead (this only matters with dropout).

Layout: ``<root>/step-0000300/`` per checkpoint. It is written as
``step-0000300.partial`` and renamed by rank 0 once every rank has finished, so a
directory without the suffix is always complete.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used for this run, with the reason."""


def check_supported(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse, before training starts, a model/optimizer pair whose state these
    functions would save wrongly.

    torch's ``get_state_dict`` understands plain and DDP models with ``torch.optim``
    optimizers (and torch's own FSDP). Given our FSDP, it sees each rank's flat-parameter
    *shard* under a key that every rank shares, and DCP keeps one rank's copy: a
    checkpoint that loads without error and resumes with the wrong optimizer state.
    Our FSDP and ZeroRedundancyOptimizer get checkpoints through the ckpt package."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.nn.parallel import DistributedDataParallel

    inner = model.module if isinstance(model, DistributedDataParallel) else model
    plain_model = isinstance(inner, TorchFSDP) or not any(
        type(m).__module__.split(".")[0] == "fsdp" for m in inner.modules()
    )
    plain_optim = type(optimizer).__module__.startswith("torch.optim")
    if not (plain_model and plain_optim):
        raise CheckpointError(
            f"checkpoints of {type(model).__name__} with {type(optimizer).__name__} need "
            "the ckpt package's support for our fsdp/zero_optim, which train.py does not "
            "use yet; for now use --wrapper ddp, or --checkpoint-every 0 to train without "
            "checkpoints"
        )


def checkpoint_dir(root: Path, step: int) -> Path:
    """The folder of step ``step``'s checkpoint."""
    return root / f"step-{step:07d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def _rng_state() -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    state = {f"rng.rank{rank}": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[f"cuda_rng.rank{rank}"] = torch.cuda.get_rng_state()
    return state


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
    only the newest ``keep``. Returns the checkpoint's folder."""
    final = checkpoint_dir(root, step)
    partial = final.with_name(final.name + ".partial")
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # debris of a killed save
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {
        "model": model_state,
        "optim": optim_state,
        "trainer": json.dumps(trainer_state).encode(),
        **_rng_state(),
    }
    dcp_save(state, checkpoint_id=partial)
    # dcp.save returns on every rank only after rank 0 wrote the metadata: complete.
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for _, old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_shape: dict[str, int],
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``model`` and ``optimizer`` (collective),
    restore this rank's RNG state where it exists (see [Note: what a checkpoint
    holds]), and return the trainer state, with ``rng_restored`` added.

    ``model_shape`` is checked first, so loading a checkpoint of another model says
    which hyperparameter differs instead of failing deep inside DCP."""
    keys = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    if "trainer" not in keys:
        raise CheckpointError(f"{path} holds no trainer state: not a checkpoint of train.py")
    head: dict[str, Any] = {"trainer": b""}
    dcp_load(head, checkpoint_id=path)
    trainer: dict[str, Any] = json.loads(head["trainer"])
    saved_shape = trainer["model_shape"]
    if saved_shape != model_shape:
        diff = ", ".join(
            f"{key}: checkpoint {saved_shape.get(key)} vs this run {value}"
            for key, value in model_shape.items()
            if saved_shape.get(key) != value
        )
        raise CheckpointError(
            f"{path} is a checkpoint of another model ({diff}); "
            "resume with the checkpoint's model options or start a new --checkpoint-dir"
        )

    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    same_world = trainer["world_size"] == dist.get_world_size()
    rng = {k: v for k, v in _rng_state().items() if k in keys} if same_world else {}
    state.update(rng)
    dcp_load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    for key in rng:
        if key.startswith("rng."):
            torch.set_rng_state(state[key])
        else:
            torch.cuda.set_rng_state(state[key])
    trainer["rng_restored"] = bool(rng)
    return trainer
