"""The few object collectives a save or load needs, also without a process group.

A checkpoint is usable from a single process that never called
``init_process_group``; ``Comm.of(None)`` is then a world of one where every
collective returns its input.

[Note: one decision, every rank]
Whatever one rank decides (the save path is free, the files are intact, the keys fit)
is sent to every rank before anyone acts on it, and every rank raises the same error.
A rank that raised alone would leave the others blocked in the next collective until
the process-group timeout; with the decision shared, a bad checkpoint fails fast and
loudly everywhere.

[Note: collective failures, named]
A backend failure of a save's or load's collective is re-raised named, at two levels,
as in fsdp: :func:`backend_failures` wraps each collective of :class:`Comm` and the
agreement step (it knows the operation);
:func:`in_phase` decorates ``save``/``load``/... (it knows the phase and the
checkpoint path) and names them in any :class:`~flatparam.CollectiveError` that
arrives without a phase, also one raised by fsdp while gathering a state dict, as a
:class:`~ckpt.CheckpointCollectiveError`. The steps of a save or load inside are
named more closely in ``_commit/peer_faults.py``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import threading
import weakref
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

from ckpt._errors import CheckpointCollectiveError, CheckpointError
from flatparam import CollectiveError, named_backend_failures
from fsdp import FullyShardedDataParallel

__all__ = [
    "Comm",
    "SharedFailure",
    "async_group",
    "backend_failures",
    "device_of",
    "global_rank",
    "in_phase",
    "on_device",
]

_F = TypeVar("_F", bound=Callable[..., Any])
T = TypeVar("T")


@dataclass(frozen=True)
class Comm:
    """A process group (or none) with this rank's place in it."""

    group: dist.ProcessGroup | None  # None: single process, or the default group
    rank: int  # rank within ``group``
    world_size: int
    distributed: bool  # False: no initialised process group; every op is local

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> Comm:
        """The communicator for ``group``, or the default group, or a world of one."""
        if not (dist.is_available() and dist.is_initialized()):
            if group is not None:
                raise ValueError(
                    "a process_group was given but torch.distributed is not initialised; "
                    "call init_process_group first or pass process_group=None"
                )
            return cls(group=None, rank=0, world_size=1, distributed=False)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the "
                f"process_group it was given; call ckpt only on the group's ranks"
            )
        return cls(
            group=group,
            rank=rank,
            world_size=dist.get_world_size(group),
            distributed=True,
        )

    @property
    def is_coordinator(self) -> bool:
        """Rank 0 of the group: it commits, writes the manifest, prunes."""
        return self.rank == 0

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank (the others' ``obj`` is ignored)."""
        if not self.distributed:
            return obj
        box: list[Any] = [obj if self.is_coordinator else None]
        with backend_failures("broadcast", "rank 0's decision"):
            dist.broadcast_object_list(box, src=self._global(0), group=self.group)
        return box[0]  # type: ignore[no-any-return]

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with backend_failures("all_gather", "every rank's findings"):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: T) -> list[T] | None:
        """Every rank's ``obj`` in rank order on rank 0; None elsewhere."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        with backend_failures("gather", "every rank's files"):
            dist.gather_object(obj, out, dst=self._global(0), group=self.group)
        return out

    def run_on_coordinator(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 and share its result, or its failure, with every rank.

        See [Note: one decision, every rank]. Rank 0 re-raises the original exception;
        the others raise a copy of it when it pickles (ckpt's errors do), else a
        CheckpointError that quotes it.
        """
        result: T | None = None
        failure: Exception | None = None
        if self.is_coordinator:
            try:
                result = fn()
            except Exception as e:
                failure = e
        payload: Any = result
        if failure is not None:
            payload = SharedFailure(failure)
        shared = self.broadcast(payload)
        if failure is not None:
            raise failure
        if isinstance(shared, SharedFailure):
            raise shared.rebuild(what)
        return shared  # type: ignore[no-any-return]


class SharedFailure:
    """A rank's exception on its way to the other ranks: its pickle where it has one
    (ckpt's errors do), its text where not."""

    def __init__(self, error: Exception) -> None:
        self.text = f"{type(error).__name__}: {error}"
        try:
            self.blob: bytes | None = pickle.dumps(error)
            pickle.loads(self.blob)
        except Exception:
            self.blob = None

    def rebuild(self, what: str) -> Exception:
        if self.blob is not None:
            error = pickle.loads(self.blob)
            if isinstance(error, Exception):
                return error
        return CheckpointError(f"rank 0 failed to {what}: {self.text}")


def device_of(state: object) -> torch.device | None:
    """The CUDA device ``state``'s models compute on; None if none is on CUDA.

    A rank's object collectives (ours and torch.distributed.checkpoint's) put their
    bytes on the *current* CUDA device; under torchrun without
    ``torch.cuda.set_device`` that is cuda:0 on every rank, which NCCL refuses. The
    model's own device is the one the rank was given (``device_id=``), so a save or
    load runs with it current (see :func:`on_device`). An fsdp model's compute device
    counts (its parameters may be on the CPU under ``CPUOffload``), then parameters of
    models, then of optimizers.
    """
    if not isinstance(state, Mapping):
        return None  # to_state_dict names the problem
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    for module in modules:
        for unit in FullyShardedDataParallel.fsdp_modules(module):
            if unit.compute_device.type == "cuda":
                return unit.compute_device
    tensors: list[torch.Tensor] = [p for m in modules for p in m.parameters()]
    for value in state.values():
        if isinstance(value, torch.optim.Optimizer):
            tensors += [p for g in value.param_groups for p in g["params"]]
    for t in tensors:
        if t.device.type == "cuda":
            return t.device
    return None


def on_device(device: torch.device | None) -> contextlib.AbstractContextManager[Any]:
    """``device`` current for the block when it is a CUDA device; a no-op otherwise."""
    if device is not None and device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


# One dedicated gloo group per default group for asynchronous saves: their collectives
# run on a background thread and must never interleave with the training loop's
# collectives on the default group.
_async_groups: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = (
    weakref.WeakKeyDictionary()
)
_async_lock = threading.Lock()


def async_group() -> dist.ProcessGroup | None:
    """The checkpointing group for background saves (created on first use, collectively).

    Every rank reaches this from ``async_save`` in the same order, so the collective
    ``new_group`` call is matched. Returns None without a process group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    assert world is not None
    with _async_lock:
        group = _async_groups.get(world)
        if group is None:
            group = dist.new_group(backend="gloo")
            assert group is not None
            _async_groups[world] = group
        return group


def global_rank() -> int:
    """This process's rank in the default group; 0 without a process group."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def backend_failures(operation: str, target: str) -> AbstractContextManager[None]:
    """Turn a backend ``RuntimeError`` inside the block into a :class:`CollectiveError`."""
    return named_backend_failures(global_rank(), operation, target)


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
