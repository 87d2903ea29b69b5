"""torch's FSDP1 option types and wrap policies, converted to ours at the API boundary.

Libraries built on torch's FSDP1 (Lightning, accelerate, transformers' Trainer) build
torch's own option objects (``torch.distributed.fsdp.ShardingStrategy.FULL_SHARD``,
``torch.distributed.fsdp.MixedPrecision(...)``, ``ModuleWrapPolicy``) and pass them to
whichever ``FullyShardedDataParallel`` they were given. Every public entry point that
takes an option calls :func:`to_fsdp_type` (or :func:`to_fsdp_policy`) first, so
the rest of the package sees only our types.

This module never imports torch's FSDP: an object of one of torch's types can only
exist if its module is already loaded, so recognising it needs only its class's
module and name. An enum member maps by name, a config dataclass field by field.

[Note: torch option types]
The conversion is total for the names both sides define (``api.py`` mirrors torch's
``torch.distributed.fsdp.api`` name for name and field for field). A torch field that
we do not know is accepted only at its default, so that a setting is never silently
dropped; anything that is neither ours nor torch's gets a ``TypeError`` that names
both accepted types.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from enum import Enum
from typing import Any, TypeVar, cast

from fsdp import api

__all__ = ["is_torch_fsdp_object", "to_fsdp_policy", "to_fsdp_type"]

_TORCH_PACKAGE = "torch.distributed.fsdp"
_T = TypeVar("_T")


def _torch_counterpart_name(value: object) -> str | None:
    """The class name of ``value`` if its class (or a base) is one of torch's FSDP types."""
    for cls in type(value).__mro__:
        module = getattr(cls, "__module__", "") or ""
        if module == _TORCH_PACKAGE or module.startswith(_TORCH_PACKAGE + "."):
            return cls.__name__
    return None


def is_torch_fsdp_object(value: object) -> bool:
    """Whether ``value`` is an instance of a class defined in ``torch.distributed.fsdp``."""
    return _torch_counterpart_name(value) is not None


def _describe(expected: type[Any]) -> str:
    name = expected.__name__
    return f"fsdp.{name} or torch.distributed.fsdp.{name}"


def to_fsdp_type(value: Any, expected: type[_T], arg: str) -> _T:
    """``value`` as our ``expected`` type: ours as is, torch's equivalent converted.

    ``expected`` is one of the option types of :mod:`fsdp.api` (an enum or a
    config dataclass); a subclass of it may come back (a ``FullStateDictConfig``
    where a ``StateDictConfig`` is expected). Raises ``TypeError`` naming both
    accepted types for anything else, and ``ValueError`` for a torch value that has
    no counterpart here (an enum member or a non-default field we do not know).
    """
    if isinstance(value, expected):
        return value
    name = _torch_counterpart_name(value)
    ours = getattr(api, name, None) if name is not None else None
    if ours is None or not (isinstance(ours, type) and issubclass(ours, expected)):
        raise TypeError(
            f"{arg} must be {_describe(expected)}, got {value!r} ({type(value).__module__}."
            f"{type(value).__qualname__})"
        )
    if issubclass(ours, Enum):
        member = ours.__members__.get(value.name)
        if member is None:
            raise ValueError(
                f"{arg}={value!r}: torch's {name}.{value.name} has no counterpart in fsdp."
                f"{name} (members: {', '.join(ours.__members__)})"
            )
        return cast(_T, member)
    if dataclasses.is_dataclass(value) and dataclasses.is_dataclass(ours):
        return cast(_T, _convert_dataclass(value, ours, arg))
    raise TypeError(f"{arg}: cannot convert torch's {name} ({value!r}) to fsdp.{name}")


def _convert_dataclass(value: Any, ours: type[Any], arg: str) -> Any:
    known = {f.name for f in dataclasses.fields(ours) if f.init}
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(value):
        if not field.init:
            continue
        v = getattr(value, field.name)
        if field.name in known:
            kwargs[field.name] = _convert_nested(v, f"{arg}.{field.name}")
        elif field.default is dataclasses.MISSING or v != field.default:
            raise ValueError(
                f"{arg}: torch's {type(value).__name__}.{field.name}={v!r} has no counterpart in "
                f"fsdp.{ours.__name__}; leave it at its default or set the option another way"
            )
    return ours(**kwargs)


def _convert_nested(value: Any, arg: str) -> Any:
    """A field that holds another option (``StateDictSettings``) converted too."""
    name = _torch_counterpart_name(value)
    ours = getattr(api, name, None) if name is not None else None
    if isinstance(ours, type):
        return to_fsdp_type(value, ours, arg)
    return value


def to_fsdp_policy(policy: Any) -> Any:
    """torch's wrap policies as ours; anything else unchanged (checked by the caller).

    ``ModuleWrapPolicy`` and ``CustomPolicy`` become ours with the same classes
    or function; torch's policy functions (``transformer_auto_wrap_policy``,
    ``size_based_auto_wrap_policy``, ``lambda_auto_wrap_policy``, ...), bare or
    bound with ``functools.partial``, become ours of the same name with the same
    arguments, so that they walk the tree with our rules (ours skip modules that
    are already flattened by our units, for one).
    """
    from fsdp import wrap

    if policy is None:
        return None
    name = _torch_counterpart_name(policy)
    if name == "ModuleWrapPolicy":
        return wrap.ModuleWrapPolicy(policy._module_classes)
    if name == "CustomPolicy":
        return wrap.CustomPolicy(policy._lambda_fn)
    if isinstance(policy, functools.partial):
        ours = _our_policy_function(policy.func)
        if ours is None:
            return policy
        keywords = dict(policy.keywords)
        if ours is wrap._or_policy and "policies" in keywords:
            keywords["policies"] = [to_fsdp_policy(p) for p in keywords["policies"]]
        return functools.partial(ours, *policy.args, **keywords)
    ours = _our_policy_function(policy)
    return policy if ours is None else ours


def _our_policy_function(fn: object) -> Callable[..., bool] | None:
    from fsdp import wrap

    module = getattr(fn, "__module__", "") or ""
    if module != f"{_TORCH_PACKAGE}.wrap":
        return None
    ours: Callable[..., bool] | None = getattr(wrap, getattr(fn, "__name__", ""), None)
    return ours if callable(ours) else None
