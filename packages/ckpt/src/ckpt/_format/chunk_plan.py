"""Who writes which chunk of a save, from every rank's table; and what is wrong with it.

Rank 0 plans a save from the ranks' :class:`~ckpt._format.chunk_table.ChunkTable` s
([Note: flat coordination] in ``_format/chunk_table.py``); a pure function of them, so
the same tables give the same plan, and a plan is kept while they stay the same:

* a chunk (a key and its offsets) held by one rank is written by it; one held by
  several (a replicated tensor, a value every rank has, an ``HSDP`` replica) by the
  holder with the fewest bytes to write so far, biggest chunks first, ties to the
  lowest rank, so replicated state spreads over the ranks;
* a tensor's chunks must agree in dtype and global shape on every rank and cover it
  exactly (every element held by some rank), and a key is a tensor everywhere or a
  value everywhere; what does not is named, with the ranks, in a
  :class:`ChunkPlanError` before anything is written.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpt._errors import CheckpointError
from ckpt._format.chunk_table import BYTES, ChunkTable, KeyPath, dtype_of

__all__ = ["Chunk", "ChunkPlan", "ChunkPlanError", "KeyPlan", "plan_chunks"]

# Bytes torch.save adds around a tensor's data (its zip framing, about 1.5 KiB), and what
# a pickled value is taken to need: for the free-space check, an estimate.
_PER_ITEM = 1536


class ChunkPlanError(CheckpointError, ValueError):
    """The ranks' states do not make one checkpoint (see :func:`plan_chunks`)."""


@dataclass(frozen=True)
class Chunk:
    """A chunk of a key as saved: its box, and the rank (and its row) that writes it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int
    row: int


@dataclass(frozen=True)
class KeyPlan:
    """One key of the checkpoint: a tensor (dtype, global shape, chunks in order) or a
    pickled value (one chunk, ``shape`` ``()``)."""

    path: KeyPath
    kind: int
    dtype: int
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class ChunkPlan:
    """A save's plan: every key, and the rows each rank writes."""

    keys: dict[str, KeyPlan]  # in the order the ranks' tables first name them
    writes: tuple[tuple[int, ...], ...]  # per rank: its rows to write, ascending
    nbytes: int  # about how many bytes the save writes


@dataclass
class _Seen:
    """What the tables say of one key, while planning."""

    path: KeyPath
    kinds: dict[int, set[int]]  # kind -> ranks
    dtypes: dict[int, set[int]]  # dtype code -> ranks
    shapes: dict[tuple[int, ...], set[int]]  # global shape -> ranks
    boxes: dict[tuple[int, ...], tuple[tuple[int, ...], list[tuple[int, int]]]]
    # offsets -> (sizes, [(rank, row) of every holder])


def plan_chunks(tables: Sequence[ChunkTable]) -> ChunkPlan:
    """The plan of a save whose rank ``r`` holds ``tables[r]``; raises
    :class:`ChunkPlanError` naming every key that does not fit together."""
    seen: dict[str, _Seen] = {}
    problems: list[str] = []
    for rank, table in enumerate(tables):
        keys = table.keys()
        for i, row in enumerate(table.decoded()):
            name = keys[row.key]
            entry = seen.get(name)
            if entry is None:
                entry = seen[name] = _Seen(table.paths[row.key], {}, {}, {}, {})
            entry.kinds.setdefault(row.kind, set()).add(rank)
            entry.dtypes.setdefault(row.dtype, set()).add(rank)
            entry.shapes.setdefault(row.shape, set()).add(rank)
            sizes, holders = entry.boxes.setdefault(row.offsets, (row.sizes, []))
            if sizes != row.sizes:
                problems.append(
                    f"{name}: rank {rank} holds a part at {list(row.offsets)} of sizes "
                    f"{list(row.sizes)}, rank {holders[0][0]} one of sizes {list(sizes)}"
                )
            holders.append((rank, i))
    for name, entry in seen.items():
        problems += _key_problems(name, entry)
    if problems:
        raise ChunkPlanError("; ".join(problems))
    return _assign(seen, len(tables))


def _ranks(by: Mapping[Any, set[int]], say: Callable[[Any], object]) -> str:
    return "; ".join(f"{say(k)} on ranks {sorted(r)}" for k, r in by.items())


def _key_problems(name: str, entry: _Seen) -> list[str]:
    """What is wrong with one key across the ranks (nothing, usually)."""
    if len(entry.kinds) > 1:
        kinds = _ranks(entry.kinds, lambda k: "a value" if k == BYTES else "a tensor")
        return [f"{name}: it is a tensor on some ranks and a value on others ({kinds})"]
    if BYTES in entry.kinds:
        return []
    if len(entry.dtypes) > 1:
        by_dtype = _ranks(entry.dtypes, dtype_of)
        return [f"{name}: its parts differ in dtype across ranks ({by_dtype})"]
    if len(entry.shapes) > 1:
        by_shape = _ranks(entry.shapes, list)
        return [f"{name}: its global shape differs across ranks ({by_shape})"]
    [shape] = entry.shapes
    want = math.prod(shape)
    have = sum(math.prod(sizes) for sizes, _ in entry.boxes.values())
    if want == have:
        return []
    ranks = sorted({r for _, holders in entry.boxes.values() for r, _ in holders})
    return [
        f"{name}: the ranks' parts cover {have} of its {want} elements (parts on ranks "
        f"{ranks}); every element must be held by some rank. For optimizer state this "
        f"means a rank holds its part of the parameter but no state for it: step the "
        f"optimizer on every rank before saving"
    ]


def _assign(seen: dict[str, _Seen], world_size: int) -> ChunkPlan:
    """Pick each chunk's writer (see the module docstring) and lay out the plan."""
    load = [0] * world_size
    writer: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}
    shared: list[tuple[int, str, tuple[int, ...]]] = []
    nbytes = 0
    for name, entry in seen.items():
        itemsize = 0 if BYTES in entry.kinds else dtype_of(next(iter(entry.dtypes))).itemsize
        for offsets, (sizes, holders) in entry.boxes.items():
            size = math.prod(sizes) * itemsize + _PER_ITEM
            nbytes += size
            if len(holders) == 1:
                writer[(name, offsets)] = holders[0]
                load[holders[0][0]] += size
            else:
                shared.append((size, name, offsets))
    for size, name, offsets in sorted(shared, key=lambda s: -s[0]):
        holders = seen[name].boxes[offsets][1]
        chosen = min(holders, key=lambda h: (load[h[0]], h[0]))
        writer[(name, offsets)] = chosen
        load[chosen[0]] += size
    writes: list[list[int]] = [[] for _ in range(world_size)]
    keys: dict[str, KeyPlan] = {}
    for name, entry in seen.items():
        chunks = []
        for offsets, (sizes, _) in entry.boxes.items():
            rank, row = writer[(name, offsets)]
            writes[rank].append(row)
            chunks.append(Chunk(offsets, sizes, rank, row))
        [kind] = entry.kinds
        [dtype] = entry.dtypes
        [shape] = entry.shapes
        keys[name] = KeyPlan(entry.path, kind, dtype, shape, tuple(chunks))
    return ChunkPlan(keys, tuple(tuple(sorted(w)) for w in writes), nbytes)
