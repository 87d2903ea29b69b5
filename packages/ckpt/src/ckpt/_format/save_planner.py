"""DCP's default save planner, taught three things a ckpt save needs.

* :class:`~ckpt._format.flat_pieces.FlatPieces` values (an fsdp rank's runs of parameters, see
  [Note: flat pieces]): DCP's planner looks shards up only on tensors, so this one
  asks the pieces for the box a write item names.
* Views written without a copy: DCP clones a tensor whose storage is larger than the
  tensor before ``torch.save`` (which writes a tensor's whole storage). The views a
  save hands over (pieces of a flat shard, ``fully_shard``'s ``DTensor`` locals inside
  their group's region) would each be cloned: a copy of the whole state, in new memory,
  at every save. Instead each is given a storage of exactly its bytes that aliases them
  (``UntypedStorage`` slicing), so ``torch.save`` writes them in place.
* A value one rank could not capture (a :class:`CaptureProblem` in its place) fails
  that rank's local planning step, which DCP shares with every rank (each raises the
  same ``CheckpointException``), instead of one rank raising alone while the others
  wait in the planning collective. The global step names a tensor whose parts do not cover it,
  or whose parts differ in dtype across ranks, before DCP's own check does in its terms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from ckpt._errors import CheckpointError
from ckpt._format.flat_pieces import FlatPieces

__all__ = [
    "CaptureError",
    "CaptureProblem",
    "CheckpointSavePlanner",
    "own_storage",
    "raise_capture_problems",
]


class CaptureError(CheckpointError, ValueError):
    """A rank's state cannot be saved as it is (e.g. optimizer state of an odd shape)."""


@dataclass(frozen=True)
class CaptureProblem:
    """In place of a value this rank cannot save: the save fails on every rank, saying so."""

    message: str


def raise_capture_problems(flat: Mapping[str, Any]) -> None:
    """Raise :class:`CaptureError` naming every :class:`CaptureProblem` among the values
    of a flattened state dict (in a planner's local step, so DCP reports it on every rank)."""
    problems = [f"{k}: {v.message}" for k, v in flat.items() if isinstance(v, CaptureProblem)]
    if problems:
        raise CaptureError("; ".join(problems))


def own_storage(tensor: Tensor) -> Tensor:
    """``tensor`` (a contiguous CPU view) over a storage of exactly its bytes, aliasing them.

    The result shares memory with ``tensor``; only the storage object differs, so that
    ``torch.save`` writes the view's bytes and nothing around them, and DCP, seeing a
    storage no larger than the tensor, does not clone it first.
    """
    t = tensor.detach()
    if t.device.type != "cpu" or type(t) is not Tensor or not t.is_contiguous():
        return t
    nbytes = t.numel() * t.element_size()
    storage = t.untyped_storage()
    if nbytes == 0 or storage.nbytes() == nbytes:
        return t
    begin = t.storage_offset() * t.element_size()
    exact = storage[begin : begin + nbytes]
    return torch.empty(0, dtype=t.dtype).set_(exact, 0, t.shape, t.stride())


class CheckpointSavePlanner(DefaultSavePlanner):
    """DCP's ``DefaultSavePlanner`` for ckpt's state dicts (see the module docstring)."""

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        raise_capture_problems(self.state_dict)

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, FlatPieces):
            return value.__get_tensor_shard__(index)
        return super().lookup_object(index)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type != WriteItemType.BYTE_IO and isinstance(object, Tensor):
            return own_storage(object)
        return super().transform_object(write_item, object)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        problems = _cover_problems(all_plans)
        if problems:
            raise CheckpointError("; ".join(problems))
        return super().create_global_plan(all_plans)


def _cover_problems(plans: Sequence[SavePlan]) -> list[str]:
    """Tensors whose parts (every rank's, replicas counted once) do not cover them exactly
    or disagree in dtype, named with the ranks that hold parts."""
    parts: dict[str, dict[tuple[int, ...], int]] = {}
    holders: dict[str, set[int]] = {}
    sizes: dict[str, torch.Size] = {}
    dtypes: dict[str, dict[torch.dtype, set[int]]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            data = item.tensor_data
            if item.type != WriteItemType.SHARD or data is None or data.chunk is None:
                continue
            fqn = item.index.fqn
            parts.setdefault(fqn, {})[tuple(data.chunk.offsets)] = math.prod(data.chunk.sizes)
            holders.setdefault(fqn, set()).add(rank)
            sizes[fqn] = data.size
            dtypes.setdefault(fqn, {}).setdefault(data.properties.dtype, set()).add(rank)
    problems = []
    for fqn, boxes in parts.items():
        want, have = math.prod(sizes[fqn]), sum(boxes.values())
        ranks = sorted(holders[fqn])
        if len(dtypes[fqn]) > 1:
            by_dtype = "; ".join(f"{d} on ranks {sorted(r)}" for d, r in dtypes[fqn].items())
            problems.append(f"{fqn}: its parts differ in dtype across ranks ({by_dtype})")
        elif want != have:
            problems.append(
                f"{fqn}: the ranks' parts cover {have} of its {want} elements (parts on ranks "
                f"{ranks}); every element must be held by some rank. For optimizer state this "
                f"means a rank holds its part of the parameter but no state for it: step the "
                f"optimizer on every rank before saving"
            )
    return problems
