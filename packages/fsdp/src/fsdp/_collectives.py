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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import Tensor

from fsdp._collective_failure import backend_failures

__all__ = [
    "PendingCollective",
    "all_gather_into",
    "all_reduce_inplace",
    "gradient_divide_factors",
    "reduce_scatter_into",
]


@dataclass
class PendingCollective:
    """An issued collective: wait before reading its output.

    ``work`` is ``None`` when nothing had to be communicated (a group of one
    rank), which keeps callers free of special cases.
    """

    work: Any  # dist.Work | None (torch does not type Work for mypy)
    keep_alive: tuple[Tensor, ...] = field(default_factory=tuple)  # inputs and outputs
    operation: str = ""  # for the error if it fails: "all_gather", ...
    target: str = ""  # what it moves, for that error
    _done: bool = False

    def wait(self) -> None:
        """Block (CPU) or stream-wait (CUDA) until the collective finished; idempotent."""
        if not self._done:
            if self.work is not None:
                with backend_failures(self.operation, self.target):
                    self.work.wait()
            self._done = True
            self.keep_alive = ()

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has run."""
        return self._done


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
    fn = _collective("all_gather_single", "all_gather_into_tensor")
    target = _describe(output)
    with backend_failures("all_gather", target):
        work = fn(output, shard, group=group, async_op=True)
    return PendingCollective(work, (output, shard), "all_gather", target)


def reduce_scatter_into(output: Tensor, padded: Tensor, group: Any) -> PendingCollective:
    """Sum ``padded`` over ranks and leave this rank's chunk in ``output``.

    ``padded`` has ``world_size * output.numel()`` elements (the padded
    unsharded gradient); division for averaging is the caller's (see
    :func:`gradient_divide_factors`).
    """
    if output.numel() == padded.numel():
        output.copy_(padded)
        return PendingCollective(None)
    fn = _collective("reduce_scatter_single", "reduce_scatter_tensor")
    target = f"the gradient ({_describe(padded)})"
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
