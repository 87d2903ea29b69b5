"""A tensor of which this rank holds a run of elements, written to DCP as it lies.

[Note: flat pieces]
An fsdp unit keeps its parameters flattened and cut into equal shards, so a rank holds
``param.reshape(-1)[start:end]`` of a parameter: a run of its row-major elements that
may start and end in the middle of a row. The SHARDED state dict turns those runs into
``torch.chunk`` rows (``_wrappers/fsdp1_unit_exchange.py``), which takes an all-to-all
per unit and a
copy of every byte. A checkpoint does not need that: DCP stores each tensor as a list
of boxes (an offset and a size per dimension) from any ranks, and reads by overlap, so
any box cover of a tensor loads into any layout (torch's FSDP1, ``fully_shard``, ours
at another world size). A run of row-major elements is such a cover: at most
``2 * ndim - 1`` boxes (the tail of its first row, whole rows, the head of its last
row, recursively for the inner dimensions), each itself contiguous in memory, so each
box is a view of the rank's own shard. :class:`FlatPieces` is that run;
:func:`run_boxes` is the cover (a pure function of the shape and the run, cached).

What this buys at save: no exchange between ranks, no copy (a synchronous save writes
the shard's memory as it is; an asynchronous one copies the shard once into a host
buffer), and a rank writes exactly the bytes it holds. ``FlatPieces`` speaks DCP's
checkpointable protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``); DCP's default planner looks a shard up only on tensors, so
ckpt's save planner (``_format/save_planner.py``) asks the pieces directly.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["Box", "FlatPieces", "run_boxes"]


@dataclass(frozen=True)
class Box:
    """One box of a run: ``offsets``/``sizes`` per dimension of the whole tensor; its
    elements are ``local[at : at + numel]`` of the run, contiguous and row-major."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    at: int  # where the box starts in the run (0 for its first element)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def _cover(
    shape: tuple[int, ...],
    lo: int,
    hi: int,
    *,
    lead: tuple[int, ...],
    base: int,
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]],
) -> None:
    """Boxes of elements ``[lo, hi)`` of a sub-tensor of ``shape`` whose element 0 is flat
    element ``base`` of the whole tensor; ``lead`` fixes the outer dimensions. Appends
    ``(offsets, sizes, flat start)``, in flat order."""
    if lo >= hi:
        return
    ones = (1,) * len(lead)
    if not shape:  # one element
        out.append((lead, ones, base))
        return
    row = math.prod(shape[1:])  # elements per index of the first dimension
    rest_zero = (0,) * (len(shape) - 1)
    first, last = lo // row, (hi - 1) // row
    if first == last and hi - lo != row:  # inside one row, not all of it
        at = first * row
        _cover(shape[1:], lo - at, hi - at, lead=(*lead, first), base=base + at, out=out)
        return
    whole_from = first
    if lo % row:  # the tail of the first row
        _cover(shape[1:], lo % row, row, lead=(*lead, first), base=base + first * row, out=out)
        whole_from = first + 1
    whole_to = hi // row
    if whole_to > whole_from:  # whole rows
        out.append(
            (
                (*lead, whole_from, *rest_zero),
                (*ones, whole_to - whole_from, *shape[1:]),
                base + whole_from * row,
            )
        )
    if hi % row:  # the head of the last row
        _cover(shape[1:], 0, hi % row, lead=(*lead, whole_to), base=base + whole_to * row, out=out)


@functools.lru_cache(maxsize=8192)
def run_boxes(shape: tuple[int, ...], start: int, end: int) -> tuple[Box, ...]:
    """The boxes covering flat elements ``[start, end)`` of a row-major tensor of
    ``shape``, in flat order (see [Note: flat pieces]). ``()`` for an empty run."""
    if not 0 <= start <= end <= math.prod(shape):
        raise ValueError(f"run [{start}, {end}) is outside a tensor of shape {shape}")
    found: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    _cover(shape, start, end, lead=(), base=0, out=found)
    return tuple(Box(offsets, sizes, flat - start) for offsets, sizes, flat in found)


@dataclass(frozen=True, eq=False)
class FlatPieces:
    """This rank's part of a tensor of ``shape``: the row-major run ``[start, end)``.

    ``local`` (1-D) is ``full.reshape(-1)[start:end]``; it may be a view of the live
    shard (a synchronous save writes it as it is). See [Note: flat pieces].
    """

    local: Tensor  # 1-D, end - start elements
    shape: torch.Size  # the whole tensor's
    start: int  # flat index of local[0] in the whole tensor

    @property
    def end(self) -> int:
        return self.start + self.local.numel()

    @property
    def boxes(self) -> tuple[Box, ...]:
        return run_boxes(tuple(self.shape), self.start, self.end)

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def box_tensor(self, offsets: tuple[int, ...]) -> Tensor:
        """The elements of the box at ``offsets``, shaped as the box (a view of ``local``)."""
        for box in self.boxes:
            if box.offsets == offsets:
                return self.local[box.at : box.at + box.numel].view(box.sizes)
        raise ValueError(
            f"no box at offsets {list(offsets)} in this rank's run [{self.start}, {self.end}) "
            f"of a tensor of shape {tuple(self.shape)}"
        )

    # DCP's checkpointable protocol (what DTensor implements), used by ckpt's planners.

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.local.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(box.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes)
                    ),
                    properties=properties,
                    size=torch.Size(self.shape),
                ),
            )
            for box in self.boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))
            for box in self.boxes
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        """The box a DCP write or read item names (ckpt's planners ask for it here:
        DCP's look a shard up only on tensors)."""
        if index.offset is None:
            raise ValueError(f"{index.fqn}: a box of this rank's run needs its offsets")
        return self.box_tensor(tuple(index.offset))
