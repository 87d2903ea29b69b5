"""State-dict values from other tools made loadable: ``ShardedTensor`` and tensor-likes.

The loaders in ``_wrappers.fsdp1_model`` and ``_wrappers.fsdp1_optim`` take plain tensors
and ``DTensor`` s. Two other kinds reach them through libraries built on torch's FSDP1:

* ``ShardedTensor`` (torch's older sharded type), e.g. from
  ``torch.distributed.checkpoint.optimizer.load_sharded_optimizer_state_dict``, which
  Lightning uses to resume a sharded optimizer state. It is a ``Tensor`` subclass
  whose ``__torch_function__`` refuses most operations, so it is converted first: to a
  ``DTensor`` over the same group when it is chunked on dimension 0 as ``torch.chunk``
  chunks it (FSDP1's and our sharded layout; no data moves), else to the full tensor
  (an all-reduce of each rank's shards placed into zeros: a collective).
* tensor-likes (``torch.overrides.is_tensor_like`` but not ``Tensor``), e.g. the lazy
  values of Lightning's checkpoint loader: materialised through their own
  ``__torch_function__`` (``torch.detach``), as ``nn.Module.load_state_dict`` does
  through ``copy_``.

Each value is converted when a loader reaches it, so a lazily loaded checkpoint is
read one unit (model) or one parameter (optimizer) at a time, and peak memory stays
what it is for plain tensors.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from ckpt._wrappers.sharded_chunks import chunk_bounds, chunk_dtensor

__all__ = ["LoadableState", "loadable"]

_SHARDED_TENSOR_MODULE = "torch.distributed._shard.sharded_tensor"


def loadable(value: Any, key: str = "") -> Any:
    """``value`` as a plain tensor or ``DTensor`` if it is a tensor of another kind.

    Anything else (plain tensors and DTensors included) comes back unchanged. A
    collective for a ``ShardedTensor`` that is not chunked like ours (every rank must
    convert the same values in the same order, as the loaders already do).
    """
    if isinstance(value, DTensor):
        return value
    if _is_sharded_tensor(value):
        return _from_sharded_tensor(value, key)
    if isinstance(value, Tensor) or not torch.overrides.is_tensor_like(value):
        return value
    loaded = torch.detach(value)  # runs the value's own __torch_function__: it loads
    if not isinstance(loaded, Tensor):
        raise TypeError(
            f"{key or 'a state-dict value'}: the tensor-like {type(value).__name__} did not "
            f"materialise into a tensor (torch.detach gave {type(loaded).__name__}); load the "
            "checkpoint eagerly (torch.load) and pass plain tensors"
        )
    return loaded


class LoadableState(Mapping[Any, Any]):
    """An optimizer state dict's ``"state"`` whose per-parameter entries convert on access.

    The loader looks parameters up one at a time, so each parameter's values are
    converted (and a lazy value read) only when its turn comes.
    """

    def __init__(self, state: Mapping[Any, Any]) -> None:
        self._state = state

    def __getitem__(self, key: Any) -> Any:
        entry = self._state[key]
        if not isinstance(entry, Mapping):
            return loadable(entry, str(key))
        return {k: loadable(v, f"{key}.{k}") for k, v in entry.items()}

    def __iter__(self) -> Iterator[Any]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


def _is_sharded_tensor(value: object) -> bool:
    module = sys.modules.get(_SHARDED_TENSOR_MODULE)  # loaded if one exists
    cls = getattr(module, "ShardedTensor", None) if module is not None else None
    return cls is not None and isinstance(value, cls)


def _from_sharded_tensor(value: Any, key: str) -> Tensor:
    group = value._process_group
    shape = torch.Size(value.size())
    shards = value.local_shards()
    local = shards[0].tensor if shards else None
    device = local.device if local is not None else torch.device("cpu")
    if _chunked_on_dim0(value, group, shape):
        start, end = chunk_bounds(shape[0], dist.get_world_size(group), dist.get_rank(group))
        if local is None and end == start:
            local = torch.empty((0, *shape[1:]), dtype=value.dtype, device=device)
        elif len(shards) != 1 or shards[0].metadata.shard_offsets[0] != start:
            raise ValueError(
                f"{key or 'a ShardedTensor'}: its metadata chunks dimension 0 over "
                f"{dist.get_world_size(group)} ranks, but this rank's local shards "
                f"({[tuple(s.metadata.shard_offsets) for s in shards]}) are not chunk "
                f"[{start}, {end}); the ShardedTensor is inconsistent across ranks"
            )
        assert local is not None
        return chunk_dtensor(local, shape, group)
    # Another layout: every rank places its shards into zeros and the sum is the tensor.
    full = torch.zeros(shape, dtype=value.dtype, device=device)
    for shard in shards:
        index = tuple(
            slice(o, o + s)
            for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True)
        )
        full[index] = shard.tensor.to(device)
    dist.all_reduce(full, group=group)
    return full


def _chunked_on_dim0(value: Any, group: Any, shape: torch.Size) -> bool:
    """Whether each rank's shard is its ``torch.chunk`` dimension-0 chunk, as FSDP1 and
    ours lay them out (decided from the global metadata only, so every rank agrees)."""
    if len(shape) == 0:
        return False
    world = dist.get_world_size(group)
    expected = [chunk_bounds(shape[0], world, r) for r in range(world)]
    found: dict[int, tuple[int, int]] = {}
    for m in value.metadata().shards_metadata:
        if any(o != 0 for o in m.shard_offsets[1:]) or list(m.shard_sizes[1:]) != list(shape[1:]):
            return False
        rank = (
            dist.get_group_rank(group, m.placement.rank())
            if group is not None
            else m.placement.rank()
        )
        if rank in found:
            return False
        found[rank] = (m.shard_offsets[0], m.shard_offsets[0] + m.shard_sizes[0])
    return all(
        found.get(r, (start, start)) == (start, end) for r, (start, end) in enumerate(expected)
    ) and all(end > start for start, end in found.values())
