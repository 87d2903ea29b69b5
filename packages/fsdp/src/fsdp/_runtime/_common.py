"""Names, the instance-level training state, and helpers over nested tensors.

Everything here is shared by the other modules and depends on none of them.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from enum import Enum, auto
from typing import Any, TypeVar, cast

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

__all__ = [
    "FLAT_PARAM",
    "FROZEN_FLAT_PARAM",
    "FSDP_PREFIX",
    "FSDP_WRAPPED_MODULE",
    "TrainingState",
    "TrainingStateError",
    "apply_to_tensors",
    "cast_floating_tensors",
    "clean_fqn",
    "eager_only",
    "hook_grad_outputs",
    "move_tensors_to_device",
]

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
"""Attribute under which an FSDP instance holds the module it wraps (as torch's does)."""
FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."
"""What an FSDP instance inserts into the names of everything below it."""
FLAT_PARAM = "_flat_param"
"""Name of the FlatParameter registered on an FSDP instance (as torch's does)."""
FROZEN_FLAT_PARAM = "_flat_param_frozen"
"""Name of a unit's frozen part's FlatParameter, for units that mix frozen and trainable
parameters (see [Note: frozen part] in ``_flat_param_unit.py``): registered on the
FSDP instance under ``use_orig_params=False``, shown to ckpt's state-dict types under
``True``."""


class TrainingState(Enum):
    """What an FSDP instance is doing; public methods check it before acting."""

    IDLE = auto()
    """Between steps: no forward or backward in flight, parameters sharded (or
    kept gathered after a forward whose backward has not run yet)."""
    FORWARD_BACKWARD = auto()
    """Inside this instance's forward, or inside a backward pass that reached it."""
    SUMMON_FULL_PARAMS = auto()
    """Inside ``summon_full_params`` (or ``apply`` or ``state_dict``): the original
    parameters are registered on their modules as full tensors."""


class TrainingStateError(RuntimeError, ValueError):
    """A method called in a training state that does not allow it.

    A ``ValueError`` because torch's FSDP raises that for the same mistakes (code
    written against torch catches it); a ``RuntimeError`` because that is what
    ours raised before.
    """


CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."
"""What torch's activation-checkpoint wrapper inserts into the names below it."""


_F = TypeVar("_F", bound=Callable[..., Any])


def eager_only(fn: _F) -> _F:
    """Keep ``torch.compile`` out of ``fn``: it runs eagerly, between compiled regions.

    For the FSDP hooks around each unit's forward: collectives in flight,
    storage freed and reallocated, and Python state changes are what a graph
    cannot hold, while the modules' own computation between the hooks
    compiles well. Dynamo breaks the graph at each call instead of tracing in.
    """
    return cast(_F, torch.compiler.disable(fn, reason="FSDP runtime hook"))


def clean_fqn(name: str) -> str:
    """A name with every FSDP (and checkpoint-wrapper) level removed: the unwrapped model's name."""
    return name.replace(FSDP_PREFIX, "").replace(CHECKPOINT_PREFIX, "")


def hook_grad_outputs(output: Any, hook: Callable[[Tensor], Any]) -> tuple[Any, bool]:
    """Register ``hook`` on every tensor of ``output`` that requires a gradient; whether
    any did (if none, no backward will reach this module through its output)."""
    registered = False

    def register(t: Tensor) -> Tensor:
        nonlocal registered
        if t.requires_grad:
            t.register_hook(hook)
            registered = True
        return t

    return apply_to_tensors(register, output), registered


def apply_to_tensors(fn: Callable[[Tensor], Tensor], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in a nested structure, rebuilding the structure.

    Forward inputs and outputs come as tuples, lists, dicts, named tuples,
    dataclasses (Hugging Face ``ModelOutput`` is both an OrderedDict and a
    dataclass) and ``PackedSequence``; anything else is returned as is.
    """
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, PackedSequence):
        return PackedSequence(
            fn(obj.data), obj.batch_sizes, obj.sorted_indices, obj.unsorted_indices
        )
    if isinstance(obj, OrderedDict) and hasattr(type(obj), "__dataclass_fields__"):
        # e.g. ModelOutput: keep the type, update in place like its own setters do.
        for key in list(obj.keys()):
            obj[key] = apply_to_tensors(fn, obj[key])
        return obj
    if isinstance(obj, dict):
        items = [(k, apply_to_tensors(fn, v)) for k, v in obj.items()]
        try:
            return type(obj)(items)
        except TypeError:
            return dict(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: apply_to_tensors(fn, getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # named tuple
        return type(obj)(*(apply_to_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple, set)):
        return type(obj)(apply_to_tensors(fn, v) for v in obj)
    return obj


def cast_floating_tensors(dtype: torch.dtype | None, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Cast the floating-point tensors in ``args``/``kwargs`` to ``dtype``.

    How mixed precision makes a unit's inputs match its compute dtype; integer
    tensors (token ids, masks) are left alone, and ``dtype=None`` is a no-op.
    """
    if dtype is None:
        return args, kwargs

    def cast(t: Tensor) -> Tensor:
        if not torch.is_floating_point(t) or t.dtype == dtype:
            return t
        return t.to(dtype)

    return apply_to_tensors(cast, args), apply_to_tensors(cast, kwargs)


def move_tensors_to_device(device: torch.device, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Move the tensors in ``args``/``kwargs`` to ``device`` (the root does this).

    FSDP documents that inputs are moved to the compute device for the user;
    on a CPU-only run this is a no-op.
    """

    def move(t: Tensor) -> Tensor:
        return t if t.device == device else t.to(device, non_blocking=True)

    return apply_to_tensors(move, args), apply_to_tensors(move, kwargs)
