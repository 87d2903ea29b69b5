"""Reused buffers, pinned host memory and stream ordering, proven on CPU.

Buffers (gloo, 2 and 4 ranks, models whose flat parameters need padding): an
unshard allocates no tensor (the mixed-precision cast or the offload copy lands
in this rank's slot of the gathered buffer and the all-gather runs in place); a
gradient reduction allocates one tensor, the reduced shard (the padded input is
the unit's reusable ``_padded_grad``, whose storage exists only while a
reduction reads it); training still matches by-hand averaged plain training.

Streams: no GPU here, so a recording fake stands in for ``CudaStreams`` on every
unit (the code then takes its CUDA path with CPU tensors) and the log of stream
calls and collectives is checked against [Note: stream ordering]: which stream
each collective is issued on, that the consumer waits on the producer's event
before reading, and that buffers are freed only after those waits.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from tests.fsdp._common import Block, average_grads, batches, loss_fn, make_net, max_diff
from tests.ranks import run_ranks

# Ops that create a tensor (a new allocation), as the dispatcher names them.
_ALLOCATING = {
    "aten.empty.memory_format",
    "aten.empty_strided.default",
    "aten.empty_like.default",
    "aten._to_copy.default",
    "aten.cat.default",
    "aten.new_zeros.default",
    "aten.zeros.default",
    "aten.clone.default",
    "aten.constant_pad_nd.default",
}


class _CountAllocations(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name in _ALLOCATING:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _units(model: Any) -> list[Any]:
    import fsdp

    return [
        m._fsdp_state.unit
        for m in model.modules()
        if isinstance(m, fsdp.FullyShardedDataParallel) and m._fsdp_state.unit is not None
    ]


def _counting(unit: Any, method: str, into: list[int]) -> None:
    original = getattr(unit, method)

    def call(*args: Any, **kwargs: Any) -> Any:
        mode = _CountAllocations()
        with mode:
            out = original(*args, **kwargs)
        into.append(sum(mode.counts.values()))
        return out

    setattr(unit, method, call)


@contextlib.contextmanager
def _spy_all_gathers(into: list[tuple[int, int, int]]) -> Iterator[None]:
    """Record (input data_ptr, output data_ptr, input bytes) of every all-gather."""
    original = dist.all_gather_single

    def spy(output: Tensor, shard: Tensor, *args: Any, **kwargs: Any) -> Any:
        into.append((shard.data_ptr(), output.data_ptr(), shard.numel() * shard.element_size()))
        return original(output, shard, *args, **kwargs)

    dist.all_gather_single = spy
    try:
        yield
    finally:
        dist.all_gather_single = original


def _buffers_rank() -> dict[str, Any]:
    import fsdp
    from fsdp.wrap import ModuleWrapPolicy

    rank = dist.get_rank()
    configs: dict[str, dict[str, Any]] = {
        "fp32": {},
        "bf16": {
            "mixed_precision": fsdp.MixedPrecision(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        },
        "offload": {"cpu_offload": fsdp.CPUOffload(offload_params=True)},
    }
    out: dict[str, Any] = {}
    data = batches(3)
    plain = make_net()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for x, y in data:
        loss_fn(plain(x), y).backward()
        average_grads(plain)
        opt.step()
        opt.zero_grad()
    want = {n: p.detach().clone() for n, p in plain.named_parameters()}
    for name, kw in configs.items():
        model = fsdp.FullyShardedDataParallel(
            make_net(), auto_wrap_policy=ModuleWrapPolicy({Block}), **kw
        )
        units = _units(model)
        unshard_allocs: list[int] = []
        reduce_allocs: list[int] = []
        for u in units:
            _counting(u, "unshard", unshard_allocs)
            _counting(u, "reduce_grad", reduce_allocs)
        gathers: list[tuple[int, int, int]] = []
        grad_buffers: list[list[int]] = []
        idle_grad_bytes: list[int] = []
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with _spy_all_gathers(gathers):
            for x, y in data:
                loss_fn(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                grad_buffers.append([id(u._padded_grad) for u in units])
                idle_grad_bytes.append(
                    sum(
                        u._padded_grad.untyped_storage().nbytes()
                        for u in units
                        if u._padded_grad is not None
                    )
                )
        in_place = [inp == outp + rank * nbytes for inp, outp, nbytes in gathers]
        out[name] = {
            "unshard_allocs": sorted(set(unshard_allocs)),
            # after the first backward, which creates each unit's _padded_grad once
            "reduce_allocs": sorted(set(reduce_allocs[len(units) :])),
            "reduces": len(reduce_allocs),
            "in_place": sorted(set(in_place)),
            "same_grad_buffers": all(b == grad_buffers[0] for b in grad_buffers),
            "padded_units": sum(u.layout.padded_numel != u.layout.full_numel for u in units),
            "idle_grad_bytes": idle_grad_bytes,
            "diff": max_diff(want, _full(model)),
        }
    return out


def _full(model: Any) -> dict[str, Tensor]:
    import fsdp

    with fsdp.FullyShardedDataParallel.summon_full_params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_unshard_and_reduce_reuse_buffers(world_size: int) -> None:
    outs = run_ranks(_buffers_rank, world_size, timeout=120)
    for out in outs:
        for name, r in out.items():
            # Every unit needs padding at these world sizes (odd sizes, see _common.py).
            assert r["padded_units"] >= 4, (name, r)
            # No tensor per unshard; fp32 gathers the shard itself, the others in place.
            assert r["unshard_allocs"] == [0], (name, r)
            assert r["in_place"] == [name != "fp32"], (name, r)
            # One tensor per reduction: the reduced shard. (Before: pad_flat's zeros and
            # cat, and with a reduce dtype the cast, each a full-size tensor.)
            assert r["reduce_allocs"] == [1] and r["reduces"] == 3 * 4, (name, r)
            # The same padded-gradient tensor every backward, holding no memory between.
            assert r["same_grad_buffers"] and r["idle_grad_bytes"] == [0, 0, 0], (name, r)
            # bf16: 3 AdamW steps of bf16 rounding against fp32 (exact parity with torch
            # in test_mixed_precision.py); fp32 and offload: reduction-order noise.
            tol = 5e-2 if name == "bf16" else 1e-5
            assert r["diff"] <= tol, (name, r)


def test_pinned_memory_only_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp._device import pins_host_memory

    assert not pins_host_memory(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pins_host_memory(torch.device("cuda", 0))
    assert not pins_host_memory(torch.device("cpu"))
