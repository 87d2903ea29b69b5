"""Will it fit? Bytes per rank of a wrapped model, computed before any process group exists.

[Note: memory per rank]
For one unit ``u`` with ``T_u`` trainable and ``F_u`` frozen elements (a tied
parameter counted once, in the unit that owns it: [Note: tied parameters] in
``_init.py``), over ``W`` ranks (``W = 1`` for ``NO_SHARD``), with ``e`` the
parameters' element size, ``c`` the compute (``param_dtype``) element size and
``g`` the gradient element size (``e``, or the reduce dtype's with
``keep_low_precision_grads``), each rank holds between steps::

    parameters  = e * (ceil(T_u / W) + ceil(F_u / W))       # the sharded FlatParameter(s)
    gradients   = g * ceil(T_u / W)                         # after backward; 0 if T_u == 0
    optimizer   = s * e * ceil(T_u / W)                     # s = 2 Adam(W), 1 SGD+momentum
    gathered    = c * (W * ceil(T_u / W) + W * ceil(F_u / W))   # while u computes; 0 when
                                                            # NO_SHARD without mp or offload

summed over units (``gathered``: the largest unit, and the sum of all units,
which ``SHARD_GRAD_OP`` keeps from forward to backward). Frozen elements
cost no gradient and no optimizer state ([Note: frozen part] in
``_flat_param_unit.py``). Inside ``no_sync()`` each sharded unit also keeps
its unsharded gradient, ``c * T_u`` (``NO_SHARD``: the gradient above
accumulates in place). With ``CPUOffload(offload_params=True)`` parameters,
gradients and optimizer state live in host memory. ``use_orig_params=True``
optimizer state covers this rank's pieces without the padding (at most
``ceil(T_u / W)``). Adam's ``step`` counters (one scalar per parameter) are
not counted. Nothing else is held between steps: the mixed-precision cast and
the offloaded shard's copy go straight into ``gathered`` (an in-place
all-gather), and the padded gradient a reduction reads (``W * ceil(T_u / W)``
elements of the reduce dtype, one per reduction in flight) exists only during
backward (``_flat_param_unit.py``, [Note: gradient padding]).

``accounting="zero"`` answers with the ZeRO paper's model instead (Rajbhandari
et al. 2020, Figure 1, for mixed-precision Adam): ``2`` bytes of fp16
parameters, ``2`` of fp16 gradients and ``K = 12`` of optimizer state (fp32
master parameters and two moments) per parameter, sharded by stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from fsdp.api import CPUOffload, MixedPrecision, ShardingStrategy

__all__ = ["MemoryEstimate", "UnitSize", "estimate_memory"]

Baseline = Literal["ddp", "zero_optim"]

_OPTIMIZER_SLOTS = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}


@dataclass(frozen=True)
class UnitSize:
    """Elements of one unit's parameters: ``trainable`` ones and ``frozen`` ones."""

    trainable: int
    frozen: int = 0


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds; see [Note: memory per rank] in ``fsdp/_memory.py``."""

    parameters: int  # sharded (or replicated) parameter storage between steps
    gradients: int  # after backward (plus the unsharded gradients inside no_sync)
    optimizer: int  # optimizer state
    largest_gathered_unit: int  # the biggest unit's gathered parameters, while it computes
    all_gathered: int  # every unit gathered at once (SHARD_GRAD_OP between fwd and bwd)
    on_host: bool  # parameters, gradients and optimizer state are in CPU memory (offload)

    @property
    def steady_state(self) -> int:
        """Parameters, gradients and optimizer state: what the ZeRO paper's Figure 1 counts."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        """Steady state plus the largest gathered unit (activations not included)."""
        return self.parameters + self.gradients + self.optimizer + self.largest_gathered_unit


