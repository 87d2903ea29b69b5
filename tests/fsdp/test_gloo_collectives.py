"""FSDP's all-gather and reduce-scatter on gloo, composed of broadcasts and an all-to-all.

See [Note: gloo's sharded collectives] in ``fsdp/_collectives.py``. Each rank
compares the composite with gloo's native collective on the same inputs (sizes
with and without a remainder per rank, fp32 and bf16, the world group and a
subgroup) and counts what it sends: ``(world_size - 1) / world_size`` of the
buffer, as the native ring does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.ranks import run_ranks

SHARD_SIZES = (1, 7, 47, 1001, 65_537)
DTYPES = (torch.float32, torch.bfloat16)


@contextmanager
def _sent_bytes() -> Iterator[Counter[str]]:
    """Bytes this rank sends through broadcast / all_to_all_single, by collective."""
    sent: Counter[str] = Counter()
    bcast, a2a = dist.broadcast, dist.all_to_all_single

    def spy_bcast(tensor: torch.Tensor, src: int, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        if src == dist.get_rank():  # the root sends to every other rank of the group
            peers = dist.get_world_size(group) - 1
            sent["broadcast"] += peers * tensor.numel() * tensor.element_size()
        return bcast(tensor, src, *args, **kwargs)

    def spy_a2a(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        world = dist.get_world_size(kwargs.get("group"))
        sent["all_to_all_single"] += (world - 1) * input.numel() * input.element_size() // world
        return a2a(output, input, *args, **kwargs)

    dist.broadcast, dist.all_to_all_single = spy_bcast, spy_a2a  # type: ignore[assignment]
    try:
        yield sent
    finally:
        dist.broadcast, dist.all_to_all_single = bcast, a2a  # type: ignore[assignment]


def _compare(group: Any) -> dict[str, Any]:
    """Composite vs native on this rank, in ``group``."""
    import fsdp._runtime._collectives as collectives

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out: dict[str, Any] = {"gather_diff": 0, "scatter_diff": 0.0, "scatter_vs_rank_order": 0}
    out["gather_bytes"], out["scatter_bytes"], out["want_bytes"] = 0, 0, 0
    out["receive_buffers_alive"] = 0
    for dtype in DTYPES:
        for n in SHARD_SIZES:
            gen = torch.Generator().manual_seed(1000 * dist.get_rank() + n)
            shard = torch.randn(n, generator=gen).to(dtype)
            full = (torch.randn(world * n, generator=gen) * 100).to(dtype)
            native_gather, composite_gather = torch.empty(2, world * n, dtype=dtype)
            native_shard, composite_shard = torch.empty(2, n, dtype=dtype)
            collectives.GLOO_COMPOSITES = False
            collectives.all_gather_into(native_gather, shard, group).wait()
            collectives.reduce_scatter_into(native_shard, full.clone(), group).wait()
            collectives.GLOO_COMPOSITES = True
            with _sent_bytes() as sent:
                # in place, as FSDP gathers a cast shard: the input is this rank's slot
                slot = composite_gather[rank * n : (rank + 1) * n]
                slot.copy_(shard)
                pending = collectives.all_gather_into(composite_gather, slot, group)
                pending.wait()
                gathered = sent["broadcast"]
                pending = collectives.reduce_scatter_into(composite_shard, full.clone(), group)
                received = pending.keep_alive[-1]  # the all-to-all's output
                pending.wait()
                # freed by wait(), though gloo's work object still refers to it
                out["receive_buffers_alive"] += received.untyped_storage().nbytes() != 0
                del received
            out["gather_bytes"] += gathered
            out["scatter_bytes"] += sent["all_to_all_single"]
            out["want_bytes"] += (world - 1) * n * shard.element_size()
            out["gather_diff"] += int((native_gather != composite_gather).sum())
            if dtype == torch.float32:  # bf16's last bit is too coarse for a bound
                diff = (native_shard - composite_shard).abs().max()
                scale = native_shard.abs().max()
                out["scatter_diff"] = max(out["scatter_diff"], float(diff / scale))
            # The composite's own promise: the sum of every rank's chunk in rank order.
            chunks = [torch.empty_like(full) for _ in range(world)]
            dist.all_gather(chunks, full, group=group)
            want = chunks[0][rank * n : (rank + 1) * n].clone()
            for c in chunks[1:]:
                want += c[rank * n : (rank + 1) * n]
            out["scatter_vs_rank_order"] += int((want != composite_shard).sum())
    return out


def _rank(subgroup: bool) -> dict[str, Any]:
    if not subgroup:
        return _compare(None)
    # Two groups of alternate ranks: global and group ranks differ.
    world = dist.get_world_size()
    groups = [dist.new_group(list(range(start, world, 2))) for start in (0, 1)]
    return _compare(groups[dist.get_rank() % 2])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_composites_match_native_collectives(world_size: int) -> None:
    for rank, r in enumerate(run_ranks(_rank, world_size, False, timeout=120)):
        where = f"rank {rank}: {r}"
        assert r["gather_diff"] == 0, where  # a gather only copies: bitwise
        assert r["scatter_vs_rank_order"] == 0, where
        assert r["receive_buffers_alive"] == 0, where
        if world_size == 2:
            assert r["scatter_diff"] == 0.0, where  # two terms add the same either way
        else:
            assert r["scatter_diff"] <= 1e-6, where  # fp32: another order of the same terms
        # Bandwidth-optimal, as gloo's ring: (N-1)/N of the buffer leaves each rank.
        assert r["gather_bytes"] == r["want_bytes"] == r["scatter_bytes"], where


def test_composites_in_a_subgroup() -> None:
    for rank, r in enumerate(run_ranks(_rank, 4, True, timeout=120)):
        where = f"rank {rank}: {r}"
        assert r["gather_diff"] == 0 and r["scatter_diff"] == 0.0, where  # groups of two
        assert r["scatter_vs_rank_order"] == 0, where
        assert r["gather_bytes"] == r["want_bytes"] == r["scatter_bytes"], where


def _fsdp_rank() -> dict[str, Any]:
    import fsdp
    from fsdp.wrap import ModuleWrapPolicy
    from tests.fsdp._common import Block, batches, loss_fn, make_net

    model = fsdp.FullyShardedDataParallel(make_net(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    calls: Counter[str] = Counter()
    names = ("broadcast", "all_to_all_single", "all_gather_single", "reduce_scatter_single")
    originals = {name: getattr(dist, name) for name in names}

    def spy(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    first, second = batches(2)
    loss_fn(model(first[0]), first[1]).backward()  # the first forward also agrees on the order
    for name in names:
        setattr(dist, name, spy(name))
    try:
        loss_fn(model(second[0]), second[1]).backward()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    units = sum(1 for m in model.modules() if isinstance(m, fsdp.FullyShardedDataParallel))
    return {"calls": dict(calls), "units": units}


def test_fsdp_on_gloo_uses_the_composites() -> None:
    for r in run_ranks(_fsdp_rank, 2, timeout=60):
        calls, units = r["calls"], r["units"]
        assert "all_gather_single" not in calls and "reduce_scatter_single" not in calls, r
        assert calls["all_to_all_single"] == units, r  # one reduce-scatter per unit
        assert calls["broadcast"] % 2 == 0 and calls["broadcast"] >= 2 * units, r
