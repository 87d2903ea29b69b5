"""DDP communication hooks that run a ``ZeroRedundancyOptimizer`` step during backward.

Drop-in for ``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook``: same
names, same arguments. The mechanics are in [Note: overlapping the step with
DDP] (``_overlap.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import Tensor
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from zero_optim._optimizer import ZeroRedundancyOptimizer
from zero_optim._overlap import HookKind

if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket  # torch.distributed.GradBucket

    # what DDP.register_comm_hook takes: (state, bucket) -> future of the reduced bucket
    CommHook = Callable[[Any, GradBucket], Future[Tensor]]

__all__ = [
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "hook_with_zero_step_to_owners",
]


def hook_with_zero_step(
    hook: CommHook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
) -> CommHook:
    """Wrap ``hook`` so that ``zero`` steps when DDP's last gradient bucket arrives.

    Register the result with ``ddp.register_comm_hook(state, ...)`` and drop
    ``zero.step()`` from the training loop. The backward computation runs
    uninterrupted; the optimizer step then overlaps the outstanding
    all-reduces and the parameter broadcasts. Prefer it over the interleaved
    hook when communication is slow relative to computation.

    ``shard_buckets`` is accepted for compatibility with torch and has no
    effect: parameters are always owned according to the optimizer's own
    partition, which already spreads every bucket over the ranks.

    Unlike torch's, every iteration updates the parameters (no warm-up
    iterations are lost) and gloo is supported.
    """
    return _wrap(hook, ddp, zero, HookKind.AT_END)


def hook_with_zero_step_interleaved(
    hook: CommHook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
) -> CommHook:
    """Wrap ``hook`` so that ``zero`` steps each bucket's shard while backward continues.

    Bucket ``k``'s shard is stepped, and broadcast, when bucket ``k + 1`` is
    handed to the hook, so the step interleaves with the backward computation
    of the remaining buckets. Prefer it over :func:`hook_with_zero_step` when
    communication is fast relative to computation. ``shard_buckets`` has no
    effect (see :func:`hook_with_zero_step`).
    """
    return _wrap(hook, ddp, zero, HookKind.INTERLEAVED)


def hook_with_zero_step_to_owners(
    ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer
) -> CommHook:
    """A DDP hook that reduces each gradient only to its owner, which steps it during backward.

    Register it with ``ddp.register_comm_hook(None, hook_with_zero_step_to_owners(ddp, zero))``
    and drop ``zero.step()`` from the loop. It replaces DDP's all-reduce
    rather than wrapping a hook: each bucket's gradients are summed onto the
    ranks that own them (ZeRO's stage 1/2 pattern), the owners step their
    share as the buckets complete (bucket ``k`` when ``k + 1`` arrives, as
    the interleaved hook), and the new parameters are broadcast. A step then
    moves as many bytes as plain DDP's all-reduce, where the other hooks and
    ``step()`` move one and a half times that (see [Note: reduce to owners]),
    and the parameters equal DDP with the plain optimizer.

    Choose it over :func:`hook_with_zero_step` when the network is the
    bottleneck (gloo, several hosts, large models) and nothing needs the
    full gradients after ``backward()``: a parameter's ``.grad`` holds its
    reduced gradient only on its owner and zeros elsewhere, so gradient
    clipping by global norm or gradient inspection across the whole model
    are not possible (nor are they with the other hooks, which step before
    ``backward()`` returns), and a custom reduction (compression, another
    averaging) cannot be plugged in; use the wrapping hooks for those.
    """
    return _wrap(None, ddp, zero, HookKind.TO_OWNERS)


def _wrap(
    hook: CommHook | None,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    kind: HookKind,
) -> CommHook:
    if not isinstance(zero, ZeroRedundancyOptimizer):
        raise TypeError(
            "the zero argument must be a zero_optim.ZeroRedundancyOptimizer, got "
            f"{type(zero).__name__}"
        )
    if not zero._overlap_with_ddp:
        raise ValueError(
            "ZeroRedundancyOptimizer must be constructed with overlap_with_ddp=True "
            "to use this hook"
        )
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(
            f"the ddp argument must be a DistributedDataParallel model, got {type(ddp).__name__}"
        )
    ddp_ranks = dist.get_process_group_ranks(ddp.process_group)
    zero_ranks = dist.get_process_group_ranks(zero.process_group)
    if ddp_ranks != zero_ranks:
        raise ValueError(
            f"DDP reduces over ranks {ddp_ranks} but the optimizer shards over ranks "
            f"{zero_ranks}: build both on the same process group"
        )
    owned = zero.param_to_rank
    missing = [
        name for name, p in ddp.module.named_parameters() if p.requires_grad and p not in owned
    ]
    if missing:
        raise ValueError(
            f"the optimizer does not hold DDP's trainable parameters {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}: build it from ddp_model.parameters()"
        )
    zero._attach_hook(kind)

    def hook_with_zero(state: Any, bucket: GradBucket) -> Future[Tensor]:
        if hook is None:
            return zero._reduce_ddp_bucket_to_owners(bucket)
        fut = hook(state, bucket)
        zero._on_ddp_bucket(bucket, fut)  # type: ignore[arg-type]
        return fut

    # DDP.register_comm_hook compares the annotations with dist.GradBucket and
    # Future[Tensor] by value; postponed (string) annotations would fail that check.
    hook_with_zero.__annotations__ = {
        "state": Any,
        "bucket": dist.GradBucket,  # type: ignore[attr-defined]
        "return": Future[Tensor],
    }
    return hook_with_zero
