"""Sharing updated parameters from their owners without copying them.

[Note: bounded broadcast]
After a step every owner sends its updated parameters to the other ranks. The
parameters are already in memory on every rank (the owner's hold the new
values, the others' are about to be overwritten), so the cheapest message is
the parameter itself: a tensor at least :data:`IN_PLACE_MIN_NUMEL` elements
long, and contiguous, is broadcast in place, with no copy on either side.

Only small tensors (biases, norms) are worth packing, because one collective
costs more than copying a few kilobytes. They travel through a handful of
*staging buffers* of :data:`STAGING_NUMEL` elements each, kept by the
:class:`ShardBroadcaster` for the optimizer's lifetime: the owner packs a run
of small tensors into a free buffer and broadcasts it; receivers unpack it
once it has arrived. When every buffer is in flight, the oldest message is
waited for (and unpacked) before its buffer is reused, so the extra memory is
at most ``STAGING_SLOTS * STAGING_NUMEL`` elements per dtype and device
whatever the model's size, and no buffer is ever allocated during a step
after the first. (A non-contiguous tensor too large for a buffer is the one
exception: it is sent through a contiguous copy of itself.)

Every rank derives the same sequence of messages from the same list of
tensors (sizes and contiguity agree across ranks), so the collective order of
[Note: collective order] in ``_collectives.py`` holds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["IN_PLACE_MIN_NUMEL", "STAGING_NUMEL", "STAGING_SLOTS", "ShardBroadcaster"]

IN_PLACE_MIN_NUMEL = 1 << 15  # 128 KiB of fp32: bigger tensors are broadcast in place
STAGING_NUMEL = 1 << 18  # elements per staging buffer (1 MiB of fp32)
STAGING_SLOTS = 2  # staging buffers per (dtype, device)


@dataclass
class _Message:
    """One issued broadcast; for a staged one, where its data goes on arrival."""

    work: dist.Work
    slot: Tensor | None  # the buffer carrying it; None when sent in place
    targets: Sequence[Tensor]  # receivers unpack ``slot`` into these once it arrived
    reusable: bool = False  # ``slot`` is a staging buffer, free again once this completes


class ShardBroadcaster:
    """Issues the post-step broadcasts of one optimizer; see [Note: bounded broadcast]."""

    group: dist.ProcessGroup
    rank: int  # rank in ``group``
    # (dtype, device) -> the staging buffers (1D, STAGING_NUMEL each) not in flight now
    _free: dict[tuple[torch.dtype, torch.device], list[Tensor]]
    _allocated: dict[tuple[torch.dtype, torch.device], int]  # buffers made so far per key
    _in_flight: deque[_Message]  # issued, not yet waited for, in issue order

    def __init__(self, group: dist.ProcessGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self._free = {}
        self._allocated = {}
        self._in_flight = deque()

    def start(self, tensors: Sequence[Tensor], owner: int) -> None:
        """Start broadcasting ``tensors`` (the same list on every rank) from ``owner``.

        Large contiguous tensors go in place; runs of small ones are packed
        into staging buffers (the owner copies them in, receivers copy them
        out in :meth:`finish` or when the buffer is needed again).
        """
        src = dist.get_global_rank(self.group, owner)
        run: list[Tensor] = []
        run_numel = 0
        for t in tensors:
            n = t.numel()
            if n == 0:
                continue
            if t.is_contiguous() and n >= IN_PLACE_MIN_NUMEL:
                self._send_in_place(t, src)
            elif n > STAGING_NUMEL:  # non-contiguous and too big to stage
                self._send_copy(t, owner, src)
            else:
                if run and (run_numel + n > STAGING_NUMEL or run[0].dtype != t.dtype):
                    self._send_run(run, owner, src)
                    run, run_numel = [], 0
                run.append(t)
                run_numel += n
        if run:
            self._send_run(run, owner, src)

    def finish(self) -> None:
        """Wait for every broadcast started so far and unpack the staged ones."""
        while self._in_flight:
            self._complete_oldest()

    # ----------------------------------------------------------- internals

    def _send_in_place(self, t: Tensor, src: int) -> None:
        work = dist.broadcast(t.detach(), src, self.group, async_op=True)
        self._in_flight.append(_Message(_work(work), None, ()))

    def _send_copy(self, t: Tensor, owner: int, src: int) -> None:
        buf = t.detach().contiguous() if owner == self.rank else torch.empty_like(t).contiguous()
        work = dist.broadcast(buf, src, self.group, async_op=True)
        self._in_flight.append(_Message(_work(work), buf, () if owner == self.rank else (t,)))

    def _send_run(self, run: Sequence[Tensor], owner: int, src: int) -> None:
        if len(run) == 1 and run[0].is_contiguous():
            self._send_in_place(run[0], src)
            return
        numel = sum(t.numel() for t in run)
        slot = self._take_slot(run[0].dtype, run[0].device)
        message = slot[:numel]
        if owner == self.rank:
            offset = 0
            for t in run:
                n = t.numel()
                message[offset : offset + n].view_as(t).copy_(t.detach())
                offset += n
        work = dist.broadcast(message, src, self.group, async_op=True)
        targets = () if owner == self.rank else run
        self._in_flight.append(_Message(_work(work), slot, targets, reusable=True))

    def _take_slot(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        key = (dtype, device)
        free = self._free.setdefault(key, [])
        while not free:
            if self._allocated.get(key, 0) < STAGING_SLOTS:
                self._allocated[key] = self._allocated.get(key, 0) + 1
                free.append(torch.empty(STAGING_NUMEL, dtype=dtype, device=device))
            else:  # every buffer of this kind is in flight: the oldest message frees one
                self._complete_oldest()
        return free.pop()

    def _complete_oldest(self) -> None:
        message = self._in_flight.popleft()
        message.work.wait()
        if message.slot is None:
            return
        offset = 0
        for t in message.targets:
            n = t.numel()
            t.detach().copy_(message.slot[offset : offset + n].view_as(t))
            offset += n
        if message.reusable:
            key = (message.slot.dtype, message.slot.device)
            self._free[key].append(message.slot)


def _work(work: dist.Work | None) -> dist.Work:
    if work is None:  # only happens for async_op=False
        raise AssertionError("an async collective returned no work handle")
    return work
