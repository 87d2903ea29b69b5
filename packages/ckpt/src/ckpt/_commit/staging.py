"""The copy ``async_save`` blocks for: a captured state's tensors in reused host buffers.

[Note: staging]
An asynchronous save copies what the capture handed over (each rank's own tensors, by
reference: [Note: capture, then copy or write] in ``_wrappers/fsdp1_runs.py``) before it
returns, because training changes those tensors in place from the next step on. The
copy goes through torch's ``DefaultStager`` (DCP's own staging for ``async_save``),
kept alive across saves: its ``StateDictStager`` keeps, for every source storage (held
weakly), the host storage it copied it to, and copies into that storage again at the
next save. So repeated saves of the same model allocate nothing after the first (on
CUDA the buffers are pinned and the copies are issued without blocking, with one
synchronisation at the end), and views that share a storage (every run of one flat
shard, ``fully_shard``'s parameters inside their group's region) are copied once, as
that storage, and come out as views of its copy.

Around it: the state dict's tensors and mutable values are taken out into one list,
staged in one call (so the stager's memo sees every view of a storage) and put back.
A ``DTensor`` is staged as its local tensor and rebuilt on the copy with the same mesh,
placements, shape and stride (the stager's deep copy of a ``DTensor`` reads the
wrapper's own storage, which is invalid for a ``DTensor`` whose local tensor is a view
at an offset, as ``fully_shard``'s are); :class:`~ckpt._format.flat_pieces.FlatPieces` as their
run. Other values (plain objects) are deep-copied by the stager, their tensors staged
like the rest, so a value changed after ``async_save`` returned does not reach the
checkpoint either; immutable ones (numbers, strings) are kept as they are. Putting the
copies back is left to the background (:meth:`Staged.state_dict`): it is no copy, and
rebuilding a ``DTensor`` costs a quarter of a millisecond each, which for
``fully_shard``'s parameters and AdamW moments came to a third of what training waited
for.

The buffers hold one host copy of the last asynchronously saved state per process for
as long as the model's tensors live; :func:`release_staging_buffers` frees them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from ckpt._format.flat_pieces import FlatPieces

__all__ = ["Staged", "release_staging_buffers", "stage"]


_IMMUTABLE = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)


@dataclass(frozen=True)
class _Taken:
    """Where a value was in the state dict: ``items[index]`` staged, then rebuilt as
    it was (a plain value or tensor; a ``DTensor`` from its local tensor, ``layout``
    its mesh, placements, shape and stride; pieces from their run, ``layout`` the
    shape and start)."""

    index: int
    kind: str  # "value", "dtensor" or "pieces"
    layout: tuple[Any, ...] = ()


def _take(value: Any, items: list[Any]) -> Any:
    """``value`` with every tensor and mutable leaf moved to ``items`` (see [Note: staging])."""
    if isinstance(value, dict):
        return {k: _take(v, items) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_take(v, items) for v in value)
    if isinstance(value, _IMMUTABLE):
        return value
    items.append(value)
    if isinstance(value, DTensor):
        items[-1] = value.to_local().detach()
        layout = (value.device_mesh, value.placements, value.shape, value.stride())
        return _Taken(len(items) - 1, "dtensor", layout)
    if isinstance(value, FlatPieces):
        items[-1] = value.local
        return _Taken(len(items) - 1, "pieces", (value.shape, value.start))
    return _Taken(len(items) - 1, "value")


def _put(value: Any, staged: list[Any]) -> Any:
    """The state dict back, its taken values replaced by their staged copies."""
    if isinstance(value, dict):
        return {k: _put(v, staged) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_put(v, staged) for v in value)
    if not isinstance(value, _Taken):
        return value
    copy = staged[value.index]
    if value.kind == "dtensor":
        mesh, placements, shape, stride = value.layout
        return DTensor.from_local(
            copy, mesh, placements, run_check=False, shape=shape, stride=stride
        )
    if value.kind == "pieces":
        shape, start = value.layout
        return FlatPieces(copy, shape, start)
    return copy


@dataclass(frozen=True)
class Staged:
    """A staged state dict: its skeleton and the copies of what was taken out of it."""

    skeleton: dict[str, Any]
    copies: list[Any]

    def state_dict(self) -> dict[str, Any]:
        """The state dict, its tensors the copies (``DTensor`` s and pieces rebuilt)."""
        return dict(_put(self.skeleton, self.copies))


class _Buffers:
    """This process's stager (and so its buffers), made for CUDA or for the CPU."""

    lock = threading.Lock()
    stager: DefaultStager | None = None
    cuda: bool = False


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def stage(state_dict: dict[str, Any]) -> Staged:
    """A copy of ``state_dict`` in host memory that training cannot change; the tensors'
    buffers are reused by the next call (see [Note: staging])."""
    cuda = _cuda_in_use()
    with _Buffers.lock:
        if _Buffers.stager is None or _Buffers.cuda != cuda:
            if _Buffers.stager is not None:
                _Buffers.stager.close()
            options = StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=cuda,
            )
            _Buffers.stager, _Buffers.cuda = DefaultStager(options), cuda
        items: list[Any] = []
        with torch.no_grad():  # the capture holds parameters: no graph for to_local()
            skeleton = _take(state_dict, items)
        # One list: storages shared by several tensors are copied once, in one pass.
        done = _Buffers.stager.stage({"items": items})  # not a Future: staging is blocking
    assert isinstance(done, dict)
    staged = done["items"]
    assert isinstance(staged, list) and len(staged) == len(items)
    return Staged(skeleton, staged)


def release_staging_buffers() -> None:
    """Free the host buffers that asynchronous saves reuse (the next one allocates anew).

    Call after the last asynchronous save has been waited for, e.g. when training ends.
    """
    with _Buffers.lock:
        if _Buffers.stager is not None:
            _Buffers.stager.close()
        _Buffers.stager = None
