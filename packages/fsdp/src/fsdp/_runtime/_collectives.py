"""The collectives FSDP issues, as stateless functions of their inputs.

Each function takes every tensor and the process group as arguments, issues the
collective asynchronously and returns a :class:`PendingCollective`; nothing here
knows about units, hooks or modules, so each is tested on its own.

[Note: asynchronous collectives]
Every collective is issued with ``async_op=True``. On CPU (gloo) the work runs
on the process group's worker threads while the caller keeps computing; on CUDA
(NCCL) it runs on the process group's own communication stream, which waits for
the issuing stream at issue time, and ``wait()`` makes the *current* stream wait
for it without blocking the CPU. Either way two rules keep it correct:
1. A collective's input and output must stay alive until ``wait()``; the
   :class:`PendingCollective` holds them (``keep_alive``) for that reason.
2. Nobody reads an output before ``wait()``: callers own the pending object and
   wait before they use the result (see ``FlatParamUnit.wait_for_unshard`` and
   ``FlatParamUnit.finish_reduce_grad``).
On CUDA a unit issues its collectives inside its unshard or post-backward
stream and calls ``wait()`` there at once, so that side stream (not the CPU)
waits, and hands the result to the compute stream with an event; see [Note:
stream ordering] in ``_streams.py``.

[Note: gloo's sharded collectives]
gloo's ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` cost about
twice what the same bytes cost through its ``broadcast`` and
``all_to_all_single`` (torch 2.13, CPU, one core per rank: a 7M-element fp32
unit gathers in 22.4 ms at 2 ranks and 32.2 ms at 4, and reduce-scatters in
23.7 and 50.9 ms; by broadcasts 8.9 and 19.8 ms, by an all-to-all and a local
sum 14.0 and 29.0 ms; ``python -m benchmarks collectives``, the fsdp README). So on
CPU tensors under gloo an all-gather is one broadcast per rank, each rank's
shard straight into its slot of the output, and a reduce-scatter is an
all-to-all of the padded gradient followed by a local sum of the received
chunks in rank order. Each rank sends ``(world_size - 1) / world_size`` of
the buffer, the bandwidth-optimal amount, as the native collectives do. At two
ranks the result is bitwise gloo's (two terms add the same either way); at
more ranks gloo's ring adds the terms in an order that depends on the
element's position in its segments, so a gradient may differ from torch's
FSDP on gloo in the last bit, as results of any two reduction algorithms do
(NCCL's depend on its algorithm and topology too). NCCL and every
other backend get the native collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fsdp._runtime._collective_failure import backend_failures

__all__ = [
    "PendingCollective",
    "all_gather_into",
    "all_of",
    "all_reduce_inplace",
    "gradient_divide_factors",
    "reduce_scatter_into",
]

GLOO_COMPOSITES = True
_GLOO_MAX_SEGMENT_BYTES = 1 << 24
"""Whether CPU tensors under gloo use [Note: gloo's sharded collectives].

Tests that count calls of the native collectives switch it off in their ranks."""


@dataclass
class PendingCollective:
    """An issued collective: wait before reading its output.

    ``work`` is ``None`` when nothing had to be communicated (a group of one
    rank), which keeps callers free of special cases.
    """

    work: Any  # dist.Work | _Works | None (torch does not type Work for mypy)
    keep_alive: tuple[Tensor, ...] = field(default_factory=tuple)  # inputs and outputs
    operation: str = ""  # for the error if it fails: "all_gather", ...
    target: str = ""  # what it moves, for that error
    finish: Callable[[], None] | None = None  # local work on the received data, after wait
    _done: bool = False

    def wait(self) -> None:
        """Block (CPU) or stream-wait (CUDA) until the collective finished; idempotent."""
        if not self._done:
            if self.work is not None:
                with backend_failures(self.operation, self.target):
                    self.work.wait()
            if self.finish is not None:
                self.finish()
                self.finish = None
            self._done = True
            self.keep_alive = ()

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has run."""
        return self._done


@dataclass(frozen=True)
class _Works:
    """Several issued collectives (or pending ones) that complete together, in order."""

    works: tuple[Any, ...]

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def all_of(pendings: list[PendingCollective]) -> PendingCollective:
    """One pending collective that completes when every one of ``pendings`` has (in order)."""
    if len(pendings) == 1:
        return pendings[0]
    return PendingCollective(_Works(tuple(pendings)))  # each names its own failure


def _gloo_composite(group: Any, tensor: Tensor) -> bool:
    """Whether [Note: gloo's sharded collectives] applies to ``tensor`` in ``group``."""
    return (
        GLOO_COMPOSITES and tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(group))
    )


