"""Reducing a DDP gradient bucket only to the ranks that own its parameters.

[Note: reduce to owners]
DDP all-reduces every gradient bucket, so every rank ends with every reduced
gradient; under ZeRO only the owner of a parameter uses its gradient. With
``hook_with_zero_step_to_owners`` each bucket is instead *reduced* (summed onto
one rank) run by run (small runs packed, see below), where a run is a maximal
slice of the bucket's buffer whose parameters have the same owner; the owner
then steps them and broadcasts
the new values (ZeRO's stage 1/2 pattern). In the usual bandwidth model a
ring all-reduce of ``n`` bytes sends ``2 n (N-1)/N`` bytes per rank, a reduce
or a broadcast ``n (N-1)/N``: reduce plus broadcast moves what the all-reduce
alone moves, where the all-reduce followed by the post-step broadcast of the
other hooks moves one and a half times that.

The reduce works in place on DDP's bucket buffer, which the hook has already
divided by the world size as torch's ``allreduce_hook`` does, so the owner's
sum is bit for bit the all-reduce's at two ranks (one addition). On a rank
that does not own a run, gloo leaves partial sums in the slice; they are
overwritten with zeros before DDP copies the buffer into ``.grad``, so after
``backward()`` a parameter's ``.grad`` holds its reduced gradient on its owner
and zeros on every other rank.

[Note: packed owner reduces]
The partition interleaves owners inside a bucket, so a bucket holds about as
many runs as parameters, and one reduce per run costs a collective's latency
(``2 (N-1)`` message hops in gloo) per bias and norm: at 4 ranks that
outweighed the bytes saved. Runs shorter than ``IN_PLACE_MIN_NUMEL`` elements
are therefore packed, owner by owner, into one staging buffer of
``STAGING_NUMEL`` elements and reduced with one collective per owner; the
owner copies its sums back into the bucket once they arrived. Large runs are
still reduced in place. (gloo's reduce-scatter, which would take one
collective per bucket, is an all-reduce underneath: it moves DDP's bytes.)

A bucket's staging buffer is released when its owners' step has used the
reduced gradients (``release_oldest``, in bucket order, on the thread that
runs the hooks), not when its reduces complete, whose timing differs between
ranks: whether a buffer is free, and so which collectives a bucket issues,
is then the same on every rank. The to-owners hook has at most two buckets
in flight (bucket k is stepped when k + 1 arrives), so ``STAGING_SLOTS``
buffers suffice; were none free, the bucket would reduce every run in place.
Packing changes no sum: each element is still added across the ranks once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from zero_optim._broadcast import IN_PLACE_MIN_NUMEL, STAGING_NUMEL, STAGING_SLOTS

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket  # torch.distributed.GradBucket

__all__ = ["OwnerReducer", "OwnerRun", "owner_runs", "split_runs"]


class OwnerRun(NamedTuple):
    """``buffer[start:end]`` holds gradients of parameters that ``owner`` steps."""

    owner: int  # rank in the optimizer's process group
    start: int
    end: int  # exclusive


def owner_runs(offsets: Sequence[tuple[int, int]], owners: Sequence[int]) -> list[OwnerRun]:
    """Merge adjacent ``(start, end)`` slices with the same owner into runs, in buffer order.

    A pure function of the bucket's layout and the partition, so every rank
    derives the same runs, and so the same collectives.
    """
    runs: list[OwnerRun] = []
    for (start, end), owner in sorted(zip(offsets, owners, strict=True)):
        if runs and runs[-1].owner == owner and runs[-1].end == start:
            runs[-1] = runs[-1]._replace(end=end)
        else:
            runs.append(OwnerRun(owner, start, end))
    return runs


class OwnerReducer:
    """Issues the to-owners reduces of one optimizer; see [Note: packed owner reduces].

    Holds the staging buffers (at most :data:`STAGING_SLOTS` per dtype and
    device, :data:`STAGING_NUMEL` elements each) for the optimizer's
    lifetime, so a step allocates nothing after the first.
    """

    # (dtype, device) -> staging buffers not carrying a bucket now
    _free: dict[tuple[torch.dtype, torch.device], list[Tensor]]
    _allocated: dict[tuple[torch.dtype, torch.device], int]  # buffers made so far per key
    _held: deque[Tensor | None]  # per issued bucket, in issue order: its buffer, if any

    def __init__(self) -> None:
        self._free = {}
        self._allocated = {}
        self._held = deque()

    def start(
        self,
        bucket: GradBucket,
        owner_of: Callable[[Tensor], int],
        rank: int,
        group: dist.ProcessGroup,
    ) -> Future[Tensor]:
        """Start reducing ``bucket`` onto its owners; a future of the bucket's buffer.

        The future completes once every gradient has arrived at its owner; its
        value is the bucket's buffer, reduced (and averaged) where this rank
        owns the parameters and zero elsewhere (see [Note: reduce to owners]).
        Call :meth:`release_oldest` once that future's value has been used.
        """
        buffer = bucket.buffer()
        world_size = dist.get_world_size(group)
        buffer.div_(world_size)
        base = buffer.data_ptr()
        size = buffer.element_size()
        offsets = []
        for g in bucket.gradients():
            start = (g.data_ptr() - base) // size
            offsets.append((start, start + g.numel()))
        runs = owner_runs(offsets, [owner_of(p) for p in bucket.parameters()])
        in_place, packed = split_runs(runs, world_size)
        slot = self._take_slot(buffer.dtype, buffer.device) if packed else None
        if slot is None:  # nothing to pack, or no buffer left: every run in place
            in_place, packed = runs, []
        self._held.append(slot)

        def reduce(t: Tensor, owner: int) -> Future[object]:
            work = dist.reduce(
                t,
                dist.get_global_rank(group, owner),
                op=dist.ReduceOp.SUM,
                group=group,
                async_op=True,
            )
            assert work is not None  # async_op=True always gives a handle
            done: Future[object] = work.get_future()
            return done

        futures: list[Future[object]] = []
        segments: list[tuple[int, int, list[OwnerRun]]] = []  # (owner, slot start, runs)
        offset = 0
        for owner in range(world_size):
            mine = [r for r in packed if r.owner == owner]
            if not mine:
                continue
            assert slot is not None
            start = offset
            for r in mine:
                n = r.end - r.start
                slot[offset : offset + n].copy_(buffer[r.start : r.end])
                offset += n
            futures.append(reduce(slot[start:offset], owner))
            segments.append((owner, start, mine))
        futures += [reduce(buffer[r.start : r.end], r.owner) for r in in_place]
        foreign = [r for r in runs if r.owner != rank]

        def unpack(done: Future[list[Future[object]]]) -> Tensor:
            for f in done.value():
                f.value()  # re-raises a failed reduce here rather than hiding it
            for owner, first, mine in segments:
                if owner != rank:
                    continue
                assert slot is not None
                at = first
                for r in mine:
                    n = r.end - r.start
                    buffer[r.start : r.end].copy_(slot[at : at + n])
                    at += n
            for r in foreign:
                buffer[r.start : r.end].zero_()
            return buffer

        return torch.futures.collect_all(futures).then(unpack)

    def release_oldest(self) -> None:
        """The oldest issued bucket's result was used: its staging buffer is free again."""
        slot = self._held.popleft()
        if slot is not None:
            self._free[(slot.dtype, slot.device)].append(slot)

    def _take_slot(self, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        key = (dtype, device)
        free = self._free.setdefault(key, [])
        if not free and self._allocated.get(key, 0) < STAGING_SLOTS:
            self._allocated[key] = self._allocated.get(key, 0) + 1
            free.append(torch.empty(STAGING_NUMEL, dtype=dtype, device=device))
        return free.pop() if free else None


def split_runs(runs: Sequence[OwnerRun], world_size: int) -> tuple[list[OwnerRun], list[OwnerRun]]:
    """``(in place, packed)``: which runs are reduced where they lie, which through a buffer.

    Runs shorter than :data:`IN_PLACE_MIN_NUMEL` are packed, in buffer order,
    while they fit into :data:`STAGING_NUMEL` elements; an owner left with a
    single packed run reduces it in place (packing it would save nothing).
    A pure function of the runs, so every rank issues the same collectives.
    """
    packed: list[OwnerRun] = []
    in_place: list[OwnerRun] = []
    room = STAGING_NUMEL
    for r in runs:
        n = r.end - r.start
        if n < IN_PLACE_MIN_NUMEL and n <= room:
            packed.append(r)
            room -= n
        else:
            in_place.append(r)
    for owner in range(world_size):
        mine = [r for r in packed if r.owner == owner]
        if len(mine) == 1:
            packed.remove(mine[0])
            in_place.append(mine[0])
    in_place.sort(key=lambda r: r.start)
    return in_place, packed
