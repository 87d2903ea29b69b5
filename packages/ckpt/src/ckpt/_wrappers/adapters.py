"""How the objects in a checkpoint's ``state`` become DCP state dicts and back.

``ckpt.save(state, path)`` takes a dict like DCP's: each value is a tensor, a plain
object (saved pickled), or a stateful object. Stateful objects go through a
:class:`StateAdapter` chosen from a registry, newest registration first:

* ``nn.Module`` (plain, DDP, torch's FSDP/``fully_shard``): DCP's
  ``get_model_state_dict``/``set_model_state_dict``, so keys are parameter FQNs without
  wrapper prefixes (a DDP checkpoint loads into a plain model and back).
* ``torch.optim.Optimizer``: DCP's ``get_optimizer_state_dict``/
  ``set_optimizer_state_dict`` against the model in ``state`` that owns its
  parameters, so optimizer state is keyed by parameter FQN too.
* anything else with ``state_dict()``/``load_state_dict()`` (DCP's ``Stateful``
  protocol: LR schedulers, data loaders, user objects): those two methods.

[Note: the adapter protocol]
An adapter's ``state_dict(obj, ctx)`` returns a nested dict whose leaves are
``torch.Tensor`` (replicated, or unique to this rank under rank-unique keys),
``DTensor`` (sharded on a ``DeviceMesh``; DCP saves each shard once and reshards on
load) or plain picklable objects. DCP writes it as is. On load the same call provides
the template DCP fills in place (tensors must already have their final global shapes
and dtypes), and ``load_state_dict(obj, filled, ctx)`` then applies it. Keys must be
stable across world sizes and wrappers (parameter FQNs), values under the same key on
several ranks must be equal (DCP keeps one copy), and both calls run on every rank in
the same order (they may use collectives). At load, ``ctx.manifest`` tells the
adapter what was saved (e.g. ``world_size``, for a layout that only loads at the world
size that wrote it). This is how ``fsdp`` models and
``zero_optim`` optimizers plug in: an adapter whose ``applies_to`` recognises them,
registered with :func:`register_adapter`.

The built-in adapters, registered by :func:`register_builtin_adapters` at import:

* an fsdp model is saved and loaded as the runs of each original parameter that its
  rank's flat shards hold ([Note: capture, then copy or write] and [Note: loading
  runs] in ``_wrappers/fsdp1_runs.py``): DCP reads by overlap, so the checkpoint loads at any
  world size and into torch's FSDP1/``fully_shard``, and loads checkpoints of any
  layout (theirs: dimension-0 chunks). With the LOCAL state-dict type selected on the
  model, the flat shards themselves are saved (only loadable at the same world size,
  checked first);
* an optimizer over an fsdp model (either ``use_orig_params``): FQN-keyed state, as
  runs like the parameters, the same for both modes, so one loads into the other;
* a ZeroRedundancyOptimizer: each rank's own parameters' state, whole;
* a model with ``DTensor`` parameters (``fully_shard``, ours or torch's) and a plain
  optimizer over it: their own state, by name, through the same front end as
  ``ckpt.get_state_dict`` (``_wrappers/fully_shard.py``): the parameters' and the moments'
  ``DTensor`` shards as they are. torch's ``get_model_state_dict`` and
  ``get_optimizer_state_dict`` give the same, after checks and key conversions that
  took a quarter of an ``async_save``'s blocked time.

At save every adapter returns this rank's state by reference, without a collective;
at load, an optimizer that never stepped first creates its state (a step that changes
nothing, see ``init_optim_state``) so that there is a layout for DCP to fill.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from ckpt._format.manifest import Manifest
from ckpt._wrappers.fqns import state_by_fqn
from ckpt._wrappers.fsdp1_model import RUNS_ATTR, LocalShardMismatchError
from ckpt._wrappers.fsdp1_optim import (
    fsdp_optim_runs,
    init_optim_state,
    load_fsdp_optim_state_dict,
)
from ckpt._wrappers.fsdp1_state_dict_type import get_state_dict_type, state_dict_type
from ckpt._wrappers.fully_shard import DTensorModels, has_dtensor_params
from ckpt._wrappers.optim_state import has_fsdp
from ckpt._wrappers.zero import load_zero_optim_state_dict, zero_optim_state_dict
from fsdp import FullyShardedDataParallel
from fsdp.api import (
    LocalStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictType,
)
from zero_optim import ZeroRedundancyOptimizer

__all__ = [
    "StateAdapter",
    "StateContext",
    "Stateful",
    "apply_loaded",
    "register_adapter",
    "register_builtin_adapters",
    "to_state_dict",
]


@dataclass(frozen=True)
class StateContext:
    """What an adapter may need beyond its own object: the rest of the ``state``."""

    state: Mapping[str, Any]  # the user's whole state dict, as passed to save/load
    process_group: dist.ProcessGroup | None  # the group the checkpoint is saved/loaded on
    # On load, the manifest of the checkpoint being read (its world_size, files); None
    # at save, and for a plain DCP directory loaded with verify=False.
    manifest: Manifest | None = None
    # True when the state dict is the template a load fills (an optimizer that never
    # stepped must then create its state tensors first); False at save.
    loading: bool = False
    _owners: dict[int, nn.Module] = field(default_factory=dict, compare=False, repr=False)

    def module_for(self, optimizer: torch.optim.Optimizer) -> nn.Module:
        """The module in ``state`` whose parameters include all of ``optimizer``'s.

        Optimizer state is keyed by parameter names, which only a module knows. The
        first module (in ``state``'s order) that owns every parameter of the optimizer
        is used.
        """
        cached = self._owners.get(id(optimizer))
        if cached is not None:
            return cached
        wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for value in self.state.values():
            if isinstance(value, nn.Module):
                owned = {id(p) for p in value.parameters()}
                if wanted <= owned:
                    self._owners[id(optimizer)] = value
                    return value
        raise ValueError(
            f"no nn.Module in the checkpoint state owns all parameters of the "
            f"{type(optimizer).__name__} optimizer, so its state cannot be keyed by "
            f"parameter names; put the model beside it, e.g. "
            f"{{'model': model, 'optim': optimizer}}"
        )


class StateAdapter(Protocol):
    """Saves and restores one kind of object; see [Note: the adapter protocol]."""

    def applies_to(self, obj: object, ctx: StateContext) -> bool:
        """Whether this adapter handles ``obj`` (checked newest registration first)."""
        ...

    def state_dict(self, obj: Any, ctx: StateContext) -> dict[str, Any]:
        """``obj``'s state for DCP; on load, the template DCP fills in place."""
        ...

    def load_state_dict(self, obj: Any, state_dict: dict[str, Any], ctx: StateContext) -> None:
        """Apply the filled template to ``obj``."""
        ...


class _ModuleAdapter:
    """Plain, DDP and torch-FSDP modules through DCP's state-dict helpers."""

    def applies_to(self, obj: object, ctx: StateContext) -> bool:
        return isinstance(obj, nn.Module)

    def state_dict(self, obj: nn.Module, ctx: StateContext) -> dict[str, Any]:
        return get_model_state_dict(obj)

    def load_state_dict(
        self, obj: nn.Module, state_dict: dict[str, Any], ctx: StateContext
    ) -> None:
        set_model_state_dict(obj, state_dict, options=StateDictOptions(strict=True))


class _OptimizerAdapter:
    """torch.optim optimizers keyed by the FQNs of the module that owns the parameters.

    DCP's helper initialises the state of an optimizer that has not stepped yet (one
    step with zero gradients and zero learning rate) so a fresh optimizer has tensors
    of the right shapes for the load to fill.
    """

    def applies_to(self, obj: object, ctx: StateContext) -> bool:
        return isinstance(obj, torch.optim.Optimizer)

    def state_dict(self, obj: torch.optim.Optimizer, ctx: StateContext) -> dict[str, Any]:
        return dict(get_optimizer_state_dict(ctx.module_for(obj), obj))

    def load_state_dict(
        self, obj: torch.optim.Optimizer, state_dict: dict[str, Any], ctx: StateContext
    ) -> None:
        set_optimizer_state_dict(ctx.module_for(obj), obj, state_dict)


class _StatefulAdapter:
    """Any object with ``state_dict()``/``load_state_dict()`` (DCP's Stateful)."""

    def applies_to(self, obj: object, ctx: StateContext) -> bool:
        return isinstance(obj, Stateful)

    def state_dict(self, obj: Stateful, ctx: StateContext) -> dict[str, Any]:
        return obj.state_dict()

    def load_state_dict(self, obj: Stateful, state_dict: dict[str, Any], ctx: StateContext) -> None:
        obj.load_state_dict(state_dict)


_registry: list[StateAdapter] = [_ModuleAdapter(), _OptimizerAdapter(), _StatefulAdapter()]
_registry_lock = threading.Lock()


def register_adapter(adapter: StateAdapter) -> None:
    """Teach ckpt to save and load a new kind of object (e.g. a sharded wrapper).

    Registered adapters are consulted before the built-in ones, newest first, so a
    wrapper class can take over from the generic ``nn.Module`` or optimizer handling.
    """
    for name in ("applies_to", "state_dict", "load_state_dict"):
        if not callable(getattr(adapter, name, None)):
            raise TypeError(
                f"{type(adapter).__name__} is not a StateAdapter: it has no method {name}()"
            )
    with _registry_lock:
        _registry.insert(0, adapter)


def adapter_for(obj: object, ctx: StateContext) -> StateAdapter | None:
    """The adapter that handles ``obj``; None for tensors, plain objects, containers."""
    if isinstance(obj, (torch.Tensor, Mapping, list, tuple, str, bytes, int, float, bool)):
        return None
    with _registry_lock:
        adapters = list(_registry)
    for adapter in adapters:
        if adapter.applies_to(obj, ctx):
            return adapter
    return None


def _check_keys(state: Mapping[str, Any]) -> None:
    if not isinstance(state, Mapping):
        raise TypeError(
            f"state must be a dict of name -> model/optimizer/tensor/object, got "
            f"{type(state).__name__}; e.g. {{'model': model, 'optim': optimizer}}"
        )
    for key in state:
        if not isinstance(key, str) or not key:
            raise TypeError(f"state keys must be non-empty strings, got {key!r}")


def to_state_dict(
    state: Mapping[str, Any],
    process_group: dist.ProcessGroup | None,
    manifest: Manifest | None = None,
    loading: bool = False,
) -> tuple[dict[str, Any], StateContext]:
    """The DCP state dict for ``state``: stateful values replaced by their state dicts."""
    _check_keys(state)
    ctx = StateContext(state=state, process_group=process_group, manifest=manifest, loading=loading)
    out: dict[str, Any] = {}
    for key, value in state.items():
        adapter = adapter_for(value, ctx)
        out[key] = value if adapter is None else adapter.state_dict(value, ctx)
    return out, ctx


def apply_loaded(state: Mapping[str, Any], loaded: Mapping[str, Any], ctx: StateContext) -> None:
    """Hand what DCP loaded back: stateful values load it, plain values are replaced.

    Tensors were filled in place by DCP; plain objects come back as new objects, which
    replace the old ones in ``state`` (as DCP's own ``load`` does).
    """
    for key, value in state.items():
        adapter = adapter_for(value, ctx)
        if adapter is not None:
            adapter.load_state_dict(value, loaded[key], ctx)
        elif isinstance(state, MutableMapping):
            state[key] = loaded[key]


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


def _no_frozen(prefix: str) -> set[str]:
    return set()  # _SHARDED keeps frozen parameters


class DTensorModuleAdapter:
    """Models with ``DTensor`` parameters: their own state dict, by FQN."""

    def applies_to(self, obj: object, ctx: StateContext) -> bool:
        return isinstance(obj, nn.Module) and has_dtensor_params(obj)

    def state_dict(self, obj: nn.Module, ctx: StateContext) -> dict[str, Any]:
        if ctx.loading:
            return _DTENSOR.model_state_dict(obj, _SHARDED, None)
        # A save only reads the shards' memory ([Note: capture, then copy or write]):
        # the parameters themselves, by reference, without a detached alias of each.
        return state_by_fqn(obj, _SHARDED, None, _no_frozen, keep_vars=True)

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
