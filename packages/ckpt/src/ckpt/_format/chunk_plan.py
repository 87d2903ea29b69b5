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
    """What the tables say of one key, while planning: the first rank's kind, dtype and
    shape (another rank's that differ make the key ``odd``, described afterwards), and
    each box's sizes and holders."""

    path: KeyPath
    kind: int
    dtype: int
    shape: tuple[int, ...]
    boxes: dict[tuple[int, ...], tuple[tuple[int, ...], list[tuple[int, int]]]]
    # offsets -> (sizes, [(rank, row) of every holder])
    odd: bool = False


def plan_chunks(tables: Sequence[ChunkTable]) -> ChunkPlan:
    """The plan of a save whose rank ``r`` holds ``tables[r]``; raises
    :class:`ChunkPlanError` naming every key that does not fit together."""
    seen: dict[str, _Seen] = {}
    for rank, table in enumerate(tables):
        keys = table.keys()
        for i, (k, kind, dtype, offsets, sizes, shape) in enumerate(table.items()):
            name = keys[k]
            entry = seen.get(name)
            if entry is None:
                entry = seen[name] = _Seen(table.paths[k], kind, dtype, shape, {})
            elif kind != entry.kind or dtype != entry.dtype or shape != entry.shape:
                entry.odd = True
            box = entry.boxes.get(offsets)
            if box is None:
                entry.boxes[offsets] = (sizes, [(rank, i)])
                continue
            if box[0] != sizes:
                entry.odd = True
            box[1].append((rank, i))
    problems = []
    for name, entry in seen.items():
        if entry.odd:
            problems += _odd_problems(name, tables)
        elif entry.kind != BYTES:
            problems += _cover_problems(name, entry)
    if problems:
        raise ChunkPlanError("; ".join(problems))
    return _assign(seen, len(tables))


def _ranks(by: Mapping[Any, set[int]], say: Callable[[Any], object]) -> str:
    return "; ".join(f"{say(k)} on ranks {sorted(r)}" for k, r in by.items())


def _odd_problems(name: str, tables: Sequence[ChunkTable]) -> list[str]:
    """What differs about ``name`` across the ranks (a second look, for the message)."""
    kinds: dict[int, set[int]] = {}
    dtypes: dict[int, set[int]] = {}
    shapes: dict[tuple[int, ...], set[int]] = {}
    boxes: dict[tuple[int, ...], dict[tuple[int, ...], set[int]]] = {}
    for rank, table in enumerate(tables):
        keys = table.keys()
        for k, kind, dtype, offsets, sizes, shape in table.items():
            if keys[k] == name:
                kinds.setdefault(kind, set()).add(rank)
                dtypes.setdefault(dtype, set()).add(rank)
                shapes.setdefault(shape, set()).add(rank)
                boxes.setdefault(offsets, {}).setdefault(sizes, set()).add(rank)
    if len(kinds) > 1:
        said = _ranks(kinds, lambda k: "a value" if k == BYTES else "a tensor")
        return [f"{name}: it is a tensor on some ranks and a value on others ({said})"]
    if len(dtypes) > 1:
        return [f"{name}: its parts differ in dtype across ranks ({_ranks(dtypes, dtype_of)})"]
    if len(shapes) > 1:
        return [f"{name}: its global shape differs across ranks ({_ranks(shapes, list)})"]
    return [
        f"{name}: the ranks hold parts at {list(offsets)} of different sizes "
        f"({_ranks(sizes, list)})"
        for offsets, sizes in boxes.items()
        if len(sizes) > 1
    ]


def _cover_problems(name: str, entry: _Seen) -> list[str]:
    """Whether a tensor's parts (every rank's, replicas counted once) cover it exactly."""
    want = math.prod(entry.shape)
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
        itemsize = 0 if entry.kind == BYTES else dtype_of(entry.dtype).itemsize
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
        keys[name] = KeyPlan(entry.path, entry.kind, entry.dtype, entry.shape, tuple(chunks))
    return ChunkPlan(keys, tuple(tuple(sorted(w)) for w in writes), nbytes)
