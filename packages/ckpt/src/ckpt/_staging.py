"""The copy ``async_save`` blocks for: a captured state's tensors in reused host buffers.

[Note: staging]
An asynchronous save copies what the capture handed over (each rank's own tensors, by
reference: [Note: capture, then copy or write] in ``_fsdp_save_state.py``) before it
returns, because training changes those tensors in place from the next step on. The
copy goes through torch's ``DefaultStager`` (DCP's own staging for ``async_save``),
kept alive across saves: its ``StateDictStager`` keeps, for every source storage (held
weakly), the host storage it copied it to, and copies into that storage again at the
next save. So repeated saves of the same model allocate nothing after the first (on
CUDA the buffers are pinned and the copies are issued without blocking, with one
synchronisation at the end), and views that share a storage (every run of one flat
shard, ``fully_shard``'s parameters inside their group's region) are copied once, as
that storage, and come out as views of its copy.

One thing is done around it: a ``DTensor`` is staged as its local tensor and rebuilt
on the copy with the same mesh, placements, shape and stride (the stager's deep copy of
a ``DTensor`` reads the wrapper's own storage, which is invalid for a ``DTensor`` whose
local tensor is a view at an offset, as ``fully_shard``'s are). Other values
(:class:`~ckpt._pieces.FlatPieces`, plain objects) are deep-copied by the stager, their
tensors staged like the rest, so a plain value changed after ``async_save`` returned
does not reach the checkpoint either.

The buffers hold one host copy of the last asynchronously saved state per process for
as long as the model's tensors live; :func:`release_staging_buffers` frees them.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

__all__ = ["release_staging_buffers", "stage"]


class _LocalOf:
    """A ``DTensor``'s local tensor while it is staged; ``index`` finds its layout."""

    def __init__(self, local: Tensor, index: int) -> None:
        self.local = local
        self.index = index


_Layout = tuple[Any, Any, torch.Size, tuple[int, ...]]  # mesh, placements, shape, stride


def _unwrap(value: Any, layouts: list[_Layout]) -> Any:
    if isinstance(value, DTensor):
        layouts.append((value.device_mesh, value.placements, value.shape, value.stride()))
        return _LocalOf(value.to_local().detach(), len(layouts) - 1)
    if isinstance(value, dict):
        return {k: _unwrap(v, layouts) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_unwrap(v, layouts) for v in value)
    return value


def _rewrap(value: Any, layouts: list[_Layout]) -> Any:
    if isinstance(value, _LocalOf):
        mesh, placements, shape, stride = layouts[value.index]
        return DTensor.from_local(
            value.local, mesh, placements, run_check=False, shape=shape, stride=stride
        )
    if isinstance(value, dict):
        return {k: _rewrap(v, layouts) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_rewrap(v, layouts) for v in value)
    return value


class _Buffers:
    """This process's stager (and so its buffers), made for CUDA or for the CPU."""

    lock = threading.Lock()
    stager: DefaultStager | None = None
    cuda: bool = False


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def stage(state_dict: dict[str, Any]) -> dict[str, Any]:
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
        layouts: list[_Layout] = []
        staged = _Buffers.stager.stage(_unwrap(state_dict, layouts))
    assert isinstance(staged, dict)
    return dict(_rewrap(staged, layouts))


def release_staging_buffers() -> None:
    """Free the host buffers that asynchronous saves reuse (the next one allocates anew).

    Call after the last asynchronous save has been waited for, e.g. when training ends.
    """
    with _Buffers.lock:
        if _Buffers.stager is not None:
            _Buffers.stager.close()
        _Buffers.stager = None
