"""Backend failures of FSDP's collectives, re-raised as one named error.

A collective fails when a peer died (``Connection reset by peer``), is in another
collective or is late beyond the process group's timeout. The backend's message
says none of which rank, which unit or which phase; :class:`~flatparam.CollectiveError`
does, chained to the backend's error. Two levels fill it in:

1. :func:`backend_failures` wraps each issue and each wait in ``_collectives.py``:
   it knows the operation and the tensor;
2. :func:`in_phase` decorates the FSDP hooks: it knows the phase (forward,
   backward, post-backward, ...) and the unit whose hook ran, and rewrites the
   level-1 error with them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar, cast

import torch.distributed as dist

from flatparam import CollectiveError, named_backend_failures
from fsdp._runtime._common import clean_fqn

__all__ = ["backend_failures", "in_phase"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def backend_failures(operation: str, target: str) -> AbstractContextManager[None]:
    """Turn a backend ``RuntimeError`` inside the block into a :class:`CollectiveError`."""
    return named_backend_failures(_rank, operation, target)


def in_phase(phase: str) -> Callable[[_F], _F]:
    """Name ``phase`` and the hook's unit in a :class:`CollectiveError` raised by the hook.

    For methods of :class:`~fsdp._wrapper._fsdp_state.FSDPState`; an error already
    named by an inner hook keeps its phase.
    """

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except CollectiveError as e:
                if e.phase:
                    raise
                raise e.in_phase(
                    phase, f"{e.target} for FSDP unit {unit_name(self)}"
                ) from e.backend_error

        return cast(_F, wrapper)

    return decorate


def unit_name(state: Any, root: Any = None) -> str:
    """``state``'s module path in the root model (``'<root>'`` for the root), for messages."""
    if root is None:
        states = getattr(getattr(state, "ctx", None), "states", None)
        root = states[0].module if states else None
    if root is not None:
        for name, module in root.named_modules():
            if module is state.module:
                return repr(clean_fqn(name).rstrip(".")) if clean_fqn(name) else "'<root>'"
    return repr(type(state.module).__name__)
