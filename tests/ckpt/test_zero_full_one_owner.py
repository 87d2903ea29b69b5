"""A full ZeRO optimizer state dict travels one owner's part at a time.

``ckpt.optim_state_dict(model, zero, full=True)`` used ``all_gather_object``
(``gather_object`` with ``rank0_only``): every receiver got all ranks' parts
at once, on its GPU under NCCL. Now each owner's part is broadcast (or sent to
rank 0) in turn: the all-at-once collectives are made to raise, each message
is counted, and the result must hold every parameter's state exactly as its
owner holds it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ckpt
from tests.ranks import run_ranks


def _rank(rank0_only: bool) -> tuple[int, int]:
    from zero_optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2))
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    torch.manual_seed(1 + dist.get_rank())
    model(torch.randn(3, 4)).square().sum().backward()
    zero.step()
    names = {id(p): n for n, p in model.named_parameters()}
    own = {names[id(p)]: zero.optim.state[p] for p in zero.params_per_rank[zero.rank]}
    messages = {"in": 0, "out": 0}
    real = {n: getattr(dist, n) for n in ("broadcast_object_list", "send_object_list")}
    real_recv = dist.recv_object_list

    def counted(name: str) -> Any:
        def call(box: list[Any], *args: Any, **kwargs: Any) -> Any:
            messages["out" if box[0] is not None else "in"] += 1
            return real[name](box, *args, **kwargs)

        return call

    def recv(box: list[Any], *args: Any, **kwargs: Any) -> Any:
        messages["in"] += 1
        return real_recv(box, *args, **kwargs)

    def all_at_once(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an all-at-once object collective")

    dist.broadcast_object_list = counted("broadcast_object_list")  # type: ignore[assignment]
    dist.send_object_list = counted("send_object_list")  # type: ignore[assignment]
    dist.recv_object_list = recv  # type: ignore[assignment]
    dist.gather_object = dist.all_gather_object = all_at_once  # type: ignore[assignment]
    sd = ckpt.optim_state_dict(model, zero, full=True, rank0_only=rank0_only)
    if rank0_only and dist.get_rank() != 0:
        assert sd == {}
    else:
        assert sorted(sd["state"]) == sorted(names.values())
    # Every rank checks its own parameters' state in what the receivers got.
    got = [sd.get("state") if dist.get_rank() == 0 or not rank0_only else None]
    real["broadcast_object_list"](got, src=0)
    for name, st in own.items():
        for key, value in st.items():
            assert torch.equal(torch.as_tensor(got[0][name][key]), value.cpu()), (name, key)
    return messages["in"], messages["out"]


@pytest.mark.parametrize("rank0_only", [False, True])
@pytest.mark.parametrize("world_size", [2, 4])
def test_full_zero_state_one_owner_at_a_time(world_size: int, rank0_only: bool) -> None:
    counts = run_ranks(_rank, world_size, rank0_only)
    for rank, (received, sent) in enumerate(counts):
        if not rank0_only:  # one broadcast per owner: sent once, received from the others
            assert (received, sent) == (world_size - 1, 1), (rank, counts)
        elif rank == 0:
            assert (received, sent) == (world_size - 1, 0), counts
        else:
            assert (received, sent) == (0, 1), counts
