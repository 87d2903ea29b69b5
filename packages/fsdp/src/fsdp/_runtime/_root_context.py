"""What all FSDP instances under one root share at run time.

The root creates one :class:`RootContext` at its lazy initialisation (first
forward) and hands it to every FSDP instance below it: the execution order
(for prefetching), the rate limiter, the queue of gradient reductions in
flight, and whether the end-of-backward callback is queued.

[Note: rate limiter]
With ``limit_all_gathers=True`` at most two units' gathered parameters may be
alive on the device at once between the root's (the one computing and the
one prefetched). On CUDA the CPU runs ahead of the device: a freed block is
only free once the device has passed the free, so the CPU must not issue a
third gather before the first free has executed. After each free the unit's
state records a device event; before each gather, if two frees are still
pending, the CPU waits for the oldest event. On the CPU device there is no
run-ahead (a free is done when ``reshard()`` returns) so there are no events
and the limiter never waits; the two-unit bound then follows from issuing at
most one unit ahead (see [Note: issue-ahead]).

[Note: issue-ahead]
torch's FSDP1 on CUDA overlaps the next unit's all-gather with the current
unit's forward even with ``forward_prefetch=False``: its CPU thread issues
the current unit's kernels and moves on to the next unit's pre-forward, which
issues that all-gather on the unshard stream while the kernels run, and the
rate limiter stops it two units ahead. A gloo/CPU run has no such run-ahead:
the computation runs on the thread that would issue the next gather, so a
unit that gathers on entry waits for all of its all-gather. On CUDA our
unshard stream waits for the compute stream at every gather ([Note: stream
ordering] in ``_streams.py``, conservative on purpose), so run-ahead alone
would queue the next gather behind the current unit's kernels. Our default
therefore issues ahead on every device: with ``limit_all_gathers=True``
(torch's default), each unit's pre-forward issues the all-gather of the unit
whose forward comes next in the recorded order (see [Note: forward order and
its changes] in ``_exec_order.py``) before the unit computes (on CUDA, before
its kernels are queued), one unit ahead at most: the memory bound FSDP1's
limiter gives on CUDA. ``forward_prefetch=True`` issues ahead too, also with
``limit_all_gathers=False``; ``limit_all_gathers=False`` with
``forward_prefetch=False`` gathers each unit on entry, as torch's FSDP1 does
on the CPU. ``RootContext.forward_ahead``
holds the unit issued ahead until its forward starts; the root frees it at
the end of its forward if it never ran.

[Note: reductions in flight]
Gradient reductions are issued asynchronously from the post-backward hook so
that they overlap the next unit's backward computation. Each keeps its padded
full gradient alive until it completes, so the queue is bounded: issuing a
reduction first completes (waits for and accumulates) the ones beyond
``max_reductions_in_flight``; the root's end-of-backward callback completes the
rest before ``backward()`` returns, so ``.grad`` is final when the user sees it.

A hybrid-sharded unit's reduction has a second collective, the all-reduce
across replicas, which needs the reduce-scatter's output. Issuing a new
reduction first moves every earlier one that still has that stage on to it
(waiting for its reduce-scatter, which has had a unit's backward to finish,
and issuing its all-reduce) instead of completing it, so the all-reduce in
turn overlaps the next unit's backward; such a reduction holds only its
sharded gradient, so it does not count towards the bound.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

import torch

from fsdp._runtime._exec_order import ExecOrder
from fsdp._runtime._sharded_storage import PendingReduce, ShardedStorage

__all__ = ["RateLimiter", "RootContext"]

S = TypeVar("S")  # a front end's per-unit state (the wrapper's FSDPState, fully_shard's)


class RateLimiter:
    """Bounds the gathers in flight on an asynchronous device (see [Note: rate limiter])."""

    def __init__(self, device: torch.device, enabled: bool, max_in_flight: int = 2) -> None:
        self._module: Any = None  # torch.cuda (or another accelerator module) or None
        self._device = device  # the unit's device: its stream, not the current device's
        if enabled and device.type != "cpu":
            self._module = torch.get_device_module(device)
        self._max = max_in_flight
        self._events: deque[Any] = deque()  # device events recorded after each free

    def record_free(self) -> None:
        """A unit just freed its gathered parameters (in stream order)."""
        if self._module is not None:
            event = self._module.Event()
            event.record(self._module.current_stream(self._device))
            self._events.append(event)

    def throttle(self) -> None:
        """Call before issuing a gather: waits while too many frees are pending."""
        if self._module is not None and len(self._events) >= self._max:
            self._events.popleft().synchronize()


class RootContext(Generic[S]):
    """Run-time state shared by every FSDP unit under one root (either front end)."""

    states: list[S]  # every unit's state in the tree, root first (pre-order)
    # The units' storages (asked for at the end of each backward: a unit may rebuild its own).
    storages: Callable[[], Iterable[ShardedStorage]]
    exec_order: ExecOrder[S]
    limiter: RateLimiter
    max_reductions_in_flight: int
    callback_queued: bool  # the end-of-backward callback is queued for this backward
    forward_ahead: S | None  # gathered ahead of its forward, which has not started

    def __init__(
        self,
        states: list[S],
        limiter: RateLimiter,
        storages: Callable[[], Iterable[ShardedStorage]],
    ) -> None:
        self.states = states
        self.storages = storages
        self.exec_order = ExecOrder()
        self.limiter = limiter
        self.max_reductions_in_flight = 1
        self.callback_queued = False
        self.forward_ahead = None
        self._reductions: deque[PendingReduce] = deque()

    def push_reduction(self, reduce: PendingReduce) -> None:
        """Track a reduction; complete the oldest ones beyond the bound.

        See [Note: reductions in flight].
        """
        staged = 0
        for r in self._reductions:
            if r.has_next_stage:
                r.owner.start_replica_reduce(r)
                staged += 1
        self._reductions.append(reduce)
        while len(self._reductions) > self.max_reductions_in_flight + staged:
            oldest = self._reductions.popleft()
            oldest.owner.finish_reduce_grad(oldest)

    def finish_reductions(self) -> None:
        """Complete every reduction in flight, oldest first.

        Then the CPU waits for the gradients copied to pinned host memory
        without blocking (``CPUOffload`` on CUDA), since the optimizer reads
        them next; see [Note: stream ordering] in ``_streams.py``.
        """
        while self._reductions:
            oldest = self._reductions.popleft()
            oldest.owner.finish_reduce_grad(oldest)
        for storage in self.storages():
            storage.wait_for_host_copies()

    # --- issue-ahead and the end of backward --------------------------------------------

    def start_refreshes(self) -> None:
        """Root pre-forward: issue the all-gather across replicas of every unit sharded
        across replicas that needs one, in the tree's order, so that they cross the slow
        link while the forward computes ([Note: sharding across replicas])."""
        for storage in self.storages():
            storage.start_refresh()

    def issue_ahead(self, target: S, unshard: Callable[[], None]) -> None:
        """Start ``target``'s gather before its forward ([Note: issue-ahead]): ``unshard``
        issues it. One unit ahead at most; the limiter bounds the gathers in flight."""
        if self.forward_ahead is not None:
            return  # never expected: the unit issued ahead would have run by now
        self.limiter.throttle()
        unshard()
        self.forward_ahead = target

    def take_forward_ahead(self) -> S | None:
        """The unit issued ahead whose forward has not started, if any (forgotten here:
        the root frees it at the end of its forward)."""
        target, self.forward_ahead = self.forward_ahead, None
        return target

    def queue_end_of_backward(self, callback: Callable[[], None]) -> None:
        """Have autograd run ``callback`` once, when this backward has finished."""
        if self.callback_queued:
            return
        self.callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(callback)

    # --- reductions ------------------------------------------------------------------------

    def drop_reductions(self) -> None:
        """Wait for every reduction in flight and discard its result (an iteration that
        failed: ``fully_shard``'s ``reset_iter_state``)."""
        while self._reductions:
            oldest = self._reductions.popleft()
            with contextlib.suppress(Exception):  # a failed collective: nothing to keep
                oldest.collective.wait()

    @property
    def reductions_in_flight(self) -> int:
        """How many reductions are issued but not completed."""
        return len(self._reductions)
