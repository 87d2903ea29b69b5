"""``optim_state_dict``/``load_optim_state_dict``: one FQN-keyed format for every wrapper.

The same call works for an optimizer over an fsdp model, a ``zero_optim``
``ZeroRedundancyOptimizer`` and a plain ``torch.optim`` optimizer (under DDP or not),
and what it returns loads into any of them at any world size: the state of each
original parameter under its unwrapped name (see ``_wrappers/fsdp1_optim.py`` for the
layout). ``full=False`` keeps the state sharded: ``DTensor`` chunks for fsdp, each
rank's own parameters for zero_optim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from ckpt._wrappers.fsdp1_optim import fsdp_optim_state_dict, load_fsdp_optim_state_dict
from ckpt._wrappers.fully_shard import has_dtensor_params
from ckpt._wrappers.zero import load_zero_optim_state_dict, zero_optim_state_dict
from fsdp import FullyShardedDataParallel
from zero_optim import ZeroRedundancyOptimizer

__all__ = ["has_fsdp", "load_optim_state_dict", "optim_state_dict"]


def has_fsdp(model: nn.Module) -> bool:
    """Whether ``model`` contains an instance of our FullyShardedDataParallel."""
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    *,
    full: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = True,
) -> dict[str, Any]:
    """``optim``'s state keyed by ``model``'s parameter FQNs; a collective.

    ``full``: whole tensors (``rank0_only``: on rank 0 only, ``{}`` elsewhere);
    otherwise sharded as the wrapper shards it. ``offload_to_cpu`` copies tensors to
    the CPU. Load the result with :func:`load_optim_state_dict`, into any wrapper.
    """
    if isinstance(optim, ZeroRedundancyOptimizer):
        return zero_optim_state_dict(
            model, optim, full=full, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu
        )
    if has_fsdp(model):
        return fsdp_optim_state_dict(
            model, optim, sharded=not full, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu
        )
    options = StateDictOptions(full_state_dict=full, cpu_offload=offload_to_cpu)
    return dict(get_optimizer_state_dict(model, optim, options=options))


def load_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> None:
    """Load an FQN-keyed optimizer state dict (from any wrapper, any world size)."""
    if isinstance(optim, ZeroRedundancyOptimizer):
        load_zero_optim_state_dict(model, optim, state_dict)
    elif has_fsdp(model):
        optim.load_state_dict(load_fsdp_optim_state_dict(model, optim, state_dict))
    else:
        # Full tensors for DTensor parameters (fully_shard): torch's loader distributes them.
        full = has_dtensor_params(model) and not _has_dtensor_values(state_dict)
        options = StateDictOptions(full_state_dict=full)
        set_optimizer_state_dict(model, optim, dict(state_dict), options=options)


def _has_dtensor_values(obj: Any) -> bool:
    if isinstance(obj, DTensor):
        return True
    if isinstance(obj, Mapping):
        return any(_has_dtensor_values(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_dtensor_values(v) for v in obj)
    return False
