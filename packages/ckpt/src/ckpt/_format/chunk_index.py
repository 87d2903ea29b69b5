"""Where every chunk of a checkpoint lies: DCP's ``.metadata`` and ckpt's compact index.

Rank 0 builds both at the commit of a save from its plan
(``_format/chunk_plan.py``) and the byte ranges each rank wrote
([Note: flat coordination] in ``_format/chunk_table.py``):

* DCP's ``Metadata`` (pickled to ``.metadata``), which torch's ``dcp.load`` and
  ckpt's tools read: a ``TensorStorageMetadata`` per tensor with its chunks, a
  ``BytesStorageMetadata`` per pickled value, a ``_StorageInfo`` (file, offset, length)
  per chunk, and the keys' paths as DCP's planner data. Equal sizes, offsets and
  properties are one object each, so the pickle's memo writes them once (the pickle
  of 48,000 chunks: 6.7 MB and 0.72 s; shared, 5.2 MB and 0.5 s);
* the index (``ckpt-index.bin``): per key its kind, dtype and shape, per chunk its
  box, file, byte range and where its raw bytes start ([Note: blob templates] in
  ``_format/tensor_blob.py``), as a JSON header and one int64 table, so a load reads
  it with no unpickling and reads the raw bytes of what it needs straight into its
  tensors (``_format/chunk_reader.py``).

The manifest covers the index like every other file, so a load trusts it only after
the checksums (or under ``verify=False``, as it trusts ``.metadata``).
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpt._errors import CheckpointError, UnsafeCheckpointError, file_problem
from ckpt._format.chunk_plan import ChunkPlan
from ckpt._format.chunk_table import BYTES, dtype_of

__all__ = [
    "INDEX_NAME",
    "ChunkIndex",
    "IndexedChunk",
    "IndexedKey",
    "Stored",
    "data_file_name",
    "dcp_metadata",
    "encode_index",
    "read_index",
]

INDEX_NAME = "ckpt-index.bin"
_MAGIC = b"CKI1"
_HEAD = "<4sQQ"  # magic, header bytes, rows


def data_file_name(rank: int) -> str:
    """Rank ``rank``'s data file, named as DCP names it."""
    return f"__{rank}_0.distcp"


# Where one written item lies in its rank's data file: (blob offset, blob length, the
# absolute offset of its raw bytes, -1 for a pickled value).
Stored = tuple[int, int, int]


def _placed(plan: ChunkPlan, stored: Sequence[Sequence[Stored]]) -> dict[tuple[int, int], Stored]:
    """(rank, row) -> where that rank wrote it."""
    return {
        (rank, row): where
        for rank, rows in enumerate(plan.writes)
        for row, where in zip(rows, stored[rank], strict=True)
    }


def dcp_metadata(plan: ChunkPlan, stored: Sequence[Sequence[Stored]]) -> Metadata:
    """DCP's metadata of the saved checkpoint (see the module docstring)."""
    placed = _placed(plan, stored)
    shared: dict[tuple[int, ...], torch.Size] = {}

    def size(values: tuple[int, ...]) -> torch.Size:
        found = shared.get(values)
        if found is None:
            found = shared[values] = torch.Size(values)
        return found

    properties: dict[int, TensorProperties] = {}
    files = [data_file_name(r) for r in range(len(plan.writes))]
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for name, key in plan.keys.items():
        if key.kind == BYTES:
            state[name] = BytesStorageMetadata()
            [chunk] = key.chunks
            offset, length, _ = placed[(chunk.rank, chunk.row)]
            storage[MetadataIndex(name)] = _StorageInfo(files[chunk.rank], offset, length)
            continue
        props = properties.get(key.dtype)
        if props is None:
            props = properties[key.dtype] = TensorProperties(dtype=dtype_of(key.dtype))
        chunks = []
        for i, chunk in enumerate(key.chunks):
            at = size(chunk.offsets)
            chunks.append(ChunkStorageMetadata(offsets=at, sizes=size(chunk.sizes)))
            offset, length, _ = placed[(chunk.rank, chunk.row)]
            storage[MetadataIndex(name, at, i)] = _StorageInfo(files[chunk.rank], offset, length)
        state[name] = TensorStorageMetadata(properties=props, size=size(key.shape), chunks=chunks)
    planner_data = {name: key.path for name, key in plan.keys.items()}
    return Metadata(state_dict_metadata=state, planner_data=planner_data, storage_data=storage)


