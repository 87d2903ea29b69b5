"""Reducing a DDP gradient bucket only to the ranks that own its parameters.

[Note: reduce to owners]
DDP all-reduces every gradient bucket, so every rank ends with every reduced
gradient; under ZeRO only the owner of a parameter uses its gradient. With
``hook_with_zero_step_to_owners`` each bucket is instead *reduced* (summed onto
one rank) run by run, where a run is a maximal slice of the bucket's buffer
whose parameters have the same owner; the owner then steps them and broadcasts
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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket  # torch.distributed.GradBucket

__all__ = ["OwnerRun", "owner_runs", "reduce_to_owners"]


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


def reduce_to_owners(
    bucket: GradBucket,
    owner_of: Callable[[Tensor], int],
    rank: int,
    group: dist.ProcessGroup,
) -> Future[Tensor]:
    """Start reducing each run of ``bucket`` onto its owner; a future of the buffer.

    The future completes once every run has arrived at its owner; its value
    is the bucket's buffer, reduced (and averaged) where this rank owns the
    parameters and zero elsewhere (see [Note: reduce to owners]).
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
    works = [
        dist.reduce(
            buffer[r.start : r.end],
            dist.get_global_rank(group, r.owner),
            op=dist.ReduceOp.SUM,
            group=group,
            async_op=True,
        )
        for r in runs
    ]
    futures = [w.get_future() for w in works if w is not None]
    foreign = [r for r in runs if r.owner != rank]

    def clear_foreign(done: Future[list[Future[object]]]) -> Tensor:
        for f in done.value():
            f.value()  # re-raises a failed reduce here rather than hiding it
        for r in foreign:
            buffer[r.start : r.end].zero_()
        return buffer

    return torch.futures.collect_all(futures).then(clear_foreign)
