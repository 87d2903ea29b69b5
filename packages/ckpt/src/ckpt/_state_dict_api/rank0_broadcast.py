"""A full state dict that only rank 0 holds, sent to every rank: ``broadcast_from_rank0``.

``StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)`` lets rank 0 alone
read a full checkpoint (``torch.load`` of a consolidated file, say) and every rank load
it. :func:`broadcast_from_rank0` does the sending in two steps:

1. rank 0 describes the state dict, its nesting, its non-tensor values and each
   tensor's shape and dtype (0-dim tensors travel whole), and every rank receives
   that description in one object broadcast;
2. the tensors follow one broadcast each, in the description's order, and each rank
   passes every tensor it receives to ``keep`` at once, which returns what the rank
   holds on to: its ``Shard(0)`` chunk for an fsdp parameter, nothing for an
   optimizer state that another ZeRO rank owns, the tensor itself otherwise.

So besides rank 0's dict no rank ever holds more than one full tensor plus what it
keeps. A value rank 0 cannot send whole (a ``DTensor`` or ``ShardedTensor``: the dict
is not a full one) stops every rank with the same error before any tensor moves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from ckpt._comm import Comm, on_device

__all__ = ["DROP", "Path", "broadcast_from_rank0"]

# The keys leading to a value: ("blocks.0.fc1.weight",) or ("state", fqn, "exp_avg").
Path = tuple[Any, ...]


class _Drop:
    def __repr__(self) -> str:
        return "DROP"


DROP: Any = _Drop()
"""What ``keep`` returns for a tensor this rank does not need: its key is left out."""


@dataclass(frozen=True)
class _TensorSpec:
    """A tensor rank 0 is about to broadcast."""

    shape: torch.Size
    dtype: torch.dtype


def _describe(value: Any, path: Path, what: str) -> Any:
    """The description of ``value`` that rank 0 sends first (see the module docstring)."""
    if isinstance(value, Mapping):
        return {k: _describe(v, (*path, k), what) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_describe(v, (*path, i), what) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, DTensor) or (
        isinstance(value, Tensor) and type(value).__name__ == "ShardedTensor"
    ):
        name = ".".join(str(p) for p in path)
        raise ValueError(
            f"{what}: broadcast_from_rank0=True sends rank 0's full state dict to every "
            f"rank, but {name} on rank 0 is a {type(value).__name__} (a sharded value); "
            "pass the full state dict (full_state_dict=True when it was made), or load "
            "sharded state dicts on every rank without broadcast_from_rank0"
        )
    if isinstance(value, Tensor) and value.dim() > 0:
        return _TensorSpec(value.shape, value.dtype)
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    return value


@dataclass(frozen=True)
class _Receiver:
    """Rebuilds the described structure, receiving (rank 0: sending) each tensor in turn."""

    keep: Callable[[Path, Tensor], Any]
    device: torch.device
    is_source: bool  # rank 0: ``value`` holds the tensors, which it sends

    def __call__(self, spec: Any, value: Any, path: Path) -> Any:
        if isinstance(spec, dict):
            out = {}
            for k, sub in spec.items():
                kept = self(sub, value[k] if self.is_source else None, (*path, k))
                if kept is not DROP:
                    out[k] = kept
            return out
        if isinstance(spec, (list, tuple)):
            items = [
                self(sub, value[i] if self.is_source else None, (*path, i))
                for i, sub in enumerate(spec)
            ]
            return items if isinstance(spec, list) else tuple(items)
        if not isinstance(spec, _TensorSpec):
            return spec
        if self.is_source:
            tensor = value.detach().to(self.device)
            if tensor.data_ptr() == value.data_ptr() and tensor.numel():
                tensor = tensor.clone()  # what ``keep`` keeps must not alias rank 0's dict
        else:
            tensor = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
        dist.broadcast(tensor, src=0)
        return self.keep(path, tensor)


def broadcast_from_rank0(
    state_dict: Any, keep: Callable[[Path, Tensor], Any], device: torch.device, what: str
) -> Any:
    """Rank 0's ``state_dict`` on every rank, each tensor reduced to what ``keep`` returns.

    A collective over the default process group: call it on every rank; the other
    ranks' ``state_dict`` is ignored. ``device`` is where the tensors travel (the CPU
    for gloo, the rank's CUDA device for NCCL). ``keep(path, tensor)`` runs on every
    rank, rank 0 included, for every tensor of one or more dimensions; it may keep
    ``tensor`` (a fresh copy, never rank 0's own), a part of it, or :data:`DROP`.
    """
    comm = Comm.of(None)
    with on_device(device):
        spec = comm.run_on_coordinator(
            "describe the state dict to broadcast", lambda: _describe(state_dict, (), what)
        )
    return _Receiver(keep, device, comm.is_coordinator)(spec, state_dict, ())
