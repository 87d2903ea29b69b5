"""What the post-step broadcast allocates, and how many bytes a training step moves.

* The broadcast sends large parameters in place and small ones through at most
  ``STAGING_SLOTS`` reusable buffers, whatever the number of parameters
  ([Note: bounded broadcast]); every rank ends with the owner's values.
* ``hook_with_zero_step_to_owners`` packs small gradients into one reduce per
  owner and bucket ([Note: packed owner reduces]) and gives DDP's parameters;
* ``hook_with_zero_step_to_owners`` moves no more bytes per step than DDP's
  all-reduce, where ``step()`` and the other hooks move 1.5 times as many
  ([Note: reduce to owners]). Bytes are counted at the collective calls and
  weighed by the bandwidth-optimal cost of each collective per rank:
  all-reduce ``2 n (N-1)/N``, reduce and broadcast ``n (N-1)/N``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from tests.ranks import run_ranks
from tests.zero_optim._common import BUCKET_CAP_MB, batch, make_model
from zero_optim import (
    ZeroRedundancyOptimizer,
    hook_with_zero_step,
    hook_with_zero_step_to_owners,
)
from zero_optim._broadcast import IN_PLACE_MIN_NUMEL, STAGING_NUMEL, STAGING_SLOTS, ShardBroadcaster
from zero_optim._owner_reduce import OwnerRun, owner_runs, split_runs

# ----------------------------------------------------------------- broadcast


def _broadcast_rank() -> dict[str, int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = (
        [(IN_PLACE_MIN_NUMEL * 2,)]  # in place
        + [(100, 300)] * 20  # small: 600,000 elements, more than the buffers hold at once
        + [(7,), (IN_PLACE_MIN_NUMEL + 1,), (3, 5)]
    )
    per_owner = []
    for owner in range(world):
        g = torch.Generator().manual_seed(owner)
        tensors = [torch.randn(s, generator=g) for s in shapes]
        tensors.append(torch.randn(600, 700, generator=g).t())  # non-contiguous, > a buffer
        tensors.append(torch.randn(40, 30, generator=g).t())  # non-contiguous, small
        per_owner.append(tensors)
    want = [[t.clone() for t in ts] for ts in per_owner]
    for owner, tensors in enumerate(per_owner):
        if owner != rank:
            for t in tensors:
                t.fill_(float("nan"))
    broadcaster = ShardBroadcaster(dist.group.WORLD, rank)  # type: ignore[arg-type]
    for _ in range(2):  # a second step reuses the buffers
        for owner, tensors in enumerate(per_owner):
            broadcaster.start(tensors, owner)
        broadcaster.finish()
    for got_ts, want_ts in zip(per_owner, want, strict=True):
        for got, w in zip(got_ts, want_ts, strict=True):
            assert torch.equal(got, w)
    return {str(dtype): n for (dtype, _), n in broadcaster._allocated.items()}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_broadcast_is_in_place_or_through_bounded_buffers(world_size: int) -> None:
    for allocated in run_ranks(_broadcast_rank, world_size, timeout=120):
        # 600,000 small elements went through buffers of STAGING_NUMEL, 2 at a time
        assert STAGING_SLOTS * STAGING_NUMEL < 20 * 100 * 300
        assert allocated == {"torch.float32": STAGING_SLOTS}


# -------------------------------------------------------------- traffic


@contextmanager
def _counting(tally: Counter[str]) -> Iterator[None]:
    """Add each collective's bytes to ``tally[name]`` while inside."""
    originals = {name: getattr(dist, name) for name in ("all_reduce", "reduce", "broadcast")}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            tally[name] += tensor.numel() * tensor.element_size()
            return fn(tensor, *args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _cost_per_rank(tally: Counter[str], world: int) -> float:
    share = (world - 1) / world
    return 2 * share * tally["all_reduce"] + share * (tally["reduce"] + tally["broadcast"])


def _traffic_rank() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, Any] = {}
    for variant in ("ddp", "zero step", "zero hook", "to owners"):
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
        adamw = torch.optim.AdamW
        opt: torch.optim.Optimizer
        if variant == "ddp":
            opt = adamw(model.parameters(), lr=0.01)
            ddp.register_comm_hook(None, allreduce_hook)  # DDP's all-reduce, in Python
        else:
            zero = ZeroRedundancyOptimizer(
                model.parameters(), adamw, overlap_with_ddp=variant != "zero step", lr=0.01
            )
            if variant == "zero step":
                ddp.register_comm_hook(None, allreduce_hook)
            elif variant == "zero hook":
                ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
            elif variant == "to owners":
                ddp.register_comm_hook(None, hook_with_zero_step_to_owners(ddp, zero))
            opt = zero
        tally: Counter[str] = Counter()
        for step in range(3):
            x, y = batch(step, rank)
            opt.zero_grad()
            with _counting(tally):
                F.mse_loss(ddp(x), y).backward()
                if variant in ("ddp", "zero step"):
                    opt.step()
        result[variant] = (dict(tally), _cost_per_rank(tally, world) / 3)
    result["param_bytes"] = sum(p.numel() * p.element_size() for p in make_model().parameters())
    return result


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_reduce_to_owners_moves_no_more_than_ddp(world_size: int) -> None:
    result = run_ranks(_traffic_rank, world_size, timeout=120)[0]
    psi = result["param_bytes"]
    share = (world_size - 1) / world_size
    ddp_tally, ddp_cost = result["ddp"]
    owners_tally, owners_cost = result["to owners"]
    # what each rank hands to collectives in 3 steps: every gradient once, reduced;
    # every parameter once, broadcast
    assert ddp_tally.get("all_reduce", 0) == 3 * psi
    assert owners_tally == {"reduce": 3 * psi, "broadcast": 3 * psi}
    assert ddp_cost == pytest.approx(2 * share * psi)
    assert owners_cost <= ddp_cost
    assert owners_cost == pytest.approx(ddp_cost)
    for other in ("zero step", "zero hook"):  # the all-reduce, then the broadcast
        assert result[other][1] == pytest.approx(1.5 * ddp_cost)


