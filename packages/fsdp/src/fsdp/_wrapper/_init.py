"""Constructor work: check the arguments, find the process group and device,
collect a unit's parameters and build its FlatParamUnit.

Each function takes what it needs and returns what it found; the constructor
in ``fully_sharded_data_parallel.py`` calls them in order and keeps the
results. Nothing here runs after construction.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatparam import ParamInfo, SharedParamInfo
from fsdp._runtime._common import clean_fqn
from fsdp._runtime._device import default_cuda_device
from fsdp._runtime._quantize import QuantizedCommPolicy
from fsdp._wrapper._deferred_init import IGNORED, TIED, broadcast_module_states
from fsdp._wrapper._flat_param_unit import FlatParamUnit, UnitConfig
from fsdp._wrapper._process_groups import ProcessGroups
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
_TIED = TIED  # on a parameter used at several places: its TiedUse (wrap time only)
_SHARED_MODULE = "_fsdp_shared_module"  # on a module at several places (wrap time only)

_log = logging.getLogger("fsdp")
_marked: list[nn.Parameter] = []  # parameters marked now (an auto-wrap with ties is running)


@dataclass(frozen=True)
class TiedUse:
    """Where one parameter is used in the model being wrapped (see [Note: tied parameters]).

    ``paths`` holds one ``"<module path>.<name>"`` per use, in the unwrapped model's
    names; ``module_paths`` maps ``id(module)`` to every path of that module in the
    model (a module shared by two blocks has two), for the modules of the whole tree.
    """

    paths: tuple[str, ...]
    module_paths: dict[int, list[str]]
    sites: tuple[tuple[nn.Module, str], ...]  # (module, attribute name) of each use

    def all_under(self, module: nn.Module) -> bool:
        """Whether every use lies inside ``module``'s subtree (at one of its paths)."""
        for base in self.module_paths.get(id(module), []):
            prefix = base + "." if base else ""
            if all(p.startswith(prefix) for p in self.paths):
                return True
        return False


def mark_tied_params(
    root: nn.Module,
    is_fsdp: Callable[[nn.Module], bool],
    ignored_params: frozenset[nn.Parameter] = frozenset(),
) -> list[nn.Parameter]:
    """Mark every parameter that ``root`` uses at more than one place; return them.

    [Note: tied parameters]
    A parameter reachable under several names (an embedding tied to the LM head,
    a Linear shared by two blocks) belongs to the innermost unit whose module
    contains all of its uses, whichever units the auto-wrap policy makes. The
    marks let the units, built bottom-up, decide that: a unit that meets a marked
    parameter some of whose uses lie outside its subtree leaves it alone
    (:func:`collect_unit_params`), and the first unit that contains them all
    takes it, reaching into nested units' modules for the uses there. Its gathered
    views are then installed on modules of inner units too; that works because a
    unit's forward runs inside every enclosing unit's forward, and its backward
    after the enclosing unit's pre-backward, so the owner is gathered whenever
    an inner unit computes with the parameter, and the parameter's gradient from
    every use is summed before the owner's post-backward hook runs. The marks
    are removed when the root unit is built (:func:`clear_tied_marks`).
    """
    uses: dict[int, list[str]] = {}
    sites: dict[int, list[tuple[nn.Module, str]]] = {}
    by_id: dict[int, nn.Parameter] = {}
    module_paths: dict[int, list[str]] = {}
    for path, mod in root.named_modules(remove_duplicate=False):
        clean = clean_fqn(path + ".").rstrip(".") if path else ""
        if is_fsdp(mod):
            continue  # an FSDP wrapper has no parameters of its own; its module is below
        module_paths.setdefault(id(mod), [])
        if clean not in module_paths[id(mod)]:
            module_paths[id(mod)].append(clean)
        for name, p in mod._parameters.items():
            if p is None or p in ignored_params:
                continue
            full = f"{clean}.{name}" if clean else name
            if full not in uses.setdefault(id(p), []):
                uses[id(p)].append(full)
            if not any(m is mod and n == name for m, n in sites.setdefault(id(p), [])):
                sites[id(p)].append((mod, name))
            by_id[id(p)] = p
    marked = []
    for pid, paths in uses.items():
        if len(paths) > 1:
            p = by_id[pid]
            p.__dict__[_TIED] = TiedUse(tuple(paths), module_paths, tuple(sites[pid]))
            marked.append(p)
    for mod in root.modules():
        if len(module_paths.get(id(mod), [])) > 1:
            mod.__dict__[_SHARED_MODULE] = True  # several units may walk it
    _marked.extend(marked)
    return marked


