"""Uneven inputs under ``torch.distributed.algorithms.join.Join``.

Two epochs, each in its own ``Join``; in epoch ``e`` rank ``r`` has
``2 + 2 r + e`` batches. The reference is DDP with the plain
optimizer under ``Join([ddp])``: ranks that run out stop, the others keep
averaging over the initial world size, and DDP hands every rank the last
rank's model at the end (the test also hands over the last rank's optimizer
state, which DDP does not, so that the reference stays one model in epoch 2).
Ours, under ``Join([ddp, zero])``, must end with exactly that model on every
rank, although the ranks that ran out still own
(and step) part of the parameters: see [Note: uneven inputs] in
``zero_optim/_optimizer.py``.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join

from tests.ranks import run_ranks
from tests.zero_optim._common import (
    OPTIMIZERS,
    OURS,
    OURS_BUCKETS,
    PLAIN,
    assert_same,
    batch,
    build,
)


def _uneven(variant: str, opt_name: str) -> list:  # type: ignore[type-arg]
    model, ddp, opt = build(variant, opt_name, "groups")
    rank = dist.get_rank()
    joinables = [ddp] if variant == PLAIN else [ddp, opt]
    for epoch in range(2):  # a second Join context, as the next epoch would open
        with Join(joinables):  # type: ignore[list-item]
            for step in range(2 + 2 * rank + epoch):
                x, y = batch(10 * epoch + step, rank)
                opt.zero_grad()
                F.mse_loss(ddp(x), y).backward()
                opt.step()
        if variant == PLAIN:
            # DDP gave every rank the last rank's model, but the ranks that
            # joined early kept stale optimizer state; give them the last
            # rank's too, or the replicas drift apart in the next epoch.
            state = [opt.state_dict()]
            dist.broadcast_object_list(state, src=dist.get_world_size() - 1)
            opt.load_state_dict(state[0])
        else:
            assert not getattr(opt, "_in_join", True)  # back to plain steps after the context
    return [p.detach().clone() for p in model.parameters()]


def _join_rank() -> None:
    for opt_name in OPTIMIZERS:
        reference = _uneven(PLAIN, opt_name)
        for variant in (OURS, OURS_BUCKETS):
            assert_same(_uneven(variant, opt_name), reference, f"{opt_name}/{variant}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_uneven_inputs_match_ddp_with_plain_optimizer(world_size: int) -> None:
    run_ranks(_join_rank, world_size, timeout=120)
