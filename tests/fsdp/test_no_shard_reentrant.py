"""NO_SHARD's gradient all-reduce when the post-backward hook fires twice in one backward.

A module used several times, each time under reentrant activation checkpointing, gets
its gradient in several inner backward passes: autograd accumulates into the flat
parameter's ``.grad`` and runs the post-accumulate hook once per pass. An
aliased NO_SHARD unit all-reduced ``.grad`` in place, so the second pass
accumulated into a tensor still being reduced (gloo reduces on its own thread,
NCCL on its own stream) and the first sum was reduced a second time. The
gradients must equal the average over ranks of a plain model's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tests.ranks import run_ranks

# Three uses: the third pass accumulates into the first pass's reduced gradient,
# which the reduction queue (one in flight) has put back on the parameter by then.
USES = 3


class _UsedTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        for _ in range(USES):
            x = torch.tanh(checkpoint(self.lin, x, use_reentrant=True))
        return x


def _batch(rank: int) -> Tensor:
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(3, 4, generator=g).requires_grad_()


def _rank(with_hook: bool) -> float:
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
    from fsdp import ShardingStrategy

    world = dist.get_world_size()
    torch.manual_seed(0)
    plain = _UsedTwice()
    model = FSDP(
        _UsedTwice(),
        sharding_strategy=ShardingStrategy.NO_SHARD,
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    model.load_state_dict(plain.state_dict())  # FULL state dict by default
    if with_hook:

        def allreduce_mean(state: object, grad: Tensor) -> None:
            dist.all_reduce(grad)
            grad.div_(world)

        model.register_comm_hook(None, allreduce_mean)
    unit: Any = model._fsdp_state.unit
    assert unit.aliased
    fired = 0
    reduce_grad = unit.reduce_grad

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal fired
        fired += 1
        return reduce_grad(*args, **kwargs)

    unit.reduce_grad = counting
    for step in range(2):  # the second backward accumulates onto the first's gradients
        model(_batch(dist.get_rank() + 10 * step)).square().sum().backward()
        for r in range(world):
            plain(_batch(r + 10 * step)).square().sum().backward()
    assert fired == 2 * USES, f"the hook fired {fired} times in 2 backwards, not {USES} each"
    want = {n: p.grad / world for n, p in plain.named_parameters()}
    diff = 0.0
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        key = name.split("_fsdp_wrapped_module.")[-1]
        diff = max(diff, (p.grad - want[key]).abs().max().item())
    return diff


@pytest.mark.parametrize("with_hook", [False, True])
@pytest.mark.parametrize("world_size", [2, 4])
def test_reduce_twice_in_one_backward(world_size: int, with_hook: bool) -> None:
    for diff in run_ranks(_rank, world_size, with_hook):
        assert diff < 1e-6, diff