def encode_index(plan: ChunkPlan, stored: Sequence[Sequence[Stored]]) -> bytes:
    """The index file's bytes (see the module docstring)."""
    placed = _placed(plan, stored)
    width = max((len(k.shape) for k in plan.keys.values()), default=0)
    pad = (0,) * width
    keys = []
    rows = []
    for name, key in plan.keys.items():
        dtype = str(dtype_of(key.dtype)) if key.kind != BYTES else ""
        keys.append([name, key.kind, dtype, list(key.shape), len(key.chunks)])
        for chunk in key.chunks:
            offset, length, data_at = placed[(chunk.rank, chunk.row)]
            box = [*(*chunk.offsets, *pad)[:width], *(*chunk.sizes, *pad)[:width]]
            rows.append([chunk.rank, offset, length, data_at, *box])
    header = json.dumps(
        {
            "byteorder": sys.byteorder,
            "width": width,
            "files": [data_file_name(r) for r in range(len(plan.writes))],
            "keys": keys,
        }
    ).encode()
    body = array("q", [v for row in rows for v in row]).tobytes()
    return struct.pack(_HEAD, _MAGIC, len(header), len(rows)) + header + body


@dataclass(frozen=True)
class IndexedChunk:
    """One saved chunk: its box and the byte range of its blob; ``data_at`` is where its
    raw bytes start (-1 for a pickled value)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int
    data_at: int


@dataclass(frozen=True)
class IndexedKey:
    """One key of the checkpoint as the index records it."""

    kind: int
    dtype: torch.dtype | None  # None for a pickled value
    shape: tuple[int, ...]
    chunks: tuple[IndexedChunk, ...]


@dataclass(frozen=True)
class ChunkIndex:
    """A checkpoint's index, read: its keys in order, and whether its raw bytes are in
    this machine's byte order (else a load reads through ``torch.load``)."""

    keys: dict[str, IndexedKey]
    native: bool


_DTYPE_NAMES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def read_index(directory: Path) -> ChunkIndex:
    """The index of a checkpoint; a damaged one is a ``CorruptCheckpointError``."""
    path = directory / INDEX_NAME
    try:
        blob = path.read_bytes()
        magic, header_len, count = struct.unpack_from(_HEAD, blob)
        if magic != _MAGIC:
            raise ValueError("not a ckpt index")
        at = struct.calcsize(_HEAD)
        header = json.loads(blob[at : at + header_len])
        width = int(header["width"])
        step = 4 + 2 * width
        table = array("q")
        table.frombytes(blob[at + header_len : at + header_len + 8 * step * count])
        if len(table) != step * count:
            raise ValueError(f"{len(table)} values for {count} chunks")
        values = table.tolist()
        rows = [values[i : i + step] for i in range(0, len(values), step)]
        files = [str(f) for f in header["files"]]
        for f in files:
            if Path(f).name != f or f in ("", ".", "..") or "\\" in f:
                raise UnsafeCheckpointError(
                    directory,
                    INDEX_NAME,
                    f"a data file path {f!r}",
                    "ckpt names its data files inside the checkpoint directory; this one is not",
                )
        keys: dict[str, IndexedKey] = {}
        i = 0
        for name, kind, dtype, shape, n in header["keys"]:
            chunks = []
            for row in rows[i : i + n]:
                nd = len(shape) if kind != BYTES else 0
                chunks.append(
                    IndexedChunk(
                        tuple(row[4 : 4 + nd]),
                        tuple(row[4 + width : 4 + width + nd]),
                        files[row[0]],
                        row[1],
                        row[2],
                        row[3],
                    )
                )
            i += n
            keys[str(name)] = IndexedKey(
                int(kind),
                _DTYPE_NAMES[dtype] if kind != BYTES else None,
                tuple(shape),
                tuple(chunks),
            )
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, struct.error, RuntimeError) as e:
        raise file_problem(
            directory, INDEX_NAME, "unreadable", f"{type(e).__name__}: {e}"
        ) from None
    return ChunkIndex(keys, header.get("byteorder") == sys.byteorder)
