"""Gradient-norm clipping over gradients that are sharded across ranks.

A sharded gradient's norm needs every rank's piece: for a p-norm the ranks
sum their local ``||g_r||_p^p`` (padding is zero and adds nothing), for the
inf-norm they take the maximum. Gradients that every rank holds whole
(``NO_SHARD`` units) must not be summed over ranks; they are added locally
after the reduction.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["clip_grad_norm_", "local_grad_norm"]


def local_grad_norm(grads: Iterable[Tensor], norm_type: float, device: torch.device) -> Tensor:
    """The ``norm_type`` norm of ``grads`` viewed as one vector, in fp32, on ``device``.

    fp32 whatever the gradients' dtype, since the result is then combined
    across ranks; 0 when there are no gradients.
    """
    grads = list(grads)
    if not grads:
        return torch.tensor(0.0, device=device)
    dtypes = {g.dtype for g in grads}
    if len(dtypes) != 1:
        raise ValueError(
            "clip_grad_norm_: Requires uniform dtype across all gradients but got "
            f"{sorted(map(str, dtypes))}; give every parameter of the model one dtype"
        )
    norms = [
        torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32).to(device)
        for g in grads
    ]
    total: Tensor = torch.linalg.vector_norm(torch.stack(norms), norm_type, dtype=torch.float32)
    return total


def clip_grad_norm_(
    sharded_grads: list[Tensor],
    replicated_grads: list[Tensor],
    max_norm: float,
    norm_type: float,
    *,
    group: object,
    device: torch.device,
    result_device: torch.device,
) -> Tensor:
    """Scale every gradient in place so that the total norm is at most ``max_norm``.

    Returns the total norm before clipping, in the widest gradient dtype
    (fp32 when this rank has no gradient, with a warning: ranks cannot agree
    on a dtype without more communication).
    """
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    if not max_norm >= 0.0:  # also refuses NaN
        raise ValueError(
            f"clip_grad_norm_(max_norm={max_norm}): max_norm must be >= 0 (a negative one "
            "would flip the gradients' sign); pass the largest total norm to allow, e.g. 1.0"
        )
    if not (norm_type > 0.0):
        raise ValueError(
            f"clip_grad_norm_(norm_type={norm_type}): norm_type must be > 0 (2.0 for the "
            "Euclidean norm, math.inf for the largest absolute value)"
        )
    local_sharded = local_grad_norm(sharded_grads, norm_type, device)
    local_replicated = local_grad_norm(replicated_grads, norm_type, device)
    if norm_type == math.inf:
        total = torch.maximum(local_sharded, local_replicated)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = local_sharded**norm_type
        dist.all_reduce(total, group=group)
        total = (total + local_replicated**norm_type) ** (1.0 / norm_type)
    total = total.to(result_device)
    grads = sharded_grads + replicated_grads
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.device, g.dtype))
    if not grads:
        # The wording of torch's FSDP warning, which code may match on.
        rank = dist.get_rank(group)  # type: ignore[arg-type]
        warnings.warn(
            f"Called FSDP.clip_grad_norm_() on rank {rank} with no gradients -- returning the "
            f"total norm in the default dtype {total.dtype}",
            stacklevel=3,
        )
        return total
    dtype = functools.reduce(torch.promote_types, [g.dtype for g in grads])
    return total.to(dtype)
