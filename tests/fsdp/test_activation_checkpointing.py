"""Activation checkpointing composed with FSDP, with and without ``use_orig_params``.

Three placements, each trained for 5 AdamW steps and compared with DDP on the
plain model (recomputation repeats the same arithmetic, so at world size 2
the results must be bit-equal; at 4, 1e-5 as in ``test_parity.py``) and with
torch's FSDP1 on the same structure (bit-equal at world size 2; at 4, the
use_orig_params layouts differ, see ``test_orig_params.py``):

- ``inner``: ``torch.utils.checkpoint`` (non-reentrant) inside a wrapped
  block's forward; the recomputation reads the views the pre-backward hook made.
- ``wrapper_outside``: ``checkpoint_wrapper`` applied before wrapping, so
  the FSDP unit sits inside the checkpoint wrapper and recomputation re-runs
  the unit's forward during its backward ([Note: recomputation] in
  ``_fsdp_state.py``), reentrant and not, and non-reentrant without early stop
  (so that the recomputation reaches the unit's post-forward hook).
- ``wrapper_inside``: ``apply_activation_checkpointing`` after wrapping, so
  the checkpoint wrapper sits inside the unit.
Also checked: the checkpointed runs really recompute (a forward counter), and
FULL_SHARD frees each unit after its forward in every placement.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from tests.fsdp._common import Block, batches, full_params, loss_fn, make_net, max_diff, train
from tests.ranks import run_ranks

STEPS = 5


class CheckpointedBlock(Block):
    """A block that checkpoints its own body (non-reentrant)."""

    calls = 0  # forwards of the body, recomputations included

    def _body(self, x: Tensor) -> Tensor:
        type(self).calls += 1
        return super().forward(x)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = checkpoint(self._body, x, use_reentrant=False)
        return out


def _inner_net() -> nn.Module:
    net: Any = make_net()
    for i, block in enumerate(net.blocks):
        new = CheckpointedBlock()
        new.load_state_dict(block.state_dict())
        net.blocks[i] = new
    return net  # type: ignore[no-any-return]


def _is_block(m: nn.Module) -> bool:
    return isinstance(m, Block)


def _build(api: Any, wrap_mod: Any, placement: str, reentrant: bool, orig: bool) -> nn.Module:
    kw: dict[str, Any] = {
        "device_id": torch.device("cpu"),
        "use_orig_params": orig,
        "auto_wrap_policy": wrap_mod.ModuleWrapPolicy({Block, CheckpointedBlock}),
    }
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=impl)
    if placement == "inner":
        return api.FullyShardedDataParallel(_inner_net(), **kw)  # type: ignore[no-any-return]
    net = make_net()
    if placement == "wrapper_outside":
        apply_activation_checkpointing(net, checkpoint_wrapper_fn=wrapper, check_fn=_is_block)
        model: nn.Module = api.FullyShardedDataParallel(net, **kw)
        return model
    model = api.FullyShardedDataParallel(net, **kw)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=_is_block)
    return model


# name -> (placement, reentrant, early stop of non-reentrant recomputation)
PLACEMENTS: dict[str, tuple[str, bool, bool]] = {
    "inner": ("inner", False, True),
    "wrapper_outside": ("wrapper_outside", False, True),
    "wrapper_outside_no_early_stop": ("wrapper_outside", False, False),
    "wrapper_outside_reentrant": ("wrapper_outside", True, True),
    "wrapper_inside": ("wrapper_inside", False, True),
    "wrapper_inside_reentrant": ("wrapper_inside", True, True),
}


def _unwrapped_names(params: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in params.items()}


def _count_block_forwards(model: nn.Module) -> list[int]:
    counts = [0]

    def hook(*args: Any) -> None:
        counts[0] += 1

    for m in model.modules():
        if type(m) is Block:
            m.register_forward_pre_hook(hook)  # recomputation may stop early, after it
    return counts


def _rank_checkpointing() -> dict[str, Any]:
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.wrap as torch_wrap

    import fsdp
    import fsdp.wrap

    data = batches(STEPS)
    ddp = DDP(make_net())
    ddp_losses, _ = train(ddp, data)
    ddp_params = full_params(ddp)
    out: dict[str, Any] = {}
    for name, (placement, reentrant, early_stop) in PLACEMENTS.items():
        for orig in (False, True):
            stack = contextlib.ExitStack()
            stack.enter_context(set_checkpoint_early_stop(early_stop))
            ours = _build(fsdp, fsdp.wrap, placement, reentrant, orig)
            theirs = _build(torch_fsdp, torch_wrap, placement, reentrant, orig)
            CheckpointedBlock.calls = 0
            counts = _count_block_forwards(ours)
            losses, _ = train(ours, data)
            recomputed = CheckpointedBlock.calls if placement == "inner" else counts[0]
            t_losses, _ = train(theirs, data)
            params = full_params(ours)
            # After a forward with gradients, FULL_SHARD has freed every non-root unit.
            loss = loss_fn(ours(data[0][0]), data[0][1])
            gathered = sum(
                s.unit.unsharded_storage_bytes()
                for m in ours.modules()
                if isinstance(m, fsdp.FullyShardedDataParallel)
                and (s := m._fsdp_state).unit is not None
                and not s.is_root
            )
            loss.backward()
            stack.close()
            out[f"{name}/orig={orig}"] = {
                "loss_vs_ddp": max(abs(a - b) for a, b in zip(losses, ddp_losses, strict=True)),
                "param_vs_ddp": max_diff(params, ddp_params),
                "loss_vs_torch": max(abs(a - b) for a, b in zip(losses, t_losses, strict=True)),
                "param_vs_torch": max_diff(params, _unwrapped_names(full_params(theirs))),
                "forwards": recomputed,
                "gathered_after_forward": gathered,
            }
    dist.barrier()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_activation_checkpointing_parity(world_size: int) -> None:
    n_blocks = 3
    for rank, results in enumerate(run_ranks(_rank_checkpointing, world_size, timeout=300)):
        for name, r in results.items():
            where = f"rank {rank}, {name}: {r}"
            tol = 0.0 if world_size == 2 else 1e-5
            assert r["loss_vs_ddp"] <= tol, where
            assert r["param_vs_ddp"] <= tol, where
            assert r["loss_vs_torch"] <= tol, where
            assert r["param_vs_torch"] <= tol, where
            assert r["forwards"] == 2 * n_blocks * STEPS, where  # forward + recomputation
            assert r["gathered_after_forward"] == 0, where
