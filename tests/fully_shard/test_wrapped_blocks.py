"""fully_shard on blocks inside wrappers that forward attributes to the module they wrap.

``CheckpointWrapper`` (activation checkpointing) and ``torch.compile``'s
``OptimizedModule`` hand every attribute they lack to the wrapped module. A
lookup through ``getattr`` on such a wrapper finds the inner module's composable
registry and fully_shard state, and took the wrapper for a module already
sharded: HF accelerate (``fsdp_version=2`` with activation checkpointing) shards
each block's inner module and then its checkpoint wrapper, and ours refused the
second call (issue 41). Each case here is built and trained three AdamW steps
with torch's ``fully_shard`` and with ours in the same ranks: losses, full
gradients and full parameters bit for bit at 2 ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.fully_shard._common import TinyNet, compare, full, train_plain
from tests.ranks import run_ranks

CASES = {
    # accelerate's order: the inner module first, then its checkpoint wrapper, then the root.
    "checkpoint_inner_then_wrapper": ("checkpoint", "inner_then_wrapper"),
    # Only the wrappers, then the root (torchtitan's order with activation checkpointing).
    "checkpoint_wrapper_only": ("checkpoint", "wrapper_only"),
    # The checkpoint wrapper put around blocks already sharded, then the root.
    "checkpoint_around_sharded": ("checkpoint", "inner_only"),
    # torch.compile(block) (an OptimizedModule in the model), then fully_shard on it.
    "compiled_wrapper_only": ("compile", "wrapper_only"),
    # The block sharded, then compiled, then the compiled wrapper sharded too.
    "compiled_inner_then_wrapper": ("compile", "inner_then_wrapper"),
}


def _wrap(block: nn.Module, kind: str) -> nn.Module:
    if kind == "checkpoint":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        return checkpoint_wrapper(block)
    # aot_eager: dynamo and AOTAutograd trace the block as inductor would, at a fraction
    # of its compile time on 2 cores; the kernels are eager ones, so both runs' numbers
    # come from the same code.
    return torch.compile(block, backend="aot_eager")  # type: ignore[return-value]


def _inner(wrapper: nn.Module) -> nn.Module:
    inner = wrapper._modules.get("_checkpoint_wrapped_module") or wrapper._modules["_orig_mod"]
    assert inner is not None
    return inner


def _build(impl: str, kind: str, order: str) -> nn.Module:
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp import fully_shard  # type: ignore[assignment]
    torch.manual_seed(0)
    model = TinyNet()
    blocks: Any = model.blocks
    for i, block in enumerate(list(blocks)):
        if order == "inner_only":
            fully_shard(block)
        wrapper = _wrap(block, kind)
        blocks[i] = wrapper
        if order == "inner_then_wrapper":
            fully_shard(_inner(wrapper))
        if order in ("wrapper_only", "inner_then_wrapper"):
            fully_shard(wrapper)
    fully_shard(model)
    return model


def _registered(model: nn.Module) -> list[str]:
    """Which of the model's modules each implementation's registry calls fully sharded."""
    from torch.distributed._composable.contract import REGISTRY_KEY

    return [
        name
        for name, m in model.named_modules()
        if "fully_shard" in m.__dict__.get(REGISTRY_KEY, {})
    ]


def _case_rank(kind: str, order: str) -> dict[str, Any]:
    torch._dynamo.reset()
    ref_model = _build("torch", kind, order)
    ref = train_plain(ref_model)
    torch._dynamo.reset()
    ours_model = _build("ours", kind, order)
    ours = train_plain(ours_model)
    equal, worst = compare(ref, ours)
    return {
        "equal": equal,
        "worst": worst,
        "registered": (_registered(ref_model), _registered(ours_model)),
        "losses": (ref["loss"], ours["loss"]),
        "first_param": full(next(ours_model.parameters())).sum().item(),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_wrapped_blocks_train_as_torchs(case: str) -> None:
    kind, order = CASES[case]
    results = run_ranks(_case_rank, 2, kind, order, timeout=240)
    for rank, r in enumerate(results):
        ref_names, our_names = r["registered"]
        assert our_names == ref_names, f"rank {rank}: sharded modules {our_names} != {ref_names}"
        assert r["equal"], f"rank {rank}: differs from torch's by up to {r['worst']:.3g}"
        # Training moved the model (a case that never stepped would compare equal too).
        assert r["losses"][0][0] != r["losses"][0][-1], r["losses"]


def _refusal_rank() -> list[str]:
    """A module sharded twice is still refused, and its wrapper is not."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    import fsdp

    messages = []
    block = nn.Linear(4, 4)
    fsdp.fully_shard(block)
    wrapper = checkpoint_wrapper(block)
    for target in (block, wrapper):
        try:
            fsdp.fully_shard(target)
            messages.append("accepted")
        except AssertionError as e:
            messages.append(str(e))
    return messages


def test_a_module_sharded_twice_is_refused_but_not_its_wrapper() -> None:
    for twice, wrapper in run_ranks(_refusal_rank, 1):
        assert "can only be applied to a module once" in twice
        assert "Linear" in twice
        assert wrapper == "accepted"
