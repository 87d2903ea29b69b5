"""Constructor work: check the arguments, find the process group and device,
collect a unit's parameters and build its FlatParamUnit.

Each function takes what it needs and returns what it found; the constructor
in ``fully_sharded_data_parallel.py`` calls them in order and keeps the
results. Nothing here runs after construction.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatparam import ParamInfo, SharedParamInfo
from fsdp._flat_param_unit import FlatParamUnit, UnitConfig
from fsdp.api import CPUOffload, MixedPrecision, ShardingStrategy

__all__ = [
    "build_unit",
    "check_unimplemented",
    "collect_unit_params",
    "install_optimizer_check",
    "resolve_compute_device",
    "resolve_process_group",
]

_MANAGED = "_fsdp_managed"  # set on every module whose parameters a unit took


def check_unimplemented(
    *,
    sharding_strategy: ShardingStrategy,
    process_group: object,
    use_orig_params: bool,
    param_init_fn: object,
    sync_module_states: bool,
    ignored_modules: object,
    ignored_states: object,
    device_mesh: object,
) -> None:
    """Refuse, by name, the constructor features that later fsdp issues add.

    Each would otherwise change what a unit holds; ignoring one silently would
    train a different model than the user asked for.
    """
    todo = (
        "is not implemented yet (fsdp issue 3: original parameters, hybrid sharding, deferred init)"
    )
    if sharding_strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        raise NotImplementedError(
            f"sharding_strategy={sharding_strategy} (hybrid sharding) {todo}; use FULL_SHARD "
            "or SHARD_GRAD_OP"
        )
    if isinstance(process_group, tuple):
        raise NotImplementedError(
            f"a (shard, replicate) process_group pair (hybrid sharding) {todo}; pass one group"
        )
    if device_mesh is not None:
        raise NotImplementedError(f"device_mesh= {todo}; pass process_group= instead")
    if param_init_fn is not None:
        raise NotImplementedError(
            f"param_init_fn= (meta-device deferred initialisation) {todo}; build the module "
            "on a real device first"
        )
    if sync_module_states:
        raise NotImplementedError(
            f"sync_module_states=True {todo}; broadcast the parameters before wrapping "
            "(e.g. dist.broadcast(p.data, src=0) for each parameter)"
        )
    if ignored_modules is not None:
        raise NotImplementedError(f"ignored_modules= {todo}")
    if ignored_states is not None:
        raise NotImplementedError(f"ignored_states= {todo}")


def resolve_process_group(process_group: Any) -> tuple[Any, int, int]:
    """``(group, rank in group, world size)``; the default group when ``None``."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "FullyShardedDataParallel needs torch.distributed initialised: call "
            "torch.distributed.init_process_group(backend) first (gloo on CPU, nccl on GPU), "
            "even for a single process (world_size=1)"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            "this process is not a member of the process_group passed to FullyShardedDataParallel; "
            "every rank that wraps the model must belong to the group"
        )
    return group, rank, dist.get_world_size(group)


