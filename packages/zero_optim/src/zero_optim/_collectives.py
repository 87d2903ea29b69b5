"""The collectives of a ZeRO step, as stateless functions.

Every input is an argument (tensors, ranks, the process group), so the optimizer
and the DDP hooks share them and nothing here reads optimizer state.

[Note: collective order]
Every rank must issue the same collectives in the same order, or gloo pairs a
broadcast on one rank with an all-reduce on another (and hangs or corrupts
data). The order here is always derived from the partition, which every rank
computes identically: sources in rank order, tensors in local-optimizer order.
All collectives are issued from the thread that calls into this module, never
from a future's callback, whose thread and timing differ between ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "gather_to",
    "pack",
    "send_grads_to_joined",
]


def pack(tensors: Sequence[Tensor]) -> Tensor:
    """Concatenate ``tensors`` (same dtype and device) into one new 1-D tensor."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def gather_to(
    obj: Any,
    dst: int,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup,
    *,
    device: torch.device | None = None,
) -> list[Any]:
    """Gather one picklable object per rank on group rank ``dst``, one owner at a time.

    Returns the objects in rank order on ``dst`` and ``[]`` elsewhere. Tensors
    inside ``obj`` should already be on the CPU: they are pickled. Each rank
    sends its object to ``dst`` in turn (rank order), so ``dst`` has one
    owner's bytes in flight at a time (on ``device`` for NCCL) instead of all
    ``world_size`` at once as with ``gather_object``, which near the GPU memory
    limit is the difference between a checkpoint and an out-of-memory error.
    ``device`` is the optimizer's parameters' device, not the current device.
    """
    via = _object_device(group, device)
    out: list[Any] = []
    for src in range(world_size):
        if src == dst:
            if rank == dst:
                out.append(obj)
        elif rank == src:
            dist.send_object_list([obj], group=group, group_dst=dst, device=via)
        elif rank == dst:
            box: list[Any] = [None]
            dist.recv_object_list(box, group=group, group_src=src, device=via)
            out.append(box[0])
    return out if rank == dst else []


def _object_device(group: dist.ProcessGroup, device: torch.device | None) -> torch.device | None:
    """Where an object collective's bytes travel: the CPU unless the group is NCCL alone,
    then ``device`` (the parameters' GPU; None leaves torch's choice, the current one)."""
    if str(dist.get_backend(group)) != "nccl":
        return torch.device("cpu")
    return device if device is not None and device.type == "cuda" else None


def send_grads_to_joined(
    params_per_rank: Sequence[Sequence[Tensor]],
    joined: bool,
    rank: int,
    group: dist.ProcessGroup,
    device: torch.device,
) -> None:
    """Give every joined rank the gradients of the parameters it owns.

    Called on every rank before a step inside a ``Join`` context: ``joined`` is
    whether the caller has run out of inputs. See [Note: uneven inputs] in
    ``_optimizer.py`` for why this is needed. ``params_per_rank[r]`` are the
    trainable parameters rank ``r`` steps, the same list on every rank.
    """
    world_size = len(params_per_rank)
    flags = torch.zeros(world_size, dtype=torch.int32, device=device)
    if joined:
        flags[rank] = 1
    dist.all_reduce(flags, group=group)
    is_joined = [bool(f) for f in flags.tolist()]
    if not any(is_joined):
        return
    # A joined rank only steps while another rank still trains (Join's loop
    # stops when none does), so a source always exists.
    source = is_joined.index(False)
    src = dist.get_global_rank(group, source)
    for target, target_joined in enumerate(is_joined):
        params = params_per_rank[target]
        if not target_joined or not params:
            continue
        # Which parameters have a gradient on the source (None means "skip this
        # parameter", which an optimizer must see as such), then the gradients.
        has_grad = torch.tensor(
            [p.grad is not None for p in params], dtype=torch.uint8, device=device
        )
        dist.broadcast(has_grad, src, group)
        with_grad = [p for p, h in zip(params, has_grad.tolist(), strict=True) if h]
        if with_grad:
            if rank == source:
                flat = pack([p.grad for p in with_grad if p.grad is not None])
            else:
                numel = sum(p.numel() for p in with_grad)
                flat = torch.empty(numel, dtype=with_grad[0].dtype, device=with_grad[0].device)
            dist.broadcast(flat, src, group)
        if rank != target:
            continue
        offset = 0
        for p, h in zip(params, has_grad.tolist(), strict=True):
            if not h:
                p.grad = None
                continue
            n = p.numel()
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(flat[offset : offset + n].view_as(p))
            offset += n


def _async(work: dist.Work | None) -> dist.Work:
    if work is None:  # only happens for async_op=False
        raise AssertionError("an async collective returned no work handle")
    return work
