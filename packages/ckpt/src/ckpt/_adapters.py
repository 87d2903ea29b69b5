"""The adapters that let ``ckpt.save``/``ckpt.load`` handle fsdp models and their
optimizers and ``zero_optim`` optimizers (see [Note: the adapter protocol]).

* an fsdp model is saved as its SHARDED state dict (each rank writes the
  dimension-0 chunks of every parameter, DCP reshards them on load at any world
  size, and torch's FSDP1/``fully_shard`` checkpoints read and write the same
  layout), or as its LOCAL state dict if that type is selected on the model (then
  only loadable at the same world size, which is checked first);
* an optimizer over an fsdp model (either ``use_orig_params``): the sharded FQN-keyed
  state (DTensor chunks), the same for both modes, so one loads into the other;
* a ZeroRedundancyOptimizer: each rank's own parameters' state, whole.

At load, an optimizer that never stepped first creates its state (a step that changes
nothing, see ``init_optim_state``) so that DCP has tensors to fill.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckpt._fsdp_model_state import TEMPLATE_ATTR, LocalShardMismatchError
from ckpt._fsdp_optim_state import (
    fsdp_optim_state_dict,
    init_optim_state,
    load_fsdp_optim_state_dict,
)
from ckpt._optim_state import has_fsdp
from ckpt._state import StateContext, register_adapter
from ckpt._state_dict_type import get_state_dict_type, state_dict_type
from ckpt._zero_state import load_zero_optim_state_dict, zero_optim_state_dict
from fsdp import FullyShardedDataParallel
from fsdp.api import LocalStateDictConfig, ShardedStateDictConfig, StateDictType
from zero_optim import ZeroRedundancyOptimizer

__all__ = ["register_builtin_adapters"]


def _world_size(ctx: StateContext) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(ctx.process_group)


class FsdpModuleAdapter:
    """Models containing fsdp.FullyShardedDataParallel instances."""

    def applies_to(self, obj: object, ctx: StateContext) -> bool:
        return isinstance(obj, nn.Module) and has_fsdp(obj)

    def _local(self, obj: nn.Module, ctx: StateContext) -> bool:
        local = get_state_dict_type(obj).state_dict_type is StateDictType.LOCAL_STATE_DICT
        saved = ctx.manifest.world_size if ctx.manifest is not None else None
        if local and ctx.loading and saved is not None and saved != _world_size(ctx):
            raise LocalShardMismatchError(
                f"this checkpoint holds a LOCAL_STATE_DICT saved on {saved} ranks; it loads "
                f"only on {saved} ranks, not {_world_size(ctx)}. Save with the default "
                f"(SHARDED) state-dict type to load at another world size"
            )
        return local

    def state_dict(self, obj: nn.Module, ctx: StateContext) -> dict[str, Any]:
        if self._local(obj, ctx):
            with state_dict_type(obj, StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig()):
                return obj.state_dict()
        instances = FullyShardedDataParallel.fsdp_modules(obj) if ctx.loading else []
        for instance in instances:  # a template: no gather needed, DCP overwrites it
            setattr(instance, TEMPLATE_ATTR, True)
        try:
            # [Note: bounded device memory in save and load]
            # Each unit's chunks go to the host as soon as they are made, so a rank's
            # device holds at most one unit's chunks beyond the model, and chunks of
            # CPUOffload shards never visit it (on gloo; NCCL's all-to-all stages one
            # unit's shard there). A load's template is on the host too: DCP reads into
            # host memory, and loading moves the chunks to the device one unit at a time
            # (``chunks_to_shard``) instead of a second copy of the model there.
            config = ShardedStateDictConfig(offload_to_cpu=True)
            with state_dict_type(obj, StateDictType.SHARDED_STATE_DICT, config):
                return obj.state_dict()
        finally:
            for instance in instances:
                delattr(instance, TEMPLATE_ATTR)

    def load_state_dict(
        self, obj: nn.Module, state_dict: dict[str, Any], ctx: StateContext
    ) -> None:
        if self._local(obj, ctx):
            with state_dict_type(obj, StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig()):
                obj.load_state_dict(state_dict)
            return
        with state_dict_type(obj, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()):
            obj.load_state_dict(state_dict)


class FsdpOptimizerAdapter:
    """torch.optim optimizers over an fsdp model: FQN-keyed, DTensor chunks."""

    def applies_to(self, obj: object, ctx: StateContext) -> bool:
        if not isinstance(obj, torch.optim.Optimizer) or isinstance(obj, ZeroRedundancyOptimizer):
            return False
        try:
            return has_fsdp(ctx.module_for(obj))
        except ValueError:
            return False

    def state_dict(self, obj: torch.optim.Optimizer, ctx: StateContext) -> dict[str, Any]:
        if ctx.loading:
            init_optim_state(obj)
        # On the host when loading too: [Note: bounded device memory in save and load].
        return fsdp_optim_state_dict(ctx.module_for(obj), obj, sharded=True, offload_to_cpu=True)

    def load_state_dict(
        self, obj: torch.optim.Optimizer, state_dict: dict[str, Any], ctx: StateContext
    ) -> None:
        obj.load_state_dict(load_fsdp_optim_state_dict(ctx.module_for(obj), obj, state_dict))


class ZeroOptimizerAdapter:
    """zero_optim.ZeroRedundancyOptimizer: each rank its own parameters' state."""

    def applies_to(self, obj: object, ctx: StateContext) -> bool:
        return isinstance(obj, ZeroRedundancyOptimizer)

    def state_dict(self, obj: ZeroRedundancyOptimizer, ctx: StateContext) -> dict[str, Any]:
        if ctx.loading:
            init_optim_state(obj)
        return zero_optim_state_dict(ctx.module_for(obj), obj, full=False, offload_to_cpu=True)

    def load_state_dict(
        self, obj: ZeroRedundancyOptimizer, state_dict: dict[str, Any], ctx: StateContext
    ) -> None:
        load_zero_optim_state_dict(ctx.module_for(obj), obj, state_dict)


def register_builtin_adapters() -> None:
    """Register the fsdp and zero_optim adapters (done once when ckpt is imported)."""
    register_adapter(FsdpModuleAdapter())
    register_adapter(FsdpOptimizerAdapter())
    register_adapter(ZeroOptimizerAdapter())