def test_owner_runs_merge_adjacent_slices_of_one_owner() -> None:
    # gradients laid out in the bucket out of parameter order, with a gap at 10..12
    offsets = [(4, 10), (0, 4), (12, 20), (20, 21)]
    owners = [1, 1, 1, 0]
    assert owner_runs(offsets, owners) == [
        OwnerRun(owner=1, start=0, end=10),
        OwnerRun(owner=1, start=12, end=20),
        OwnerRun(owner=0, start=20, end=21),
    ]
    assert owner_runs([], []) == []


def test_split_runs_packs_small_runs_up_to_one_buffer() -> None:
    big = IN_PLACE_MIN_NUMEL
    runs = [
        OwnerRun(0, 0, 10),
        OwnerRun(1, 10, 20),
        OwnerRun(0, 20, 20 + big),  # large: in place
        OwnerRun(1, 20 + big, 30 + big),
        OwnerRun(2, 30 + big, 40 + big),  # owner 2's only small run: in place
        OwnerRun(0, 40 + big, 50 + big),
    ]
    in_place, packed = split_runs(runs, 3)
    assert packed == [runs[0], runs[1], runs[3], runs[5]]
    assert in_place == [runs[2], runs[4]]
    # small runs beyond STAGING_NUMEL elements stay in place
    n = IN_PLACE_MIN_NUMEL - 1
    many = [OwnerRun(i % 2, i * n, (i + 1) * n) for i in range(STAGING_NUMEL // n + 3)]
    in_place, packed = split_runs(many, 2)
    assert sum(r.end - r.start for r in packed) <= STAGING_NUMEL
    assert sorted(in_place + packed) == sorted(many)
    assert len(in_place) >= 3


def _many_small_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(12)))


def _packed_rank() -> dict[str, Any]:
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for variant in ("ddp", "to owners"):
        model = _many_small_model()
        ddp = DDP(model)  # one bucket: 24 parameters, owners interleaved
        opt: torch.optim.Optimizer
        if variant == "ddp":
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        else:
            zero = ZeroRedundancyOptimizer(
                model.parameters(), torch.optim.AdamW, overlap_with_ddp=True, lr=0.01
            )
            ddp.register_comm_hook(None, hook_with_zero_step_to_owners(ddp, zero))
            opt = zero
        calls: Counter[str] = Counter()
        original = dist.reduce

        def counted(
            *args: Any, _original: Any = original, _calls: Counter[str] = calls, **kwargs: Any
        ) -> Any:
            _calls["reduce"] += 1
            return _original(*args, **kwargs)

        dist.reduce = counted  # type: ignore[assignment]
        try:
            for step in range(4):
                g = torch.Generator().manual_seed(1000 * step + rank)
                x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
                opt.zero_grad()
                F.mse_loss(ddp(x), y).backward()
                if variant == "ddp":
                    opt.step()
        finally:
            dist.reduce = original  # type: ignore[assignment]
        results[variant] = [p.detach().clone() for p in model.parameters()]
        if variant == "to owners":
            results["reduces"] = calls["reduce"]
            results["allocated"] = dict(zero._owner_reducer._allocated)
            results["owners"] = len(set(zero.param_to_rank.values()))
    return results


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_to_owners_packs_small_gradients_into_one_reduce_per_owner(world_size: int) -> None:
    for result in run_ranks(_packed_rank, world_size, timeout=120):
        # 24 parameters in one bucket, one reduce per owner and step (4 steps),
        # where one reduce per run would be about one per parameter
        assert result["reduces"] == 4 * result["owners"]
        assert all(n <= STAGING_SLOTS for n in result["allocated"].values())
        got, want = result["to owners"], result["ddp"]
        if world_size <= 2:  # one addition per element: bit for bit
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g, w)
        else:
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
