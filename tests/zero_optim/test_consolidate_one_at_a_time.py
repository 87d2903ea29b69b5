"""consolidate_state_dict sends the target one owner's state at a time.

With ``gather_object`` the target rank received every rank's shard at once (on
its GPU under NCCL). Now each owner sends its part to the target in turn: the
target receives exactly ``world_size - 1`` messages, each holding exactly one
other rank's parameters, and no all-at-once object collective runs. The result
equals torch's ZeroRedundancyOptimizer consolidated on the same rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.ranks import run_ranks
from zero_optim import ZeroRedundancyOptimizer


def _train(zero_class: Any) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    opt = zero_class(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    for step in range(2):
        torch.manual_seed(100 + step)
        model(torch.randn(4, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return opt


def _consolidate_rank(to: int) -> tuple[list[list[int]], int]:
    received: list[list[int]] = []  # per message: the parameter indices it holds
    sent = 0
    real_recv, real_send = dist.recv_object_list, dist.send_object_list

    def recv(box: list[Any], *args: Any, **kwargs: Any) -> Any:
        out = real_recv(box, *args, **kwargs)
        received.append(sorted(box[0]))
        return out

    def send(box: list[Any], *args: Any, **kwargs: Any) -> Any:
        nonlocal sent
        sent += 1
        return real_send(box, *args, **kwargs)

    def all_at_once(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("consolidation used an all-at-once object collective")

    ours = _train(ZeroRedundancyOptimizer)
    theirs = _train(torch.distributed.optim.ZeroRedundancyOptimizer)
    theirs.consolidate_state_dict(to=to)  # before the patches: torch's uses broadcasts
    dist.recv_object_list, dist.send_object_list = recv, send  # type: ignore[assignment]
    dist.gather_object = dist.all_gather_object = all_at_once  # type: ignore[assignment]
    ours.consolidate_state_dict(to=to)
    if dist.get_rank() == to:
        got, want = ours.state_dict(), theirs.state_dict()
        assert sorted(got["state"]) == sorted(want["state"])
        for index, state in want["state"].items():
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(got["state"][index][key]), value.cpu())
        # each owner's own parameters, as the partition assigned them
        owned = [
            sorted(i for i, p in enumerate(ours._all_params) if p in set(ours.params_per_rank[r]))
            for r in range(dist.get_world_size())
            if r != to
        ]
        assert received == owned
    return received, sent


@pytest.mark.parametrize("world_size,to", [(2, 0), (4, 2)])
def test_target_receives_one_owner_at_a_time(world_size: int, to: int) -> None:
    results = run_ranks(_consolidate_rank, world_size, to)
    for rank, (received, sent) in enumerate(results):
        if rank == to:
            assert len(received) == world_size - 1 and sent == 0
            assert all(received), "every owner holds some state"
        else:
            assert received == [] and sent == 1
