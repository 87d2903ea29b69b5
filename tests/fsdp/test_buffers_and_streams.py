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
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from tests.fsdp._common import (
    Block,
    average_grads,
    batches,
    loss_fn,
    make_net,
    max_diff,
    use_native_collectives,
)
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
    use_native_collectives()
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
                grad_buffers.append([id(u.storage._padded_grad) for u in units])
                idle_grad_bytes.append(
                    sum(
                        u.storage._padded_grad.untyped_storage().nbytes()
                        for u in units
                        if u.storage._padded_grad is not None
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
    from fsdp._runtime._device import pins_host_memory

    assert not pins_host_memory(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pins_host_memory(torch.device("cuda", 0))
    assert not pins_host_memory(torch.device("cpu"))


# ----------------------------------------------------------------- streams

# One log for the whole rank: (unit index or -1, what, stream name, detail).
_LOG: list[tuple[int, str, str, Any]] = []
# The side stream a fake's ``use`` block made current, and whose unit it is.
_CURRENT: list[Any] = ["COMPUTE", -1]


class _RecordingStreams:
    """A stand-in for ``CudaStreams``: logs every call; events are numbered tokens."""

    enabled = True
    _tokens = 0

    def __init__(self, unit: int) -> None:
        self.unit = unit

    def _log(self, what: str, stream: Any, detail: Any = None) -> None:
        _LOG.append((self.unit, what, stream.name, detail))

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        assert _CURRENT[0] == "COMPUTE" and stream.name != "COMPUTE", (_CURRENT, stream)
        self._log("enter", stream)
        _CURRENT[:] = [stream.name, self.unit]
        try:
            yield
        finally:
            _CURRENT[:] = ["COMPUTE", -1]
            self._log("exit", stream)

    def wait_stream(self, waiter: Any, producer: Any) -> None:
        self._log("wait_stream", waiter, producer.name)

    def record_event(self, stream: Any) -> int:
        _RecordingStreams._tokens += 1
        self._log("record_event", stream, _RecordingStreams._tokens)
        return _RecordingStreams._tokens

    def wait_event(self, waiter: Any, event: Any) -> None:
        assert isinstance(event, int), event
        self._log("wait_event", waiter, event)

    def synchronize(self, event: Any) -> None:
        _LOG.append((self.unit, "synchronize", "CPU", event))

    def record_stream(self, tensor: Tensor, stream: Any) -> None:
        self._log("record_stream", stream, _buffer_name(tensor))


_UNITS: list[Any] = []


def _buffer_name(t: Tensor) -> str:
    """Which unit buffer ``t`` is (by identity), for the log."""
    for i, u in enumerate(_UNITS):
        if t is u.storage.gathered:
            return f"gathered{i}"
        if t is u.storage._padded_grad:
            return f"padded_grad{i}"
        if t is u.flat_param.grad:
            return f"grad{i}"
    return "other"


def _install_recorders(model: Any) -> None:
    import fsdp._runtime._collectives as collectives
    import fsdp._runtime._sharded_storage as fpu

    _UNITS[:] = _units(model)
    for i, u in enumerate(_UNITS):
        u.storage.streams = _RecordingStreams(i)
        u.use_unsharded_views = _logged(u.use_unsharded_views, i, "views")

    for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
        original = getattr(dist, name)

        def spy(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            _LOG.append((_CURRENT[1], "collective", _CURRENT[0], _name))
            return _original(*args, **kwargs)

        setattr(dist, name, spy)

    free = fpu.free_storage

    def logged_free(t: Tensor) -> None:
        if t.untyped_storage().nbytes() != 0:
            name = _buffer_name(t)
            digits = name.lstrip("abcdefghijklmnopqrstuvwxyz_")
            unit = int(digits) if digits else -1  # the buffer's unit, also outside a block
            _LOG.append((unit, "free", _CURRENT[0], name))
        free(t)

    fpu.free_storage = logged_free
    wait = collectives.PendingCollective.wait

    def logged_wait(self: Any) -> None:
        if self.work is not None and not self.done:
            _LOG.append((_CURRENT[1], "collective_wait", _CURRENT[0], self.operation))
        wait(self)

    collectives.PendingCollective.wait = logged_wait  # type: ignore[method-assign]


def _logged(fn: Any, unit: int, what: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        _LOG.append((unit, what, _CURRENT[0], None))
        return fn(*args, **kwargs)

    return call


def _streams_rank(kw_name: str) -> dict[str, Any]:
    use_native_collectives()
    import fsdp
    from fsdp.wrap import ModuleWrapPolicy

    kws: dict[str, dict[str, Any]] = {
        "full_shard": {
            "backward_prefetch": fsdp.BackwardPrefetch.BACKWARD_PRE,
            "forward_prefetch": True,
        },
        "bf16_offload": {
            "mixed_precision": fsdp.MixedPrecision(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            ),
            "cpu_offload": fsdp.CPUOffload(offload_params=True),
        },
        "no_shard": {"sharding_strategy": fsdp.ShardingStrategy.NO_SHARD},
        # 2 replicas of one rank: every gather all-gathers the replica shard across
        # replicas on the unshard stream, every reduction reduce-scatters across them.
        "across_replicas": {
            "sharding_strategy": fsdp.ShardingStrategy.HYBRID_SHARD_ACROSS_REPLICAS,
            "device_mesh": init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")),
        },
    }
    kw = kws[kw_name]
    data = batches(3)
    results = []
    for fake in (False, True):
        model = fsdp.FullyShardedDataParallel(
            make_net(), auto_wrap_policy=ModuleWrapPolicy({Block}), **kw
        )
        if fake:
            _install_recorders(model)
            _LOG.clear()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x, y in data:
            loss_fn(model(x), y).backward()
            _LOG.append((-1, "optimizer_step", "COMPUTE", None))
            opt.step()
            opt.zero_grad(set_to_none=False)
        log = list(_LOG)  # training only: summon below gathers synchronously, on purpose
        results.append(_full(model))
    return {"log": log, "exact": max_diff(results[0], results[1]) == 0.0}


def _check_stream_log(log: list[tuple[int, str, str, Any]], kw_name: str) -> None:
    """The orderings of [Note: stream ordering], per unit, over the whole log."""
    sharded = kw_name != "no_shard"
    aliased = kw_name == "no_shard"  # fp32, no offload: nothing gathered or cast
    # 1. Collectives on their streams, issued inside the unit's block; waited on the same.
    for unit, what, stream, detail in log:
        if what == "collective":
            want = "UNSHARD" if detail == "all_gather_single" else "POST_BACKWARD"
            assert stream == want and unit >= 0, (unit, what, stream, detail)
        if what == "collective_wait":
            assert stream in ("UNSHARD", "POST_BACKWARD"), (unit, what, stream, detail)
    assert any(d == "all_gather_single" for _, w, _, d in log if w == "collective") == sharded
    assert any(w == "collective" and s == "POST_BACKWARD" for _, w, s, _ in log)
    units = sorted({u for u, *_ in log if u >= 0})
    assert len(units) == 4, units
    for u in units:
        mine = [(i, what, stream, d) for i, (unit, what, stream, d) in enumerate(log) if unit == u]
        waited: set[int] = set()
        gathered_event: int | None = None  # the unshard event not yet waited on by compute
        reduced: list[int] = []  # post-backward events in order
        side: str | None = None
        issued = waited_in_block = grad_recorded = False  # within the current side block
        for i, what, stream, d in mine:
            if what == "enter":
                side, issued, waited_in_block, grad_recorded = stream, False, False, False
                # the side stream waited for compute just before entering (producer -> consumer)
                prev = [m for m in mine if m[0] < i][-1]
                assert prev[1:3] == ("wait_stream", stream) and prev[3] == "COMPUTE", (u, prev)
            elif what == "exit":
                side = None
            elif what == "collective":
                assert stream == side, (u, i, what, stream, side)
                # the gradient's memory is recorded for this stream before it is read
                assert stream == "UNSHARD" or grad_recorded, (u, i, "no record_stream(grad)")
                issued, waited_in_block = True, False
            elif what == "collective_wait":
                waited_in_block = True
            elif what == "record_event" and stream == "COMPUTE":
                # only for the CPU's end-of-backward wait under offload
                assert side is None and kw_name == "bf16_offload", (u, i, what)
            elif what == "record_event":
                assert stream == side, (u, i, what, stream, side)
                # the event marks the collective's end: the side stream waited for it first
                assert waited_in_block or not issued, (u, i, "event before the collective's wait")
                if stream == "UNSHARD":
                    gathered_event = d
                else:
                    reduced.append(d)
            elif what == "wait_event":
                assert stream == "COMPUTE" and side is None, (u, i, what, stream)
                waited.add(d)
                if d == gathered_event:
                    gathered_event = None
            elif what == "views" and not aliased:
                # compute reads the gathered parameters only after waiting on the gather
                assert gathered_event is None, (u, i, "views before waiting on the gather")
            elif what == "free" and d.startswith("gathered"):
                # reshard: after the compute stream waited, and after record_stream(COMPUTE)
                assert stream == "COMPUTE" and gathered_event is None, (u, i, what)
                prev = [m for m in mine if m[0] < i][-1]
                assert prev[1:] == ("record_stream", "COMPUTE", d), (u, i, prev)
            elif what == "free" and d.startswith("padded_grad"):
                # freed on the post-backward stream, after that stream waited for the collective
                assert stream == "POST_BACKWARD", (u, i, what, stream)
                before = [m[1] for m in mine if m[0] < i]
                last_issue = max(k for k, w in enumerate(before) if w == "collective")
                assert "collective_wait" in before[last_issue:], (u, i, before[last_issue:])
            elif what == "record_stream" and stream == "POST_BACKWARD":
                assert side == "POST_BACKWARD" and d.startswith(("grad", "other")), (u, i, d)
                grad_recorded = True
        # every post-backward event is waited on by compute (before .grad is used)
        assert reduced and set(reduced) <= waited, (u, reduced, waited)
    # ... and before the optimizer step after it: all of a backward's reductions are waited
    # on (and offloaded gradients synchronized) before the step.
    recorded: dict[int, int] = {}
    compute_events: set[int] = set()
    last_wait = -1
    for i, (_, what, stream, d) in enumerate(log):
        if what == "record_event" and stream == "POST_BACKWARD":
            recorded[d] = i
        if what == "wait_event":
            last_wait = i
        if what == "record_event" and stream == "COMPUTE" and i > last_wait:
            compute_events.add(d)
        if what == "optimizer_step" and kw_name == "bf16_offload":
            # the CPU waited for the compute stream after its last wait on another stream
            synced = [e for k, e in enumerate(log[:i]) if e[1] == "synchronize" and k > last_wait]
            assert any(e[3] in compute_events for e in synced), (i, "no end-of-backward sync")
        if what == "optimizer_step":
            for event, at in recorded.items():
                waits = [k for k, e in enumerate(log) if e[1] == "wait_event" and e[3] == event]
                assert waits and waits[0] < i, (event, at, i)
                if kw_name == "bf16_offload":
                    syncs = [
                        k for k, e in enumerate(log) if e[1] == "synchronize" and e[3] == event
                    ]
                    assert syncs and syncs[0] < i, ("host gradient not synchronized", event)
            recorded.clear()


@pytest.mark.parametrize("kw_name", ["full_shard", "bf16_offload", "no_shard", "across_replicas"])
def test_stream_ordering_with_a_recording_fake(kw_name: str) -> None:
    for out in run_ranks(_streams_rank, 2, kw_name, timeout=120):
        # The CUDA path on CPU tensors computes exactly what the CPU path does.
        assert out["exact"], kw_name
        _check_stream_log(out["log"], kw_name)


def test_cpu_streams_are_a_no_op() -> None:
    from fsdp._runtime._streams import Stream, Streams, streams_for

    s = streams_for(torch.device("cpu"))
    assert type(s) is Streams and not s.enabled
    with s.use(Stream.UNSHARD):
        pass
    assert s.record_event(Stream.POST_BACKWARD) is None


def test_cuda_streams_wiring_with_torch_cuda_stubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    """CudaStreams' calls into torch.cuda, with torch.cuda stubbed: which stream
    object waits on which, which is current inside ``use``, and the guards."""
    import fsdp._runtime._streams as streams_mod
    from fsdp._runtime._streams import CudaStreams, Stream, streams_for

    calls: list[tuple[Any, ...]] = []
    current: list[Any] = []

    class FakeStream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: FakeStream) -> None:
            calls.append(("wait_stream", self.name, other.name))

        def wait_event(self, event: FakeEvent) -> None:
            calls.append(("wait_event", self.name, event.on))

    class FakeEvent:
        on = ""

        def record(self, stream: FakeStream) -> None:
            self.on = stream.name

        def synchronize(self) -> None:
            calls.append(("synchronize", self.on))

    compute = FakeStream("compute")
    made = iter(["side0", "side1"])

    @contextlib.contextmanager
    def stream(s: FakeStream) -> Iterator[None]:
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: FakeStream(next(made)))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: (current or [compute])[-1])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(streams_mod, "_by_device", {})

    dev = torch.device("cuda", 0)
    s = streams_for(dev)
    assert isinstance(s, CudaStreams) and s.enabled and streams_for(dev) is s
    s.wait_stream(Stream.UNSHARD, Stream.COMPUTE)  # creates the unshard stream: side0
    with s.use(Stream.UNSHARD):
        assert current[-1].name == "side0"
        event = s.record_event(Stream.UNSHARD)
        with pytest.raises(AssertionError, match="compute stream"):
            s.wait_event(Stream.COMPUTE, event)  # COMPUTE is not the current one in here
        with pytest.raises(AssertionError):
            s.use(Stream.POST_BACKWARD).__enter__()  # no nesting
    assert not current
    s.wait_event(Stream.COMPUTE, event)
    s.wait_stream(Stream.POST_BACKWARD, Stream.COMPUTE)  # side1
    s.synchronize(s.record_event(Stream.POST_BACKWARD))
    s.record_stream(torch.ones(2), Stream.COMPUTE)  # a CPU tensor: nothing to record
    assert calls == [
        ("wait_stream", "side0", "compute"),
        ("wait_event", "compute", "side0"),
        ("wait_stream", "side1", "compute"),
        ("synchronize", "side1"),
    ]
