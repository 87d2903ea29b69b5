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
from fsdp._common import clean_fqn
from fsdp._deferred_init import IGNORED, broadcast_module_states
from fsdp._device import default_cuda_device
from fsdp._flat_param_unit import FlatParamUnit, UnitConfig
from fsdp._process_groups import ProcessGroups
from fsdp.api import CPUOffload, MixedPrecision, ShardingStrategy

__all__ = [
    "SharedParameterError",
    "build_unit",
    "collect_unit_params",
    "install_optimizer_check",
    "normalize_device_id",
    "resolve_compute_device",
]

_MANAGED = "_fsdp_managed"  # set on every module whose parameters a unit took


def resolve_compute_device(
    params: list[nn.Parameter], buffers: list[torch.Tensor], device_id: object
) -> torch.device:
    """Where forward and backward run.

    ``device_id`` wins (see :func:`normalize_device_id`); else the device the
    parameters are on, where a CPU module moves to CUDA if there is CUDA, as
    torch's FSDP does; CPU otherwise. A CUDA device without an index is
    :func:`~fsdp._device.default_cuda_device` (``LOCAL_RANK`` under torchrun).
    """
    if device_id is not None:
        device = normalize_device_id(device_id)
        assert device is not None
        if device.type == "cuda" and getattr(device, "index", None) is None:
            return default_cuda_device()
        return device
    tensors = [*params, *buffers]
    if any(t.is_meta for t in tensors):  # materialize_unit ran before: a module hid them
        raise ValueError(
            "the module still has parameters or buffers on the meta device after deferred "
            "initialisation; materialise them in param_init_fn or reset_parameters()"
        )
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            "the module's parameters and buffers are on several devices "
            f"{sorted(map(str, devices))}; move the module to one device or pass device_id="
        )
    device = devices.pop() if devices else torch.device("cpu")
    if device.type == "cpu" and torch.cuda.is_available():
        return default_cuda_device()
    return device


def normalize_device_id(device_id: object) -> torch.device | None:
    """The constructor's ``device_id`` as a device: what torch's FSDP accepts, the same way.

    A ``torch.device``, a string (``"cpu"``, ``"cuda:1"``) or an int (a CUDA
    index), each through ``torch.device`` as torch's FSDP does, so a bad string
    raises torch's own ``RuntimeError``. An int without CUDA raises
    ``RuntimeError`` too (torch's type for it) with the fix.
    """
    if device_id is None or isinstance(device_id, torch.device):
        return device_id
    if isinstance(device_id, bool) or not isinstance(device_id, (int, str)):
        raise TypeError(
            f"device_id must be an int, a str or a torch.device, got {device_id!r} "
            f"({type(device_id).__name__}); e.g. device_id=torch.device('cpu')"
        )
    if isinstance(device_id, int):
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device_id={device_id} names a CUDA device but CUDA is not available; pass "
                "device_id=torch.device('cpu') (or 'cpu') or leave it None"
            )
        return torch.device("cuda", device_id)
    return torch.device(device_id)


def collect_unit_params(
    module: nn.Module,
    is_fsdp: Callable[[nn.Module], bool],
    ignored_params: frozenset[nn.Parameter] = frozenset(),
) -> tuple[list[ParamInfo], list[nn.Parameter], list[SharedParamInfo], list[nn.Module]]:
    """The parameters a unit wrapping ``module`` takes, in module order.

    Walks ``module``'s tree without entering nested FSDP instances (they
    manage their own) or ignored modules, and skips ignored parameters. A
    parameter reachable under several names (tied weights) is taken once; its
    other names become :class:`SharedParamInfo`. Returns ``(infos, params,
    shared_infos, modules visited)``.
    """
    infos: list[ParamInfo] = []
    params: list[nn.Parameter] = []
    shared: list[SharedParamInfo] = []
    visited: list[nn.Module] = []
    first: dict[int, tuple[str, nn.Module, str]] = {}  # id(param) -> (module name, module, name)

    # Pre-order, children in registration order; a loop, not a recursive closure, which would
    # be a reference cycle keeping ``params`` (the unsharded originals) alive until the next
    # garbage collection.
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        prefix, mod = stack.pop()
        if mod.__dict__.get(_MANAGED):
            raise ValueError(
                f"module {prefix.rstrip('.') or type(mod).__name__!r} ({type(mod).__name__}) "
                "is already managed by an FSDP instance: a module can be wrapped only once. "
                "Wrap inner modules first (or use auto_wrap_policy), then the outer one."
            )
        visited.append(mod)
        mod_name = prefix[:-1]
        for name, p in mod._parameters.items():
            if p is None or p in ignored_params:
                continue
            if getattr(p, "_fsdp_replaced", False) or getattr(p, "_fsdp_orig_param", False):
                raise SharedParameterError(mod, name, p, module)
            if id(p) in first:
                pm_name, pm, pn = first[id(p)]
                shared.append(SharedParamInfo(mod_name, pm_name, mod, name, pm, pn))
                continue
            first[id(p)] = (mod_name, mod, name)
            infos.append(ParamInfo(mod_name, mod, name))
            params.append(p)
        children = [
            (prefix + cname + ".", child)
            for cname, child in mod._modules.items()
            if child is not None and not is_fsdp(child) and not child.__dict__.get(IGNORED)
        ]
        stack.extend(reversed(children))
    return infos, params, shared, visited


_OWNER = "_fsdp_owner"  # on each flattened original: (weakref to its unit's wrapped module, name)


