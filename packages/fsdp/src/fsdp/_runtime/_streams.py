"""Which stream each piece of a unit's device work runs on, and the events that order them.

A unit asks :func:`streams_for` for its device's :class:`Streams`: on the CPU a
no-op (``enabled`` is False and the unit takes its synchronous path, exactly as
before streams existed); on CUDA one unshard stream and one post-backward
stream per device, shared by every unit on it, as torch's FSDP1 does. Tests
replace a unit's ``streams`` with a recording fake to check the ordering on a
machine without a GPU.

[Note: stream ordering]
Three streams take part on CUDA: the *compute* stream (whatever stream is
current when FSDP's hooks run: forward, backward and the optimizer), the
*unshard* stream and the *post-backward* stream. A collective issued inside
``use(stream)`` is ordered after that stream's earlier work, and ``wait()`` on
it inside the same block makes that stream (not the CPU, for NCCL) wait for
it; so each side stream holds a plain sequence "copy in, collective, copy
out" and only the hand-offs between streams need events. Every hand-off is a
consumer stream waiting on an event its producer recorded; nothing relies on
timing.

Unshard (``FlatParamUnit.unshard`` / ``wait_for_unshard`` / ``reshard``):
1. unshard waits for compute (``wait_stream(UNSHARD, COMPUTE)``): the shard's
   last writer (optimizer step, ``load_state_dict``, a user's in-place edit)
   ran on the compute stream. Conservative: a gather therefore overlaps
   compute issued *after* it, which is why forward issues the next unit's
   gather ahead by default on CUDA too ([Note: issue-ahead] in
   ``_root_context.py``) and backward prefetches with ``BACKWARD_PRE``;
   relaxing the wait to once per iteration needs the root's pre-forward to
   record the event.
2. On unshard: the gathered buffer's storage is allocated (its block belongs
   to the unshard stream), the cast / host-to-device copy into this rank's
   slot, the all-gather, its ``wait()``; then an event ``gathered``.
3. wait_for_unshard: compute waits on ``gathered`` before any view is used.
4. reshard: ``record_stream(gathered buffer, COMPUTE)`` and then the free, so
   the allocator reuses the block only after the compute stream's reads of it
   (forward or backward kernels still queued) have run. The rate limiter
   ([Note: rate limiter] in ``_root_context.py``) records its event after the
   free, on the compute stream, and bounds how many such frees may be pending.

Gradient reduction (``FlatParamUnit.reduce_grad`` / ``finish_reduce_grad``):
1. post-backward waits for compute (``wait_stream(POST_BACKWARD, COMPUTE)``):
   the gradient was produced by autograd on the compute stream.
2. ``record_stream(gradient, POST_BACKWARD)``: the gradient was allocated on
   the compute stream and FSDP drops its reference before the post-backward
   stream has read it; the allocator must not give its block to the compute
   stream's next allocation until then.
3. On post-backward: cast and pad into the unit's padded buffer, pre-divide,
   reduce-scatter (all-reduce for NO_SHARD; then the replica all-reduce for
   hybrid sharding), ``wait()``, post-divide, cast back, the padded buffer's
   free (its block belongs to this stream and every use of it was on this
   stream, so freeing in stream order is safe), and under ``CPUOffload`` the
   non-blocking copy into pinned host memory; then an event ``reduced``.
4. finish_reduce_grad: compute waits on ``reduced``, then
   ``record_stream(sharded gradient, COMPUTE)`` (allocated on post-backward,
   from now on ``.grad`` is read and freed on compute) and accumulation.
5. Under ``CPUOffload`` the CPU itself reads the host gradient (the optimizer
   step, accumulation): it synchronizes on ``reduced`` before ``add_`` into an
   existing ``.grad``. At the end of backward (``RootContext.finish_reductions``)
   it also synchronizes on an event of the compute stream, which by then has
   waited on every gather and every reduction of the backward: so the
   host-to-device copies (which read the pinned shard asynchronously) and the
   device-to-host gradient copies are done before the optimizer writes the
   shard and reads ``.grad`` on the CPU. (A gather still in flight then, never
   waited on by compute, would escape this; prefetching only gathers units
   whose forward or backward still runs, and ``reshard`` waits on a gather
   before freeing it.)
"""

