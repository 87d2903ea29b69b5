"""fully_shard's CUDA stream ordering, checked on CPU with a recording stand-in for the streams.

Each part's storage gets a fake ``Streams`` that logs every call (as the wrapper's test
in ``tests/fsdp/test_buffers_and_streams.py`` does); the log of a few training steps
must show the orderings of [Note: stream ordering] with fully_shard's promise on top:
no ``record_stream`` at all. Buffers are freed in stream order instead:

- a gathered buffer is allocated on the unshard stream, which first waits for the
  compute stream; it is read by the copy-out on the compute stream, after the compute
  stream waited on the gather's event, and freed right after the copy-out is queued:
  the block goes back to the unshard stream's pool, whose next work is ordered after
  the compute stream's work by the next gather's wait;
- the unsharded gradients are read by the post-backward stream, which first waits for
  the compute stream; they stay referenced until the compute stream has waited on the
  reduction's event (then dropped on the compute stream);
- the reduced gradient is read on the compute stream only after it waited on that event.

With the fake, the CPU path computes exactly what it computes without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.fsdp._common import batches, loss_fn
from tests.fully_shard._common import TinyNet, full
from tests.ranks import run_ranks

_LOG: list[tuple[str, str, Any]] = []  # (what, stream, detail)
_CURRENT = ["COMPUTE"]


class _RecordingStreams:
    enabled = True
    tokens = 0

    def _log(self, what: str, stream: Any, detail: Any = None) -> None:
        _LOG.append((what, stream.name, detail))

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        assert _CURRENT[0] == "COMPUTE" and stream.name != "COMPUTE", (_CURRENT, stream)
        self._log("enter", stream)
        _CURRENT[0] = stream.name
        try:
            yield
        finally:
            _CURRENT[0] = "COMPUTE"
            self._log("exit", stream)

    def wait_stream(self, waiter: Any, producer: Any) -> None:
        self._log("wait_stream", waiter, producer.name)

    def record_event(self, stream: Any) -> int:
        _RecordingStreams.tokens += 1
        self._log("record_event", stream, _RecordingStreams.tokens)
        return _RecordingStreams.tokens

    def wait_event(self, waiter: Any, event: Any) -> None:
        self._log("wait_event", waiter, event)

    def synchronize(self, event: Any) -> None:
        _LOG.append(("synchronize", "CPU", event))

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        self._log("record_stream", stream, None)


def _install(model: torch.nn.Module) -> None:
    import fsdp._fully_shard._param_group as pg
    import fsdp._runtime._collectives as collectives
    from fsdp._fully_shard._state import state_of

    for module in model.modules():
        state = state_of(module)
        if state is not None and state.group is not None:
            for part in state.group.parts:
                part.storage.streams = _RecordingStreams()  # type: ignore[assignment]

    unpack = pg.ChunkLayout.unpack_gathered

    def logged_unpack(self: Any, gathered: torch.Tensor, outs: Any) -> None:
        _LOG.append(("copy_out", _CURRENT[0], None))
        unpack(self, gathered, outs)

    pg.ChunkLayout.unpack_gathered = logged_unpack  # type: ignore[method-assign]
    import fsdp._runtime._sharded_storage as ss

    finish = ss.ShardedStorage.finish

    def logged_finish(self: Any, reduce: Any) -> Any:
        out = finish(self, reduce)  # the caller reads the result right after this
        _LOG.append(("accumulate", _CURRENT[0], reduce.event))
        return out

    ss.ShardedStorage.finish = logged_finish  # type: ignore[method-assign]

    free = ss.free_storage

    def logged_free(t: torch.Tensor) -> None:
        if t.untyped_storage().nbytes() != 0:
            _LOG.append(("free", _CURRENT[0], t.numel()))
        free(t)

    ss.free_storage = logged_free
    wait = collectives.PendingCollective.wait

    def logged_wait(self: Any) -> None:
        if self.work is not None and not self.done:
            _LOG.append(("collective_wait", _CURRENT[0], self.operation))
        wait(self)

    collectives.PendingCollective.wait = logged_wait  # type: ignore[method-assign]


def _rank(case: str) -> dict[str, Any]:
    import fsdp

    kwargs: dict[str, Any] = {}
    if case == "bf16_offload":
        kwargs = {
            "mp_policy": fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
            "offload_policy": fsdp.CPUOffloadPolicy(pin_memory=False),
        }
    results = []
    log: list[tuple[str, str, Any]] = []
    for fake in (False, True):
        torch.manual_seed(0)
        model = TinyNet()
        for block in model.blocks:
            fsdp.fully_shard(block, **kwargs)
        fsdp.fully_shard(model, **kwargs)
        if fake:
            _install(model)
            _LOG.clear()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for x, y in batches(3):
            loss_fn(model(x), y).backward()
            _LOG.append(("optimizer_step", "COMPUTE", None))
            opt.step()
            opt.zero_grad()
        log = list(_LOG)
        results.append([full(p) for p in model.parameters()])
    exact = all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    return {"log": log, "exact": exact}


def _check(log: list[tuple[str, str, Any]]) -> None:
    assert not [e for e in log if e[0] == "record_stream"], "fully_shard calls no record_stream"
    pending_gathers: list[int] = []  # unshard events not yet waited on by compute
    waited: set[int] = set()
    reduced: list[int] = []
    side = None
    for i, (what, stream, detail) in enumerate(log):
        if what == "enter":
            prev = log[i - 1]
            assert prev == ("wait_stream", stream, "COMPUTE"), (i, prev)  # waits for compute
            side = stream
        elif what == "exit":
            side = None
        elif what == "record_event" and stream == "UNSHARD":
            pending_gathers.append(detail)
        elif what == "record_event" and stream == "POST_BACKWARD":
            reduced.append(detail)
        elif what == "wait_event":
            assert stream == "COMPUTE" and side is None, (i, what, stream)
            waited.add(detail)
            if detail in pending_gathers:
                pending_gathers.remove(detail)
        elif what == "copy_out":
            # the compute stream reads a gathered buffer only after waiting on its gather
            assert stream == "COMPUTE" and side is None, (i, what)
            gathers = [e[2] for e in log[:i] if e[:2] == ("record_event", "UNSHARD")]
            assert gathers and gathers[-1] in waited, (i, "copy-out before waiting")
        elif what == "accumulate":
            # the reduced gradient is read after the compute stream waited on its event
            assert stream == "COMPUTE" and detail in waited, (i, "gradient read before its event")
        elif what == "optimizer_step":
            assert set(reduced) <= waited, (i, "a reduction not waited on before the step")
    assert reduced and any(e[0] == "copy_out" for e in log)


@pytest.mark.parametrize("case", ["default", "bf16_offload"])
def test_stream_ordering_without_record_stream(case: str) -> None:
    for out in run_ranks(_rank, 2, case, timeout=120):
        assert out["exact"]
        _check(out["log"])
