"""Checkpoints move between wrappers and world sizes and resume identically.

A checkpoint written by fsdp (FULL_SHARD, auto-wrapped, with and without
``use_orig_params``) or by DDP + zero_optim on 2 ranks resumes on 4 ranks under fsdp
(both modes), DDP + zero_optim and plain DDP, and one written
on 4 ranks resumes on 2 and on 1; the losses of the next two steps and the weights
after them equal those of the uninterrupted run bit for bit (see tests/ckpt/_wrappers
for why exact equality holds across world sizes). Two paths are covered: ``ckpt.save``
/``ckpt.load`` on disk (sharded state, every rank writing its part), and the full
FQN-keyed state dicts in memory (``rank0_only``, ``torch.save``d by rank 0).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ckpt
from ckpt import FullStateDictConfig, StateDictType
from fsdp import FSDPModule
from tests.ckpt._wrappers import WRAPPERS, full_weights, resumes_from, same, train, wrap
from tests.ranks import run_ranks

SOURCES = ("fsdp", "fsdp-orig", "ddp-zero", "fully_shard")


def _full_model_state(model: nn.Module) -> dict[str, Any]:
    """The unwrapped keys, full, on rank 0 only (CPU)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        sd = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        return sd if dist.get_rank() == 0 else {}
    if isinstance(model, FSDPModule):
        from torch.distributed.tensor import DTensor

        sd = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()
        }
        return sd if dist.get_rank() == 0 else {}
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with ckpt.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        return model.state_dict()


def _load_full_model_state(model: nn.Module, sd: dict[str, Any]) -> None:
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model.module.load_state_dict(sd)
    elif isinstance(model, FSDPModule):
        from torch.distributed.tensor import DTensor, distribute_tensor

        current = model.state_dict()
        model.load_state_dict(
            {
                k: distribute_tensor(v, current[k].device_mesh, current[k].placements)
                if isinstance(current[k], DTensor)
                else v
                for k, v in sd.items()
            }
        )
    else:
        model.load_state_dict(sd)  # the default FULL type


def _rank_save(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in SOURCES:
        model, optim = wrap(kind)
        train(model, optim, 0, 3)
        ckpt.save({"model": model, "optim": optim, "step": 3}, Path(root) / kind)
        full = {
            "model": _full_model_state(model),
            "optim": ckpt.optim_state_dict(model, optim, full=True, rank0_only=True),
        }
        if dist.get_rank() == 0:
            torch.save(full, Path(root) / f"{kind}.pt")
        else:
            assert full == {"model": {}, "optim": {}}, "rank0_only leaves other ranks empty"
        losses = train(model, optim, 3, 5)
        out[kind] = (losses, full_weights(model))
    return out


def _rank_resume(root: str, expected: dict[str, Any]) -> dict[str, bool]:
    results: dict[str, bool] = {}
    for source in SOURCES:
        want_losses, want_weights = expected[source]
        full = torch.load(Path(root) / f"{source}.pt", weights_only=False)
        for kind in WRAPPERS:
            # On disk: ckpt.load reshards the sharded checkpoint.
            results[f"{source}->{kind} disk"] = resumes_from(
                Path(root) / source, kind, want_losses, want_weights
            )
            # In memory: the full FQN-keyed state dicts. A copy for each: torch's optimizers
            # load tensors like the step counts by reference and then count on in them.
            model, optim = wrap(kind, seed=9)
            loaded = copy.deepcopy(full)
            _load_full_model_state(model, loaded["model"])
            ckpt.load_optim_state_dict(model, optim, loaded["optim"])
            ok = train(model, optim, 3, 5) == want_losses
            results[f"{source}->{kind} full"] = ok and same(full_weights(model), want_weights)
    return results


@pytest.mark.parametrize(("saved_on", "loaded_on"), [(2, (4,)), (4, (2, 1))])
def test_resume_across_wrappers_and_world_sizes(
    tmp_path: Path, saved_on: int, loaded_on: tuple[int, ...]
) -> None:
    expected = run_ranks(_rank_save, saved_on, str(tmp_path), timeout=120)[0]
    for world_size in loaded_on:
        for results in run_ranks(_rank_resume, world_size, str(tmp_path), expected, timeout=180):
            assert results, "no sub-case ran"
            assert all(results.values()), {k: v for k, v in results.items() if not v}
