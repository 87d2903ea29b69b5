"""``fully_shard``'s option types: mixed precision and offloading, as torch 2.13 spells them.

Frozen dataclasses with torch's field names and defaults, so code that builds
torch's passes ours unchanged; :func:`to_mp_policy` and :func:`to_offload_policy`
also take torch's own instances (a library that built them before
``fsdp.torch_compat.install()``) field by field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CPUOffloadPolicy",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "to_mp_policy",
    "to_offload_policy",
]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision for ``fully_shard``.

    The gathered (unsharded) parameters are cast to ``param_dtype`` on their
    way into the all-gather, so forward, backward and the all-gather itself
    run in it, while the sharded parameters the optimizer steps stay in their
    own dtype: the sharded fp32 parameter is the master copy, and no extra
    copy of the model is kept. Activations saved for backward are in the low
    precision, and casts happen only at module boundaries.

    Attributes:
        param_dtype: dtype of the unsharded parameters (compute and all-gather);
            ``None`` keeps the parameters' dtype. Non-floating parameters are
            never cast.
        reduce_dtype: dtype of the gradient reduction; ``None`` reduces in
            ``param_dtype`` (the gradients' dtype). Also the dtype gradients
            accumulate in while ``set_requires_gradient_sync(False)``.
        output_dtype: cast floating-point forward outputs to this; ``None``
            leaves them.
        cast_forward_inputs: cast floating-point forward inputs to
            ``param_dtype`` before the module runs.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(
                    f"MixedPrecisionPolicy.{name} must be a torch.dtype or None, got {value!r}; "
                    "e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
                )


@dataclass
class OffloadPolicy:
    """No offloading: the default ``offload_policy`` (the base of :class:`CPUOffloadPolicy`)."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer state in host memory.

    Each gather copies the shard host-to-device first (into its slot of the
    gathered buffer), each reduced gradient is copied device-to-host, and the
    optimizer steps on the CPU. ``pin_memory`` page-locks the host shard and
    gradients so the copies are asynchronous on CUDA; turn it off when host
    memory is short (pinned memory cannot be paged out).
    """

    pin_memory: bool = True


def to_mp_policy(value: Any) -> MixedPrecisionPolicy:
    """``value`` as our :class:`MixedPrecisionPolicy` (ours, or torch's by fields)."""
    if isinstance(value, MixedPrecisionPolicy):
        return value
    if type(value).__name__ == "MixedPrecisionPolicy" and dataclasses.is_dataclass(value):
        return MixedPrecisionPolicy(
            **{f.name: getattr(value, f.name) for f in dataclasses.fields(MixedPrecisionPolicy)}
        )
    raise TypeError(
        f"mp_policy must be a MixedPrecisionPolicy, got {value!r} ({type(value).__name__}); "
        "e.g. fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))"
    )


def to_offload_policy(value: Any) -> OffloadPolicy:
    """``value`` as our :class:`OffloadPolicy` (ours, or torch's by type name)."""
    if isinstance(value, OffloadPolicy):
        return value
    name = type(value).__name__
    if name == "CPUOffloadPolicy" and dataclasses.is_dataclass(value):
        return CPUOffloadPolicy(pin_memory=bool(getattr(value, "pin_memory", True)))
    if name == "OffloadPolicy" and dataclasses.is_dataclass(value):
        return OffloadPolicy()
    raise TypeError(
        f"offload_policy must be an OffloadPolicy, got {value!r} ({name}); use "
        "OffloadPolicy() (no offloading) or CPUOffloadPolicy(pin_memory=...)"
    )
