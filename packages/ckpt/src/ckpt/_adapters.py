"""The adapters that let ``ckpt.save``/``ckpt.load`` handle fsdp models and their
optimizers and ``zero_optim`` optimizers (see [Note: the adapter protocol]).

* an fsdp model is saved as the runs of each original parameter that its rank's flat
  shards hold ([Note: capture, then copy or write] in ``_fsdp_save_state.py``): DCP
  reads them by overlap into any layout, so the checkpoint loads at any world size and
  into torch's FSDP1/``fully_shard``; it is loaded through its SHARDED state dict
  (dimension-0 chunks). With the LOCAL state-dict type selected on the model, the flat
  shards themselves are saved (only loadable at the same world size, checked first);
* an optimizer over an fsdp model (either ``use_orig_params``): FQN-keyed state, saved
  as runs like the parameters and loaded as DTensor chunks, the same for both modes, so
  one loads into the other;
* a ZeroRedundancyOptimizer: each rank's own parameters' state, whole.

At save every adapter returns this rank's state by reference, without a collective;
at load, an optimizer that never stepped first creates its state (a step that changes
nothing, see ``init_optim_state``) so that DCP has tensors to fill.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckpt._fsdp_model_state import CAPTURE_ATTR, TEMPLATE_ATTR, LocalShardMismatchError
from ckpt._fsdp_optim_state import (
    fsdp_optim_state_dict,
    init_optim_state,
    load_fsdp_optim_state_dict,
)
from ckpt._fsdp_save_state import fsdp_optim_capture
from ckpt._optim_state import has_fsdp
from ckpt._state import StateContext, register_adapter
from ckpt._state_dict_type import get_state_dict_type, state_dict_type
from ckpt._zero_state import load_zero_optim_state_dict, zero_optim_state_dict
from fsdp import FullyShardedDataParallel
from fsdp.api import (
    LocalStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictType,
)
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
        sd_type = StateDictType.SHARDED_STATE_DICT
        config: StateDictConfig = ShardedStateDictConfig()
        if self._local(obj, ctx):
            sd_type, config = StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig()
        elif ctx.loading:
            # [Note: bounded device memory at load]
            # A load's template is on the host: DCP reads into host memory, and loading
            # moves the chunks to the device one unit at a time (``chunks_to_shard``)
            # instead of a second copy of the model there.
            config = ShardedStateDictConfig(offload_to_cpu=True)
        # At save what this rank writes, by reference ([Note: capture, then copy or
        # write]); at load a template for DCP to fill (no gather needed).
        marker = TEMPLATE_ATTR if ctx.loading else CAPTURE_ATTR
        instances = FullyShardedDataParallel.fsdp_modules(obj)
        for instance in instances:
            setattr(instance, marker, True)
        try:
            with state_dict_type(obj, sd_type, config):
                return obj.state_dict()
        finally:
            for instance in instances:
                delattr(instance, marker)

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
        if not ctx.loading:  # [Note: capture, then copy or write]
            return fsdp_optim_capture(ctx.module_for(obj), obj)
        init_optim_state(obj)
        # On the host: [Note: bounded device memory at load].
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
        # At save by reference ([Note: capture, then copy or write]).
        return zero_optim_state_dict(
            ctx.module_for(obj), obj, full=False, offload_to_cpu=True, copy_tensors=ctx.loading
        )

    def load_state_dict(
        self, obj: ZeroRedundancyOptimizer, state_dict: dict[str, Any], ctx: StateContext
    ) -> None:
        load_zero_optim_state_dict(ctx.module_for(obj), obj, state_dict)


def register_builtin_adapters() -> None:
    """Register the fsdp and zero_optim adapters (done once when ckpt is imported)."""
    register_adapter(FsdpModuleAdapter())
    register_adapter(FsdpOptimizerAdapter())
    register_adapter(ZeroOptimizerAdapter())
