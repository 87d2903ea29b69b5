"""Backend failures of a save's or load's collectives, re-raised named.

Two levels, as in fsdp: :func:`backend_failures` wraps each collective of
:class:`~ckpt._comm.Comm` and the agreement step (it knows the operation);
:func:`in_phase` decorates ``save``/``load``/... (it knows the phase and the
checkpoint path) and names them in any :class:`~flatparam.CollectiveError` that
arrives without a phase, also one raised by fsdp while gathering a state dict, as a
:class:`~ckpt.CheckpointCollectiveError`. The steps of a save or load inside are
named more closely in ``_peer_faults.py``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar, cast

import torch.distributed as dist

from ckpt._errors import CheckpointCollectiveError
from flatparam import CollectiveError, named_backend_failures

__all__ = ["backend_failures", "in_phase"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def backend_failures(operation: str, target: str) -> AbstractContextManager[None]:
    """Turn a backend ``RuntimeError`` inside the block into a :class:`CollectiveError`."""
    return named_backend_failures(_rank(), operation, target)


def in_phase(phase: str) -> Callable[[_F], _F]:
    """Name ``phase`` and the checkpoint path in a phase-less :class:`CollectiveError`.

    For functions whose second positional argument (or ``path=``) is the
    checkpoint path.
    """

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except CollectiveError as e:
                if e.phase:
                    raise
                path = kwargs.get("path", args[1] if len(args) > 1 else None)
                if path is None and args:
                    path = args[0]  # verify(path)
                named = e.in_phase(phase, f"{e.target} (checkpoint {str(path)!r})")
                raise CheckpointCollectiveError(
                    str(named),
                    rank=named.rank,
                    operation=named.operation,
                    target=named.target,
                    phase=phase,
                    path=Path(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else None,
                ) from e.backend_error

        return cast(_F, wrapper)

    return decorate