def estimate_memory(
    model: nn.Module | Sequence[UnitSize] | int,
    world_size: int,
    sharding_strategy: ShardingStrategy | Baseline = ShardingStrategy.FULL_SHARD,
    *,
    mixed_precision: MixedPrecision | None = None,
    cpu_offload: CPUOffload | None = None,
    optimizer: str = "adam",
    auto_wrap_policy: object = None,
    no_sync: bool = False,
    param_dtype: torch.dtype = torch.float32,
    accounting: Literal["fsdp", "zero"] = "fsdp",
) -> MemoryEstimate:
    """Bytes per rank for parameters, gradients, optimizer state and gathered units.

    Answers "will it fit" before any process group exists: ``model`` may live
    on the meta device, or be given as its units' sizes (:class:`UnitSize`) or
    as a parameter count (one unit). ``auto_wrap_policy`` (a
    ``ModuleWrapPolicy`` or ``CustomPolicy``) splits a module into units as the
    constructor would. ``sharding_strategy`` may also be ``"ddp"`` (plain
    data parallel) or ``"zero_optim"`` (DDP with a ZeroRedundancyOptimizer) to
    compare. ``optimizer``: ``"adam"``/``"adamw"``, ``"sgd_momentum"``,
    ``"sgd"``. ``accounting="zero"`` uses the ZeRO paper's per-parameter bytes
    (fp16 parameters and gradients, ``K = 12``) instead of ours. The formulas
    are in [Note: memory per rank]; the tests check them against the bytes a
    wrapped model holds.

    Raises:
        ValueError: a world size below 1, an unknown optimizer or strategy, or
            a callable auto-wrap policy (pass a ModuleWrapPolicy or UnitSizes).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"estimate_memory needs world_size >= 1, got {world_size!r}")
    slots = _OPTIMIZER_SLOTS.get(optimizer)
    if slots is None:
        raise ValueError(
            f"estimate_memory: unknown optimizer {optimizer!r}; pass one of "
            f"{sorted(_OPTIMIZER_SLOTS)}"
        )
    strategies = (*ShardingStrategy, "ddp", "zero_optim")
    if sharding_strategy not in strategies:
        raise ValueError(
            f"estimate_memory: sharding_strategy must be a ShardingStrategy, 'ddp' or "
            f"'zero_optim', got {sharding_strategy!r}"
        )
    units = _unit_sizes(model, auto_wrap_policy)
    if accounting == "zero":
        return _zero_paper(units, world_size, sharding_strategy)
    if accounting != "fsdp":
        raise ValueError(
            f"estimate_memory: accounting must be 'fsdp' or 'zero', got {accounting!r}"
        )
    mp = mixed_precision or MixedPrecision()
    offload = bool(cpu_offload is not None and cpu_offload.offload_params)
    e = param_dtype.itemsize
    c = (mp.param_dtype or param_dtype).itemsize
    reduce = mp.reduce_dtype or mp.param_dtype or param_dtype
    g = reduce.itemsize if mp.keep_low_precision_grads else e
    if sharding_strategy in ("ddp", "zero_optim"):
        total_t = sum(u.trainable for u in units)
        total_f = sum(u.frozen for u in units)
        opt_w = world_size if sharding_strategy == "zero_optim" else 1
        return MemoryEstimate(
            parameters=e * (total_t + total_f),
            gradients=e * total_t,
            optimizer=slots * e * math.ceil(total_t / opt_w),
            largest_gathered_unit=0,
            all_gathered=0,
            on_host=False,
        )
    shard = sharding_strategy is not ShardingStrategy.NO_SHARD and world_size > 1
    w = world_size if shard else 1
    aliased = not shard and c == e and not offload
    params = grads = opt = largest = gathered = 0
    for u in units:
        t, f = math.ceil(u.trainable / w), math.ceil(u.frozen / w)
        params += e * (t + f)
        grads += g * t
        if no_sync and shard:
            grads += c * u.trainable
        opt += slots * e * t
        unit_gathered = 0 if aliased else c * w * (t + f)
        largest = max(largest, unit_gathered)
        gathered += unit_gathered
    return MemoryEstimate(params, grads, opt, largest, gathered, on_host=offload)


def _zero_paper(
    units: Sequence[UnitSize], world_size: int, strategy: ShardingStrategy | Baseline
) -> MemoryEstimate:
    """ZeRO Figure 1: 2 + 2 + K bytes per parameter, K = 12, sharded per stage."""
    psi = sum(u.trainable + u.frozen for u in units)
    n = float(world_size)
    k = 12
    p: float
    g: float
    o: float
    if strategy in ("ddp", ShardingStrategy.NO_SHARD):
        p, g, o = 2 * psi, 2 * psi, k * psi
    elif strategy == "zero_optim":  # P_os
        p, g, o = 2 * psi, 2 * psi, k * psi / n
    elif strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2):
        p, g, o = 2 * psi, 2 * psi / n, k * psi / n  # P_os+g
    else:  # FULL_SHARD, HYBRID_SHARD: P_os+g+p
        p, g, o = 2 * psi / n, 2 * psi / n, k * psi / n
    largest = 2 * max((u.trainable + u.frozen for u in units), default=0)
    return MemoryEstimate(
        round(p), round(g), round(o), largest, 2 * psi if p < 2 * psi else 0, on_host=False
    )


def _unit_sizes(model: nn.Module | Sequence[UnitSize] | int, policy: object) -> list[UnitSize]:
    if isinstance(model, int):
        return [UnitSize(trainable=model)]
    if not isinstance(model, nn.Module):
        sizes = list(model)
        if not all(isinstance(u, UnitSize) for u in sizes):
            raise ValueError("estimate_memory: pass an nn.Module, an int or a list of UnitSize")
        return sizes
    from fsdp.wrap import _Policy

    if policy is None:
        targets: set[nn.Module] = set()
    elif isinstance(policy, _Policy):
        targets = set(policy._run_policy(model, set(), {}))
        targets.discard(model)
    else:
        raise ValueError(
            "estimate_memory: auto_wrap_policy must be a ModuleWrapPolicy or CustomPolicy "
            f"(a callable policy needs the wrapping itself), got {policy!r}; or pass the "
            "units' sizes as a list of UnitSize"
        )
    # Which units exist (by path), and where each parameter is used.
    unit_paths: list[str] = [""]
    uses: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        if m in targets and path not in unit_paths:
            unit_paths.append(path)
        for p in m._parameters.values():
            if p is not None:
                uses.setdefault(id(p), []).append(path)
                params[id(p)] = p
    # Each parameter belongs to the innermost unit containing all its uses.
    by_unit: dict[str, list[int]] = {path: [0, 0] for path in unit_paths}
    for pid, paths in uses.items():
        owner = max(
            (u for u in unit_paths if all(_under(p, u) for p in paths)), key=len, default=""
        )
        p = params[pid]
        by_unit[owner][0 if p.requires_grad else 1] += p.numel()
    return [UnitSize(t, f) for t, f in by_unit.values() if t + f > 0]


def _under(path: str, unit: str) -> bool:
    return unit in ("", path) or path.startswith(unit + ".")
