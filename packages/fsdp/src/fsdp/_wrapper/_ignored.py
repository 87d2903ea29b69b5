"""Parameters and modules FSDP leaves alone: ``ignored_modules`` and ``ignored_states``.

An ignored parameter is not flattened, sharded, gathered or reduced: it stays
a plain ``nn.Parameter`` registered on its module, on the device it was on,
and its gradient stays this rank's local gradient (no averaging across
ranks), as torch's FSDP documents. An ignored module's whole subtree is
ignored (its parameters and buffers; buffers keep their dtype under mixed
precision), except FSDP instances already built inside it. Auto-wrapping
never wraps an ignored module, and the units it creates ignore the same
states.

Every module in an ignored subtree is marked with ``_fsdp_ignored`` (as
``_fsdp_managed`` marks managed ones) so that the walks over a unit's modules
(parameters, buffers, deferred initialisation, buffer casting) skip it
without the ignored set being threaded through the run-time code.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from fsdp._wrapper._deferred_init import IGNORED

__all__ = ["IgnoredStates", "resolve_ignored"]


@dataclass(frozen=True)
class IgnoredStates:
    """What one FSDP instance ignores."""

    modules: frozenset[nn.Module]  # every module in an ignored subtree (FSDP instances aside)
    params: frozenset[nn.Parameter]  # their parameters plus the explicitly ignored ones
    for_children: list[Any] | None  # ``ignored_states=`` for the units auto-wrapping creates


class _NotModulesError(TypeError, ValueError):
    """Elements of the wrong kind in ignored_modules/ignored_states: torch's FSDP raises
    ``ValueError``, ours raised ``TypeError``."""


def _as_list(value: Iterable[Any], name: str) -> list[Any]:
    single_module = isinstance(value, nn.Module) and not hasattr(type(value), "__iter__")
    if single_module or isinstance(value, nn.Parameter):
        raise TypeError(
            f"{name} must be an iterable, got a single {type(value).__name__}; wrap it in a "
            f"list: {name}=[...]"
        )
    try:
        return list(value)
    except TypeError:
        raise TypeError(f"{name} must be an iterable, got {type(value).__name__}") from None


def resolve_ignored(
    root: nn.Module,
    ignored_modules: Iterable[nn.Module] | None,
    ignored_states: Iterable[Any] | None,
    is_fsdp: Callable[[nn.Module], bool],
) -> IgnoredStates:
    """Check the constructor's ``ignored_modules``/``ignored_states`` and expand them.

    Marks every ignored module (see the module docstring). ``ignored_states``
    holds parameters or modules, not both, as in torch's FSDP.
    """
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "Cannot pass both ignored_modules and ignored_states at the same time: pass one of "
            "them to FullyShardedDataParallel; ignored_states accepts modules too "
            "(ignored_states=[*modules])"
        )
    roots: list[nn.Module] = []
    params: list[nn.Parameter] = []
    if ignored_states is not None:
        states = _as_list(ignored_states, "ignored_states")
        if all(isinstance(s, nn.Parameter) for s in states):
            params = states
        elif all(isinstance(s, nn.Module) for s in states):
            roots = states
        else:
            kinds = sorted({type(s) for s in states}, key=str)
            raise _NotModulesError(
                "ignored_states expects all nn.Parameter or all nn.Module list elements but got "
                f"types {kinds}; pass the modules' parameters (list(m.parameters())) or the "
                "modules"
            )
    elif ignored_modules is not None:
        roots = _as_list(ignored_modules, "ignored_modules")
        bad = sorted({type(m) for m in roots if not isinstance(m, nn.Module)}, key=str)
        if bad:
            raise _NotModulesError(
                f"ignored_modules expects nn.Module list elements but got types {bad}; pass "
                "parameters as ignored_states="
            )
    wrapped = [type(m).__name__ for m in roots if is_fsdp(m)]
    if wrapped:
        raise ValueError(
            "`ignored_modules` should not include FSDP modules: ignored_modules/ignored_states "
            f"contain FullyShardedDataParallel instances ({wrapped}), and an FSDP instance "
            "manages its own parameters. Ignore the module it wraps before wrapping it, or do "
            "not wrap it"
        )
    if any(m is root for m in roots):
        warnings.warn(
            "Trying to ignore the top-level module passed into the FSDP constructor itself "
            "will result in all parameters being ignored and is not well-supported: "
            f"{type(root).__name__} is itself in ignored_modules/ignored_states, so this FSDP "
            "instance manages no parameter",
            stacklevel=3,
        )
    modules: set[nn.Module] = set()
    stack = list(roots)
    while stack:  # each ignored subtree, without the FSDP instances inside it (they are built)
        m = stack.pop()
        if m not in modules and not is_fsdp(m):
            modules.add(m)
            stack.extend(c for c in m.children())
    all_params = set(params) | {p for m in modules for p in m.parameters(recurse=False)}
    for m in modules:
        m.__dict__[IGNORED] = True
    for_children: list[Any] | None = None
    if roots:
        for_children = roots
    elif params:
        for_children = params
    return IgnoredStates(frozenset(modules), frozenset(all_params), for_children)
