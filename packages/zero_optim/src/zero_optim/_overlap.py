"""Bookkeeping for running the optimizer step inside DDP's backward pass.

[Note: overlapping the step with DDP]
With ``overlap_with_ddp=True`` a DDP communication hook (``hook_with_zero_step``
or ``hook_with_zero_step_interleaved``) hands each gradient bucket to the
optimizer as DDP launches its all-reduce. Once a bucket's all-reduce is done,
the rank steps the parameters *of that bucket* that it owns, with the reduced
gradients, and every owner broadcasts its updated share of the bucket. The
broadcasts are waited for when the last bucket has been handled, still inside
``backward()``, so the next forward sees the updated model.

Ownership is the optimizer's own sorted-greedy partition, the same as without
overlap, and does not depend on how DDP lays out its buckets. That is what
makes every iteration a full step, the first ones included: torch's version
waits two or three iterations for DDP's bucket layout to settle and skips the
updates meanwhile; ours needs no layout in advance because each bucket says
which parameters it holds (``GradBucket.parameters()``). The results equal the
non-overlapped optimizer's from iteration 1.

Stepping only some parameters with an ordinary ``torch.optim`` optimizer: the
local optimizer's ``param_groups`` are swapped for copies that list only the
bucket's owned parameters, and their ``.grad`` for the reduced gradients, for
the duration of one ``step()`` call (``ZeroRedundancyOptimizer._step_only``).
Per-parameter optimizers (SGD, Adam, AdamW, RMSprop, ...) update each tensor
independently, so stepping in pieces equals stepping at once.

Modifying a parameter in place in the middle of backward is safe: DDP marks a
bucket ready only when every parameter in it has its final gradient, which
happens after every autograd node that uses the parameter has run.

Collective order (see [Note: collective order] in ``_collectives.py``): all
broadcasts are issued from the hook itself, on the autograd thread, in bucket
order and owner order, never from a future callback. ``hook_with_zero_step``
handles every bucket when the last one arrives; the interleaved hook handles
bucket ``k`` when bucket ``k + 1`` arrives (and the last one at once), so its
step overlaps the backward computation of the following buckets. Both orders
are identical on every rank, which is why both work on gloo, where torch's
refuse to run.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor
from torch.futures import Future

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket  # torch.distributed.GradBucket

__all__ = ["BackwardPhase", "HookKind", "OverlapState", "reduced_gradients"]


class BackwardPhase(enum.Enum):
    """Where the hooks are within one backward pass."""

    IDLE = enum.auto()
    """Between backward passes: no bucket of the current pass has arrived yet."""
    REDUCING = enum.auto()
    """Some buckets arrived; shards are being stepped as their all-reduces finish."""


class HookKind(enum.Enum):
    """Which hook drives the optimizer, and so when a bucket's shard is stepped."""

    AT_END = enum.auto()
    """``hook_with_zero_step``: every bucket is stepped when the last one arrives."""
    INTERLEAVED = enum.auto()
    """``hook_with_zero_step_interleaved``: bucket k is stepped when k + 1 arrives."""
    TO_OWNERS = enum.auto()
    """``hook_with_zero_step_to_owners``: as INTERLEAVED, with each bucket reduced only to
    its owners instead of all-reduced (see [Note: reduce to owners])."""


@dataclass
class OverlapState:
    """Per-iteration state of one optimizer driven by a DDP hook."""

    kind: HookKind | None = None  # None until a hook is built for this optimizer
    phase: BackwardPhase = BackwardPhase.IDLE
    # buckets whose all-reduce was launched but whose shard is not stepped yet
    pending: deque[tuple[GradBucket, Future[object]]] = field(default_factory=deque)
    passes: int = 0  # backward passes fully stepped so far
    user_step_warned: bool = False

    def begin_pass(self) -> None:
        """The first bucket of a backward pass has arrived."""
        assert self.phase is BackwardPhase.IDLE, self.phase
        assert not self.pending
        self.phase = BackwardPhase.REDUCING

    def end_pass(self) -> None:
        """Every bucket was stepped and every broadcast has landed."""
        assert self.phase is BackwardPhase.REDUCING, self.phase
        assert not self.pending
        self.phase = BackwardPhase.IDLE
        self.passes += 1


def reduced_gradients(bucket: GradBucket, fut: Future[object]) -> list[Tensor]:
    """Wait for a bucket's all-reduce and return its reduced gradients, one per parameter.

    A comm hook's future may hold the result in a new tensor rather than in the
    bucket's buffer (DDP copies it back only when backward finishes); copying it
    into the buffer now, as DDP will, makes ``bucket.gradients()`` (views of the
    buffer) hold the reduced values.
    """
    value = fut.wait()
    result = value[0] if isinstance(value, list) else value
    if not isinstance(result, Tensor):
        raise TypeError(
            f"the DDP comm hook's future returned {type(value).__name__}; it must "
            "return the bucket's reduced gradients as a Tensor"
        )
    buffer = bucket.buffer()
    if result.data_ptr() != buffer.data_ptr():
        buffer.copy_(result.view_as(buffer))
    return [g.view_as(p) for g, p in zip(bucket.gradients(), bucket.parameters(), strict=True)]