def clear_tied_marks(root: nn.Module, params: list[nn.Parameter]) -> None:
    """Remove the marks :func:`mark_tied_params` set (wrapping is over)."""
    for p in params:
        p.__dict__.pop(_TIED, None)
    _marked[:] = [p for p in _marked if _TIED in p.__dict__]
    for mod in root.modules():
        mod.__dict__.pop(_SHARED_MODULE, None)


class _MultiDeviceError(ValueError, RuntimeError):
    """A module on several devices: torch's FSDP raises ``RuntimeError``, ours raised
    ``ValueError``; both catch it."""


def resolve_compute_device(
    params: list[nn.Parameter], buffers: list[torch.Tensor], device_id: object
) -> torch.device:
    """Where forward and backward run.

    ``device_id`` wins (see :func:`normalize_device_id`); else the device the
    parameters are on, where a CPU module moves to CUDA if there is CUDA, as
    torch's FSDP does; CPU otherwise. A CUDA device without an index is
    :func:`~fsdp._runtime._device.default_cuda_device` (``LOCAL_RANK`` under torchrun).
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
        raise _MultiDeviceError(
            f"FSDP only supports single device modules but got params on {devices}: the "
            f"module's parameters and buffers are on {sorted(map(str, devices))}; move the "
            "module to one device or pass device_id="
        )
    device = devices.pop() if devices else torch.device("cpu")
    if device.type == "cpu" and torch.cuda.is_available():
        return default_cuda_device()
    return device


def normalize_device_id(device_id: object) -> torch.device | None:
    """The constructor's ``device_id`` as a device: what torch's FSDP accepts, the same way.

    A ``torch.device``, a string (``"cpu"``, ``"cuda:1"``) or an int (a CUDA
    index), each through ``torch.device`` as torch's FSDP does, so a bad string
    raises torch's own ``RuntimeError``. A CUDA device without CUDA raises
    :class:`CudaUnavailableError` (a subclass of each type torch raises for it).
    """
    if device_id is None:
        return None
    if isinstance(device_id, bool) or not isinstance(device_id, (int, str, torch.device)):
        raise TypeError(
            f"device_id must be an int, a str or a torch.device, got {device_id!r} "
            f"({type(device_id).__name__}); e.g. device_id=torch.device('cpu')"
        )
    device = (
        torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CudaUnavailableError(
            f"device_id={device_id!r} names a CUDA device but CUDA is not available; pass "
            "device_id=torch.device('cpu') (or 'cpu') or leave it None"
        )
    return device


class CudaUnavailableError(RuntimeError, ValueError, AssertionError):
    """A CUDA ``device_id`` on a machine without CUDA.

    torch's FSDP raises ``RuntimeError`` for an int and ``AssertionError`` (from
    CUDA's lazy init) for a ``torch.device``; code catching either keeps
    working, and ``ValueError`` says what it is: a bad argument.
    """


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
    seen_modules: set[int] = set()
    while stack:
        prefix, mod = stack.pop()
        if id(mod) in seen_modules:
            continue  # a module used twice inside this unit (its parameters are tied)
        seen_modules.add(id(mod))
        if mod.__dict__.get(_MANAGED) and not mod.__dict__.get(_SHARED_MODULE):
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
            tied: TiedUse | None = p.__dict__.get(_TIED)
            if tied is not None and not tied.all_under(module):
                continue  # some uses lie outside this unit: an outer unit takes it
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
    _adopt_tied(module, is_fsdp, first=first, infos=infos, params=params, shared=shared)
    return infos, params, shared, visited


def _adopt_tied(
    module: nn.Module,
    is_fsdp: Callable[[nn.Module], bool],
    *,
    first: dict[int, tuple[str, nn.Module, str]],
    infos: list[ParamInfo],
    params: list[nn.Parameter],
    shared: list[SharedParamInfo],
) -> None:
    """Take the tied parameters whose uses all lie in ``module`` but some in nested units.

    See [Note: tied parameters]: this unit is the innermost that contains every
    use, so it reaches into the nested units' modules for them.
    """
    if not _marked:
        return  # no tied parameters being wrapped: nothing to reach for
    names: dict[tuple[int, str], str] = {}
    found: list[tuple[str, nn.Module, str, nn.Parameter]] = []
    for path, mod in module.named_modules(remove_duplicate=False):
        if is_fsdp(mod):
            continue
        for name, p in mod._parameters.items():
            if p is None or _TIED not in p.__dict__ or not p.__dict__[_TIED].all_under(module):
                continue
            if getattr(p, "_fsdp_replaced", False) or getattr(p, "_fsdp_orig_param", False):
                continue
            key = (id(mod), name)
            if key in names:
                continue
            names[key] = clean_fqn(path + ".").rstrip(".") if path else ""
            found.append((names[key], mod, name, p))
    taken = {(id(i.module), i.param_name) for i in infos}
    taken.update((id(s.module), s.param_name) for s in shared)
    crossing: dict[int, list[str]] = {}
    for mod_name, mod, name, p in found:
        if (id(mod), name) in taken:
            continue
        full = f"{mod_name}.{name}" if mod_name else name
        crossing.setdefault(id(p), []).append(full)
        if id(p) in first:
            pm_name, pm, pn = first[id(p)]
            shared.append(SharedParamInfo(mod_name, pm_name, mod, name, pm, pn))
        else:
            first[id(p)] = (mod_name, mod, name)
            infos.append(ParamInfo(mod_name, mod, name))
            params.append(p)
    for pid in crossing:
        tied = next(p for _, _, _, p in found if id(p) == pid).__dict__[_TIED]
        unit_path = tied.module_paths.get(id(module), ["?"])[0]
        _log.info(
            "fsdp: parameter %r (also %s) is used in several FSDP units; it belongs to the "
            "unit %r (%s), the innermost one that contains all its uses",
            tied.paths[0],
            ", ".join(repr(t) for t in tied.paths[1:]),
            unit_path or "<root>",
            type(module).__name__,
        )


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
            "copy, and that unit was built (by hand) before the one holding this use, so it "
            "could not know of it. Wrap both modules in one unit: build the units with "
            "auto_wrap_policy on the root (which gives a tied parameter to the innermost unit "
            "containing all its uses), or wrap a common parent of the two modules"
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


def _check_uniform(infos: list[ParamInfo], params: list[nn.Parameter]) -> None:
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
    comm_policy: QuantizedCommPolicy | None = None,
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
    _check_uniform(infos, params)  # frozen and trainable may mix: [Note: frozen part]
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
        comm_policy=comm_policy,
        across=groups.across if shard else None,
    )
    unit = _build_parts(infos, params, shared, config)
    owner = weakref.ref(visited[0])
    for info, p in zip(infos, params, strict=True):
        name = f"{info.module_name}.{info.param_name}" if info.module_name else info.param_name
        p.__dict__[_OWNER] = (owner, name)
    return unit


def _build_parts(
    infos: list[ParamInfo],
    params: list[nn.Parameter],
    shared: list[SharedParamInfo],
    config: UnitConfig,
) -> FlatParamUnit:
    """One FlatParamUnit, or a trainable one with a frozen part (see [Note: frozen part]).

    Each parameter's tied aliases go with it into the part that holds it.
    """
    trainable = [p.requires_grad for p in params]
    if all(trainable) or not any(trainable):
        return FlatParamUnit(infos, params, shared, config)
    grad_of = {
        (id(i.module), i.param_name): p.requires_grad for i, p in zip(infos, params, strict=True)
    }

    def part(want: bool) -> FlatParamUnit:
        return FlatParamUnit(
            [i for i, t in zip(infos, trainable, strict=True) if t is want],
            [p for p, t in zip(params, trainable, strict=True) if t is want],
            [s for s in shared if grad_of[(id(s.prim_module), s.prim_param_name)] is want],
            config,
        )

    unit = part(True)
    unit.attach_frozen_part(part(False))
    return unit


_RESHARD_AFTER_FORWARD = (
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.HYBRID_SHARD,
    ShardingStrategy.HYBRID_SHARD_ACROSS_REPLICAS,
)


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
