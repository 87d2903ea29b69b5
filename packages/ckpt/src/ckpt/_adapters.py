"""The adapters that let ``ckpt.save``/``ckpt.load`` handle fsdp models and their
optimizers and ``zero_optim`` optimizers (see [Note: the adapter protocol]).

* an fsdp model is saved and loaded as the runs of each original parameter that its
  rank's flat shards hold ([Note: capture, then copy or write] and [Note: loading
  runs] in ``_fsdp_runs.py``): DCP reads by overlap, so the checkpoint loads at any
  world size and into torch's FSDP1/``fully_shard``, and loads checkpoints of any
  layout (theirs: dimension-0 chunks). With the LOCAL state-dict type selected on the
  model, the flat shards themselves are saved (only loadable at the same world size,
  checked first);
* an optimizer over an fsdp model (either ``use_orig_params``): FQN-keyed state, as
  runs like the parameters, the same for both modes, so one loads into the other;
* a ZeroRedundancyOptimizer: each rank's own parameters' state, whole;
* a model with ``DTensor`` parameters (``fully_shard``, ours or torch's) and a plain
  optimizer over it: their own state, by name, through the same front end as
  ``ckpt.get_state_dict`` (``_dtensor_state.py``): the parameters' and the moments'
  ``DTensor`` shards as they are. torch's ``get_model_state_dict`` and
  ``get_optimizer_state_dict`` give the same, after checks and key conversions that
  took a quarter of an ``async_save``'s blocked time.

At save every adapter returns this rank's state by reference, without a collective;
at load, an optimizer that never stepped first creates its state (a step that changes
nothing, see ``init_optim_state``) so that there is a layout for DCP to fill.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from ckpt._dtensor_state import DTensorModels, has_dtensor_params
from ckpt._fsdp_model_state import RUNS_ATTR, LocalShardMismatchError
from ckpt._fsdp_optim_state import (
    fsdp_optim_runs,
    init_optim_state,
    load_fsdp_optim_state_dict,
)
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
        local = self._local(obj, ctx)
        with self._runs(obj, ctx, local):
            return obj.state_dict()

    def load_state_dict(
        self, obj: nn.Module, state_dict: dict[str, Any], ctx: StateContext
    ) -> None:
        local = self._local(obj, ctx)
        with self._runs(obj, ctx, local):
            obj.load_state_dict(state_dict)

    @contextlib.contextmanager
    def _runs(self, obj: nn.Module, ctx: StateContext, local: bool) -> Iterator[None]:
        """The state-dict type for ckpt, and on every instance which runs it handles:
        at save this rank's by reference, at load fresh buffers for DCP to fill
        ([Note: capture, then copy or write], [Note: loading runs])."""
        sd_type = StateDictType.SHARDED_STATE_DICT
        config: StateDictConfig = ShardedStateDictConfig(offload_to_cpu=ctx.loading)
        if local:
            sd_type, config = StateDictType.LOCAL_STATE_DICT, LocalStateDictConfig()
        instances = FullyShardedDataParallel.fsdp_modules(obj)
        for instance in instances:
            setattr(instance, RUNS_ATTR, "load" if ctx.loading else "save")
        try:
            with state_dict_type(obj, sd_type, config):
                yield
        finally:
            for instance in instances:
                delattr(instance, RUNS_ATTR)


def _optimizer_over(obj: object, ctx: StateContext, kind: Callable[[nn.Module], bool]) -> bool:
    """Whether ``obj`` is a plain torch.optim optimizer whose model is of ``kind``."""
    if not isinstance(obj, torch.optim.Optimizer) or isinstance(obj, ZeroRedundancyOptimizer):
        return False
    try:
        return kind(ctx.module_for(obj))
    except ValueError:  # no model beside it in ``state``
        return False


class FsdpOptimizerAdapter:
    """torch.optim optimizers over an fsdp model: FQN-keyed, as this rank's runs."""

    def applies_to(self, obj: object, ctx: StateContext) -> bool:
        return _optimizer_over(obj, ctx, has_fsdp)

    def state_dict(self, obj: torch.optim.Optimizer, ctx: StateContext) -> dict[str, Any]:
        # [Note: capture, then copy or write], [Note: loading runs]
        if ctx.loading:
            init_optim_state(obj)
        return fsdp_optim_runs(ctx.module_for(obj), obj, template=ctx.loading)

    def load_state_dict(
        self, obj: torch.optim.Optimizer, state_dict: dict[str, Any], ctx: StateContext
    ) -> None:
        model = ctx.module_for(obj)
        obj.load_state_dict(load_fsdp_optim_state_dict(model, obj, state_dict, runs=True))


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


_DTENSOR = DTensorModels()
_SHARDED = StateDictOptions(strict=True)


class DTensorModuleAdapter:
    """Models with ``DTensor`` parameters: their own state dict, by FQN."""

    def applies_to(self, obj: object, ctx: StateContext) -> bool:
        return isinstance(obj, nn.Module) and has_dtensor_params(obj)

    def state_dict(self, obj: nn.Module, ctx: StateContext) -> dict[str, Any]:
        return _DTENSOR.model_state_dict(obj, _SHARDED, None)  # by reference

    def load_state_dict(
        self, obj: nn.Module, state_dict: dict[str, Any], ctx: StateContext
    ) -> None:
        _DTENSOR.load_model_state_dict(obj, state_dict, _SHARDED)


class DTensorOptimizerAdapter:
    """torch.optim optimizers over a model with ``DTensor`` parameters, by FQN."""

    def applies_to(self, obj: object, ctx: StateContext) -> bool:
        return _optimizer_over(obj, ctx, has_dtensor_params)

    def state_dict(self, obj: torch.optim.Optimizer, ctx: StateContext) -> dict[str, Any]:
        if ctx.loading:
            init_optim_state(obj)
        return _DTENSOR.optimizer_state_dict(ctx.module_for(obj), obj, _SHARDED)

    def load_state_dict(
        self, obj: torch.optim.Optimizer, state_dict: dict[str, Any], ctx: StateContext
    ) -> None:
        _DTENSOR.load_optimizer_state_dict(ctx.module_for(obj), obj, state_dict, _SHARDED)


def register_builtin_adapters() -> None:
    """Register the fsdp, zero_optim and DTensor adapters (done once when ckpt is
    imported)."""
    register_adapter(DTensorModuleAdapter())
    register_adapter(DTensorOptimizerAdapter())
    register_adapter(FsdpModuleAdapter())
    register_adapter(FsdpOptimizerAdapter())
    register_adapter(ZeroOptimizerAdapter())