def resolve_compute_device(
    params: list[nn.Parameter], buffers: list[torch.Tensor], device_id: object
) -> torch.device:
    """Where forward and backward run.

    ``device_id`` wins (an int means ``cuda:<int>``); else the device the
    parameters are on, where a CPU module moves to the current CUDA device if
    there is one, as torch's FSDP does; CPU otherwise.
    """
    if device_id is not None:
        if isinstance(device_id, int):
            if not torch.cuda.is_available():
                raise ValueError(
                    f"device_id={device_id} names a CUDA device but CUDA is not available; pass "
                    "device_id=torch.device('cpu') or leave it None"
                )
            return torch.device("cuda", device_id)
        if not isinstance(device_id, torch.device):
            raise TypeError(f"device_id must be an int or a torch.device, got {device_id!r}")
        if device_id.type == "cuda" and getattr(device_id, "index", None) is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device_id
    tensors = [*params, *buffers]
    meta = [t for t in tensors if t.is_meta]
    if meta:
        raise NotImplementedError(
            "the module has parameters or buffers on the meta device; deferred initialisation "
            "is not implemented yet (fsdp issue 3). Materialise it first, e.g. "
            "module.to_empty(device=...) followed by its reset_parameters()"
        )
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            "the module's parameters and buffers are on several devices "
            f"{sorted(map(str, devices))}; move the module to one device or pass device_id="
        )
    device = devices.pop() if devices else torch.device("cpu")
    if device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def collect_unit_params(
    module: nn.Module, is_fsdp: Callable[[nn.Module], bool]
) -> tuple[list[ParamInfo], list[nn.Parameter], list[SharedParamInfo], list[nn.Module]]:
    """The parameters a unit wrapping ``module`` takes, in module order.

    Walks ``module``'s tree without entering nested FSDP instances (they
    manage their own). A parameter reachable under several names (tied
    weights) is taken once; its other names become :class:`SharedParamInfo`.
    Returns ``(infos, params, shared_infos, modules visited)``.
    """
    infos: list[ParamInfo] = []
    params: list[nn.Parameter] = []
    shared: list[SharedParamInfo] = []
    visited: list[nn.Module] = []
    first: dict[int, tuple[str, nn.Module, str]] = {}  # id(param) -> (module name, module, name)

    def visit(prefix: str, mod: nn.Module) -> None:
        if mod.__dict__.get(_MANAGED):
            raise ValueError(
                f"module {prefix.rstrip('.') or type(mod).__name__!r} ({type(mod).__name__}) "
                "is already managed by an FSDP instance: a module can be wrapped only once. "
                "Wrap inner modules first (or use auto_wrap_policy), then the outer one."
            )
        visited.append(mod)
        mod_name = prefix[:-1]
        for name, p in mod._parameters.items():
            if p is None:
                continue
            fqn = prefix + name
            if getattr(p, "_fsdp_replaced", False) or getattr(p, "_fsdp_orig_param", False):
                raise ValueError(
                    f"parameter {fqn!r} is already flattened into another FSDP unit: it is shared "
                    "between modules that ended up in different units. Wrap all modules that "
                    "share a parameter in one unit (e.g. tie weights inside one wrapped block, "
                    "or leave the tied modules to the root unit)."
                )
            if id(p) in first:
                pm_name, pm, pn = first[id(p)]
                shared.append(SharedParamInfo(mod_name, pm_name, mod, name, pm, pn))
                continue
            first[id(p)] = (mod_name, mod, name)
            infos.append(ParamInfo(mod_name, mod, name))
            params.append(p)
        for cname, child in mod._modules.items():
            if child is not None and not is_fsdp(child):
                visit(prefix + cname + ".", child)

    visit("", module)
    return infos, params, shared, visited


def owned_buffers(module: nn.Module, is_fsdp: Callable[[nn.Module], bool]) -> list[torch.Tensor]:
    """Buffers in ``module``'s tree outside nested FSDP instances."""
    out: list[torch.Tensor] = []
    stack = [module]
    while stack:
        m = stack.pop()
        out.extend(b for b in m._buffers.values() if b is not None)
        stack.extend(c for c in m._modules.values() if c is not None and not is_fsdp(c))
    return out


