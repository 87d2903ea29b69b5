"""``fsdp.torch_compat`` / ``zero_optim.torch_compat``: ours under torch's names, reversibly.

A script written for torch's FSDP1 (imports from ``torch.distributed.fsdp``) must run
on ours unchanged after one ``install()`` call and train exactly as ours does when
imported directly; ``uninstall()`` must give torch's objects back.
"""

from __future__ import annotations

import importlib

import torch

import fsdp
import fsdp.torch_compat
import zero_optim
import zero_optim.torch_compat
from tests.fsdp._common import Block, batches, make_net, train
from tests.ranks import run_ranks

_TORCH_NAMES = [
    ("torch.distributed.fsdp", "FullyShardedDataParallel"),
    ("torch.distributed.fsdp", "ShardingStrategy"),
    ("torch.distributed.fsdp.api", "MixedPrecision"),
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "StateDictType"),
    ("torch.distributed.fsdp.wrap", "ModuleWrapPolicy"),
    ("torch.distributed.fsdp.wrap", "transformer_auto_wrap_policy"),
    ("torch.distributed.fsdp.sharded_grad_scaler", "ShardedGradScaler"),
    ("torch.distributed.optim", "ZeroRedundancyOptimizer"),
    ("torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook", "hook_with_zero_step"),
]


def _lookup() -> list[object]:
    return [getattr(importlib.import_module(m), n) for m, n in _TORCH_NAMES]


def test_install_is_idempotent_and_reversible() -> None:
    originals = _lookup()
    try:
        for _ in range(2):
            fsdp.torch_compat.install()
            zero_optim.torch_compat.install()
        assert fsdp.torch_compat.installed() and zero_optim.torch_compat.installed()
        patched = _lookup()
        assert patched[0] is fsdp.FullyShardedDataParallel
        assert patched[6] is fsdp.ShardedGradScaler
        assert patched[7] is zero_optim.ZeroRedundancyOptimizer
        assert all(type(p).__module__.split(".")[0] != "torch" for p in patched)
        assert all(
            getattr(p, "__module__", "").split(".")[0] in ("fsdp", "zero_optim") for p in patched
        ), patched
    finally:
        for _ in range(2):
            fsdp.torch_compat.uninstall()
            zero_optim.torch_compat.uninstall()
    assert _lookup() == originals
    assert not fsdp.torch_compat.installed()


def _torch_script() -> list[float]:
    """A user's script written against torch's FSDP1, unchanged."""
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    model = FSDP(
        make_net(),
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={Block}
        ),
        mixed_precision=MixedPrecision(reduce_dtype=torch.float32),
        device_id=torch.device("cpu"),
    )
    losses = train(model, batches(3))[0]
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        assert set(model.state_dict()) == set(make_net().state_dict())
    return losses


def _compare_rank() -> None:
    import torch.distributed.fsdp as tfsdp

    fsdp.torch_compat.install()
    try:
        assert tfsdp.FullyShardedDataParallel is fsdp.FullyShardedDataParallel
        ours = _torch_script()
    finally:
        fsdp.torch_compat.uninstall()
    assert tfsdp.FullyShardedDataParallel is not fsdp.FullyShardedDataParallel
    theirs = _torch_script()  # torch's own FSDP1, same script
    assert ours == theirs, (ours, theirs)


def test_unchanged_torch_script_runs_on_ours_after_install() -> None:
    run_ranks(_compare_rank, 2, timeout=120)