class SharedParameterError(ValueError):
    """A parameter shared between modules that ended up in different units.

    Raised while building the inner unit that meets the parameter second,
    where only that unit's subtree is known; the constructor that ran the
    auto-wrap re-raises it with both modules named by their paths in the
    whole model (:meth:`in_model`).
    """

    def __init__(self, holder: nn.Module, param_name: str, param: nn.Parameter, root: nn.Module):
        self.holder = holder
        self.param_name = param_name
        owner = param.__dict__.get(_OWNER)
        self.owner_module: nn.Module | None = owner[0]() if owner is not None else None
        self.owner_fqn: str = owner[1] if owner is not None else "?"
        super().__init__(self._message(root))

    def in_model(self, root: nn.Module) -> SharedParameterError:
        """The same error, its message naming the modules by their paths under ``root``."""
        self.args = (self._message(root),)
        return self

    def _message(self, root: nn.Module) -> str:
        names = {id(m): clean_fqn(n + ".").rstrip(".") for n, m in root.named_modules()}
        holder = names.get(id(self.holder), f"a {type(self.holder).__name__}")
        fqn = f"{holder}.{self.param_name}" if holder else self.param_name
        owner_type = type(self.owner_module).__name__
        unit_path = names.get(id(self.owner_module))
        if unit_path is None:
            unit, owner_fqn = f"another FSDP unit (wrapping a {owner_type})", self.owner_fqn
        else:
            unit = f"the FSDP unit {unit_path or '<root>'!r} ({owner_type})"
            owner_fqn = f"{unit_path}.{self.owner_fqn}" if unit_path else self.owner_fqn
        return (
            f"parameter {fqn!r} ({type(self.holder).__name__}) is the same tensor as "
            f"{owner_fqn!r}, which {unit} already flattened: a parameter shared between "
            "modules must be managed by one FSDP unit, else each unit would train its own "
            "copy. Wrap both modules in one unit: keep that unit out of the auto_wrap_policy "
            "so that a unit holding both modules takes the parameter, or wrap a common parent "
            "of the two modules"
        )


def owned_buffers(module: nn.Module, is_fsdp: Callable[[nn.Module], bool]) -> list[torch.Tensor]:
    """Buffers in ``module``'s tree outside nested FSDP instances and ignored modules."""
    out: list[torch.Tensor] = []
    stack = [module]
    while stack:
        m = stack.pop()
        out.extend(b for b in m._buffers.values() if b is not None)
        stack.extend(
            c
            for c in m._modules.values()
            if c is not None and not is_fsdp(c) and not c.__dict__.get(IGNORED)
        )
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
    groups: ProcessGroups,
    strategy: ShardingStrategy,
    compute_device: torch.device,
    mixed_precision: MixedPrecision,
    cpu_offload: CPUOffload,
    sync_module_states: bool = False,
    use_orig_params: bool = False,
) -> FlatParamUnit | None:
    """Flatten and shard the parameters :func:`collect_unit_params` found; ``None`` if none.

    Moves the owned parameters and buffers to the compute device first (the
    parameters stay on the CPU under ``CPUOffload(offload_params=True)``),
    where ``sync_module_states`` broadcasts the first rank's values (the
    backend's device is the compute device). ``strategy`` is the effective
    one: ``NO_SHARD`` when there is one rank to shard over, in which case
    gradients are all-reduced over the replicate group if hybrid sharding gave
    one (else over the one-rank group).
    """
    infos, params, shared, visited = collected
    buffers: list[torch.Tensor] = []
    for buf_owner in visited:
        for name, buf in buf_owner._buffers.items():
            if buf is not None and buf.device != compute_device:
                buf_owner._buffers[name] = buf.to(compute_device)
        buffers += [b for b in buf_owner._buffers.values() if b is not None]
    for m in visited:
        m.__dict__[_MANAGED] = True
    target = torch.device("cpu") if cpu_offload.offload_params else compute_device
    with torch.no_grad():
        for p in params:
            device = compute_device if sync_module_states else target
            if p.device != device:
                p.data = p.data.to(device)
        if sync_module_states:
            broadcast_module_states(params, buffers, groups)
            for p in params:
                if p.device != target:
                    p.data = p.data.to(target)
    if not params:
        return None
    _check_uniform(infos, params, use_orig_params)
    shard = strategy is not ShardingStrategy.NO_SHARD and groups.shard_size > 1
    group, rank, world_size = groups.shard_group, groups.shard_rank, groups.shard_size
    replicate_group, replicate_size = groups.replicate_group, groups.replicate_size
    if not shard and replicate_size > 1:  # hybrid over one-rank shard groups: plain DDP
        group, rank, world_size = replicate_group, dist.get_rank(replicate_group), replicate_size
        replicate_group, replicate_size = None, 1
    config = UnitConfig(
        group=group,
        rank=rank,
        world_size=world_size,
        shard=shard,
        reshard_after_forward=shard and strategy in _RESHARD_AFTER_FORWARD,
        compute_device=compute_device,
        param_dtype=mixed_precision.param_dtype,
        reduce_dtype=mixed_precision.reduce_dtype,
        keep_low_precision_grads=mixed_precision.keep_low_precision_grads,
        offload_params=cpu_offload.offload_params,
        replicate_group=replicate_group if replicate_size > 1 else None,
        replicate_size=replicate_size,
        use_orig_params=use_orig_params,
    )
    unit = FlatParamUnit(infos, params, shared, config)
    owner = weakref.ref(visited[0])
    for info, p in zip(infos, params, strict=True):
        name = f"{info.module_name}.{info.param_name}" if info.module_name else info.param_name
        p.__dict__[_OWNER] = (owner, name)
    return unit


_RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


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