def _check_uniform(
    infos: list[ParamInfo], params: list[nn.Parameter], use_orig_params: bool = False
) -> None:
    names = [f"{i.module_name}.{i.param_name}" if i.module_name else i.param_name for i in infos]
    dtypes: dict[torch.dtype, list[str]] = {}
    for n, p in zip(names, params, strict=True):
        dtypes.setdefault(p.dtype, []).append(n)
    if len(dtypes) > 1:
        listing = "; ".join(f"{d}: {', '.join(ns[:6])}" for d, ns in dtypes.items())
        raise ValueError(
            "FSDP flattens a unit's parameters into one tensor, so they must share one dtype, "
            f"but this unit mixes {listing}. Cast the module to one dtype (module.to(dtype)) or "
            "wrap the differing submodule in its own FSDP unit; for low-precision compute use "
            "mixed_precision=MixedPrecision(param_dtype=...)"
        )
    if use_orig_params:
        return  # frozen and trainable parameters may share a unit (see FlatParamUnit)
    grads: dict[bool, list[str]] = {}
    for n, p in zip(names, params, strict=True):
        grads.setdefault(p.requires_grad, []).append(n)
    if len(grads) > 1:
        raise ValueError(
            "with use_orig_params=False an FSDP unit's parameters must be all trainable or all "
            f"frozen, but requires_grad=True for {', '.join(grads[True][:6])} and False for "
            f"{', '.join(grads[False][:6])}. Wrap the frozen submodules in their own units, or "
            "pass use_orig_params=True (which allows the mix)."
        )


def build_unit(
    collected: tuple[list[ParamInfo], list[nn.Parameter], list[SharedParamInfo], list[nn.Module]],
    *,
    group: Any,
    rank: int,
    world_size: int,
    strategy: ShardingStrategy,
    compute_device: torch.device,
    mixed_precision: MixedPrecision,
    cpu_offload: CPUOffload,
    use_orig_params: bool = False,
) -> FlatParamUnit | None:
    """Flatten and shard the parameters :func:`collect_unit_params` found; ``None`` if none.

    Moves the owned parameters and buffers to the compute device first (the
    parameters stay on the CPU under ``CPUOffload(offload_params=True)``).
    """
    infos, params, shared, visited = collected
    for buf_owner in visited:
        for name, buf in buf_owner._buffers.items():
            if buf is not None and buf.device != compute_device:
                buf_owner._buffers[name] = buf.to(compute_device)
    for m in visited:
        m.__dict__[_MANAGED] = True
    if not params:
        return None
    _check_uniform(infos, params, use_orig_params)
    target = torch.device("cpu") if cpu_offload.offload_params else compute_device
    with torch.no_grad():
        for p in params:
            if p.device != target:
                p.data = p.data.to(target)
    shard = strategy is not ShardingStrategy.NO_SHARD and world_size > 1
    config = UnitConfig(
        group=group,
        rank=rank,
        world_size=world_size,
        shard=shard,
        reshard_after_forward=shard and strategy is ShardingStrategy.FULL_SHARD,
        compute_device=compute_device,
        param_dtype=mixed_precision.param_dtype,
        reduce_dtype=mixed_precision.reduce_dtype,
        keep_low_precision_grads=mixed_precision.keep_low_precision_grads,
        offload_params=cpu_offload.offload_params,
        use_orig_params=use_orig_params,
    )
    return FlatParamUnit(infos, params, shared, config)


# --- "optimizer created before wrapping" ------------------------------------------------------

_checked_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_hook_handles: list[Any] = []  # the one global hook's handle once installed


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _checked_optimizers:
        return
    stale = [
        tuple(p.shape)
        for group in optimizer.param_groups
        for p in group["params"]
        if getattr(p, "_fsdp_replaced", False)
    ]
    if stale:
        raise RuntimeError(
            f"{type(optimizer).__name__} holds {len(stale)} parameter(s) (shapes {stale[:4]}) "
            "that FullyShardedDataParallel replaced by its flat parameters: the optimizer was "
            "created before the model was wrapped and would never see a gradient. Create it "
            "after wrapping: optim = torch.optim.AdamW(fsdp_model.parameters(), ...)"
        )
    _checked_optimizers.add(optimizer)


def install_optimizer_check() -> None:
    """Make any optimizer step fail clearly if it holds parameters FSDP replaced.

    Installed once per process at the first FSDP construction, as a global
    optimizer step pre-hook; each optimizer is checked at its first step only.
    """
    if _hook_handles:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        _check_optimizer(optimizer, args, kwargs)

    _hook_handles.append(register_optimizer_step_pre_hook(hook))