def gradient_divide_factors(world_size: int) -> tuple[float, float]:
    """Split the 1/world_size gradient average into a pre- and a post-division.

    Dividing everything before a summing reduction can underflow low-precision
    gradients; dividing everything after can overflow them. FSDP divides by a
    power of two ``pre`` (about sqrt(world_size)) before the reduction and by
    ``world_size / pre`` after it, as torch's FSDP does, so that our gradients
    are bit-for-bit those of torch's FSDP. Since ``pre`` is a power of two the
    split costs no precision over a single division for world sizes that are
    powers of two.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre


def _collective(name: str, legacy: str) -> Callable[..., Any]:
    # torch 2.13 renamed all_gather_into_tensor/reduce_scatter_tensor to *_single; look
    # the function up at call time so older torch works and test spies see every call.
    fn = getattr(dist, name, None)
    if fn is None:
        fn = getattr(dist, legacy)
    return fn  # type: ignore[no-any-return]


def all_gather_into(output: Tensor, shard: Tensor, group: Any) -> PendingCollective:
    """Gather every rank's ``shard`` into ``output`` (rank ``r``'s at ``r * shard.numel()``).

    ``output`` is the padded unsharded buffer of ``world_size * shard.numel()``
    elements; see [Note: asynchronous collectives] for the rules on waiting.
    """
    if output.numel() == shard.numel():
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard)
        return PendingCollective(None)
    target = _describe(output)
    with backend_failures("all_gather", target):
        if _gloo_composite(group, shard):
            work = _gather_by_broadcasts(output, shard, group)
        else:
            fn = _collective("all_gather_single", "all_gather_into_tensor")
            work = fn(output, shard, group=group, async_op=True)
    return PendingCollective(work, (output, shard), "all_gather", target)


def _gather_by_broadcasts(output: Tensor, shard: Tensor, group: Any) -> _Works:
    """All-gather as one broadcast per rank, each from its slot of ``output``."""
    group = dist.group.WORLD if group is None else group
    n = shard.numel()
    flat = output.view(-1)
    rank = dist.get_rank(group)
    mine = flat.narrow(0, rank * n, n)
    if mine.data_ptr() != shard.data_ptr():
        mine.copy_(shard.view(-1))
    works = tuple(
        dist.broadcast(
            flat.narrow(0, i * n, n), dist.get_global_rank(group, i), group=group, async_op=True
        )
        for i in range(dist.get_world_size(group))
    )
    return _Works(works)


def reduce_scatter_into(output: Tensor, padded: Tensor, group: Any) -> PendingCollective:
    """Sum ``padded`` over ranks and leave this rank's chunk in ``output``.

    ``padded`` has ``world_size * output.numel()`` elements (the padded
    unsharded gradient); division for averaging is the caller's (see
    :func:`gradient_divide_factors`).
    """
    if output.numel() == padded.numel():
        output.copy_(padded)
        return PendingCollective(None)
    target = f"the gradient ({_describe(padded)})"
    if _gloo_composite(group, padded):
        received = torch.empty_like(padded)
        with backend_failures("reduce_scatter", target):
            work = dist.all_to_all_single(received, padded, group=group, async_op=True)

        def finish() -> None:
            mine = output.view(-1)
            chunks = received.view(-1, mine.numel())
            mine.copy_(chunks[0])
            for chunk in chunks[1:]:
                mine.add_(chunk)
            # Free it now: the backend's work object still refers to it, and the
            # caller may keep the pending collective until the end of backward.
            received.untyped_storage().resize_(0)

        return PendingCollective(work, (output, padded, received), "reduce_scatter", target, finish)
    fn = _collective("reduce_scatter_single", "reduce_scatter_tensor")
    with backend_failures("reduce_scatter", target):
        work = fn(output, padded, group=group, async_op=True)
    return PendingCollective(work, (output, padded), "reduce_scatter", target)


def all_reduce_inplace(tensor: Tensor, group: Any, world_size: int) -> PendingCollective:
    """Sum ``tensor`` over ranks in place (``NO_SHARD``'s gradient reduction)."""
    if world_size == 1:
        return PendingCollective(None)
    target = f"the gradient ({_describe(tensor)})"
    with backend_failures("all_reduce", target):
        work = dist.all_reduce(tensor, group=group, async_op=True)
    return PendingCollective(work, (tensor,), "all_reduce", target)


def _describe(tensor: Tensor) -> str:
    return f"{tensor.numel():,} {str(tensor.dtype).removeprefix('torch.')} elements"
