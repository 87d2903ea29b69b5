"""Gathers that outlive an optimizer step must not be used (issue 32).

``misprefetch``: ``in_proj.set_modules_to_backward_prefetch([out_proj])`` on
``in_proj -> relu -> out_proj``: when in_proj's backward starts, out_proj's has
already run, so the prefetch gathers a module nothing will use this backward.
torch's fully_shard drops such a gather at the end of the backward and trains
like DDP; ours used to keep the gathered parameters, stale after the optimizer
step, for the next forward.

``keep_after_backward`` / ``keep_all`` / ``unshard_before_step``: gathered
parameters kept across ``optimizer.step()`` (``set_reshard_after_backward(False)``,
with and without ``reshard_after_forward=False``, or an ``unshard()`` by hand
before the step). torch's fully_shard computes the next forward with the old
values (its losses differ from DDP's from step 1); ours sees that the sharded
data changed since the gather and gathers again ([Note: stale gathers]).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.ranks import run_ranks

STEPS = 3


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(16, 32)
        self.out_proj = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


def _train(impl: str, knob: str) -> list[tuple[float, float]]:
    """Losses of ``impl``'s fully_shard with ``knob`` against DDP-style averaging."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp import fully_shard  # type: ignore[assignment]
    torch.manual_seed(0)
    model = MLP()
    ref = MLP()
    ref.load_state_dict(model.state_dict())
    fully_shard(model.in_proj)
    fully_shard(model.out_proj)
    fully_shard(model)
    if knob == "misprefetch":
        model.in_proj.set_modules_to_backward_prefetch([model.out_proj])  # type: ignore[operator]
    elif knob == "keep_after_backward":
        for m in (model, model.in_proj, model.out_proj):
            m.set_reshard_after_backward(False)  # type: ignore[operator]
    elif knob == "keep_all":
        for m in (model, model.in_proj, model.out_proj):
            m.set_reshard_after_forward(False)  # type: ignore[operator]
            m.set_reshard_after_backward(False)  # type: ignore[operator]
    elif knob != "unshard_before_step":
        raise AssertionError(knob)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank())
    losses: list[tuple[float, float]] = []
    for _ in range(STEPS):
        x = torch.randn(2, 16)
        loss = model(x).sum()
        loss.backward()
        if knob == "unshard_before_step":
            model.out_proj.unshard()  # type: ignore[operator]
        opt.step()
        opt.zero_grad()
        ref_loss = ref(x).sum()
        ref_loss.backward()
        for p in ref.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.item(), ref_loss.item()))
    return losses


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize(
    ("impl", "knob"),
    [
        ("torch", "misprefetch"),  # the reference behaviour
        ("ours", "misprefetch"),
        ("ours", "keep_after_backward"),
        ("ours", "keep_all"),
        ("ours", "unshard_before_step"),
    ],
)
def test_gathers_across_step_train_like_ddp(impl: str, knob: str, world_size: int) -> None:
    for rank_losses in run_ranks(_train, world_size, impl, knob):
        for ours, ref in rank_losses:
            assert ours == pytest.approx(ref, rel=1e-5, abs=1e-5), rank_losses