from __future__ import annotations

import contextlib
from enum import Enum, auto
from typing import Any

import torch
from torch import Tensor

__all__ = ["CudaStreams", "Stream", "Streams", "streams_for"]


class Stream(Enum):
    """The streams of [Note: stream ordering]."""

    COMPUTE = auto()
    """The stream current when FSDP's hook runs (outside any ``use`` block)."""
    UNSHARD = auto()
    """All-gathers and the copies that feed them."""
    POST_BACKWARD = auto()
    """Gradient reductions and the copies around them."""


class Streams:
    """The CPU's streams: none. Every method is a no-op and ``enabled`` is False.

    A unit whose ``streams.enabled`` is False runs every step on the calling
    thread's stream, synchronously ordered, as on gloo with CPU tensors.
    """

    enabled = False

    def use(self, stream: Stream) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` current for the block (a side stream, never COMPUTE)."""
        return contextlib.nullcontext()

    def wait_stream(self, waiter: Stream, producer: Stream) -> None:
        """``waiter`` runs nothing further until ``producer``'s work issued so far is done."""

    def record_event(self, stream: Stream) -> Any:
        """An event marking ``stream``'s work issued so far (None on the CPU)."""
        return None

    def wait_event(self, waiter: Stream, event: Any) -> None:
        """``waiter`` runs nothing further until ``event`` has completed."""

    def synchronize(self, event: Any) -> None:
        """The CPU waits until ``event`` has completed (before reading host memory)."""

    def record_stream(self, tensor: Tensor, stream: Stream) -> None:
        """``tensor``'s memory is used on ``stream``: the allocator may not reuse it until
        the work issued there so far is done."""


class CudaStreams(Streams):
    """One unshard and one post-backward stream on a CUDA device."""

    enabled = True

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._side: dict[Stream, Any] = {}  # created at first use: CUDA may be uninitialised
        self._inside: Stream | None = None  # the side stream a ``use`` block made current

    def _stream(self, stream: Stream) -> Any:
        if stream is Stream.COMPUTE:
            if self._inside is not None:
                raise AssertionError(
                    f"the compute stream asked for inside a {self._inside.name} block"
                )
            return torch.cuda.current_stream(self._device)
        if stream not in self._side:
            self._side[stream] = torch.cuda.Stream(device=self._device)
        return self._side[stream]

    @contextlib.contextmanager
    def _use(self, stream: Stream) -> Any:
        if stream is Stream.COMPUTE or self._inside is not None:
            raise AssertionError(f"use({stream.name}) inside {self._inside}")
        side = self._stream(stream)
        self._inside = stream
        try:
            with torch.cuda.stream(side):
                yield
        finally:
            self._inside = None

    def use(self, stream: Stream) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` current for the block (a side stream, never COMPUTE)."""
        return self._use(stream)

    def wait_stream(self, waiter: Stream, producer: Stream) -> None:
        """``waiter`` runs nothing further until ``producer``'s work issued so far is done."""
        self._stream(waiter).wait_stream(self._stream(producer))

    def record_event(self, stream: Stream) -> Any:
        """An event marking ``stream``'s work issued so far."""
        event = torch.cuda.Event()
        event.record(self._stream(stream))
        return event

    def wait_event(self, waiter: Stream, event: Any) -> None:
        """``waiter`` runs nothing further until ``event`` has completed."""
        self._stream(waiter).wait_event(event)

    def synchronize(self, event: Any) -> None:
        """The CPU waits until ``event`` has completed (before reading host memory)."""
        event.synchronize()

    def record_stream(self, tensor: Tensor, stream: Stream) -> None:
        """``tensor``'s memory is used on ``stream`` (see [Note: stream ordering])."""
        if tensor.is_cuda and tensor.untyped_storage().nbytes() > 0:
            tensor.record_stream(self._stream(stream))


_CPU = Streams()
_by_device: dict[torch.device, Streams] = {}


def streams_for(device: torch.device) -> Streams:
    """The streams of ``device``: shared by every unit on it; no-op off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return _CPU
    if device not in _by_device:
        _by_device[device] = CudaStreams(device)
    return _by_device[device]
