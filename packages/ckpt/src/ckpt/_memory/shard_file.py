"""One rank's snapshot: its pieces of the state in DCP's data format, and their metadata.

[Note: a snapshot is one rank's checkpoint files]
A disk checkpoint is DCP's format: every rank writes its pieces into its own data file
(``__<rank>_0.distcp``: each tensor piece a ``torch.save`` record, each other value its
pickle) and the coordinator writes ``.metadata``, which lists every piece of every rank
and where its bytes lie. Writing ``.metadata`` needs every rank's plan: DCP gathers them
to the coordinator and scatters the result, two rounds and a commit per save. A
snapshot taken at every step cannot afford that, and it need not: each rank writes its
data file exactly as a disk save would, and beside it a *shard metadata*, DCP's
``Metadata`` for that rank's pieces alone (the same types, pointing into its own file).
The ``.metadata`` a disk save would have written is the union of the ranks' shard
metadata, so it is built only when a snapshot is loaded (:func:`merge_metadata`), from
the shard metadata of every original rank. A rank's snapshot therefore costs no
communication to write, and loading it is DCP's load with the same planner and the
same resharding as a disk load: the bytes each rank receives are the ones a disk load
would have read.

Values several ranks hold under one key (a plain tensor of a DDP model, the trainer's
JSON) are written by every rank that holds them; the merge keeps the lowest rank's
piece, as DCP keeps one.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.tensor import DTensor

from ckpt._errors import CheckpointError
from ckpt._format.flat_pieces import FlatPieces
from ckpt._format.safe_unpickling import unpickle_metadata
from ckpt._format.save_planner import CheckpointSavePlanner
from ckpt._format.tensor_blob import raw_bytes, template_for, without_record_crc

__all__ = [
    "ShardHeader",
    "ShardWriter",
    "data_file_name",
    "merge_metadata",
    "pickle_metadata",
    "read_descriptor",
    "write_descriptor",
]


def data_file_name(rank: int) -> str:
    """The name DCP gives rank ``rank``'s data file, which the shard metadata points at."""
    return f"__{rank}_0.distcp"


class ShardWriter:
    """Writes a rank's snapshots; keeps the plan of the last state structure it saw.

    DCP plans a save by walking every value (for a ``DTensor``, working out its local
    shape and global offset): a tenth of a snapshot's time at 30M parameters. A training
    loop snapshots the same structure every step, so the plan is kept and reused while
    every value's kind, shape, dtype and placement stay the same.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._key: tuple[Any, ...] | None = None
        self._plan: SavePlan | None = None

    def write(self, state_dict: dict[str, Any], stream: IO[bytes]) -> Metadata:
        """Write this rank's pieces of ``state_dict`` to ``stream`` as DCP's data file of
        its rank and return their shard metadata ([Note: a snapshot is one rank's
        checkpoint files]). ``stream`` is written from its current position; no
        collective."""
        planner = CheckpointSavePlanner()
        planner.set_up_planner(state_dict, None, is_coordinator=True)
        key = _structure(planner.state_dict)
        if key != self._key or self._plan is None:
            self._plan, self._key = planner.create_local_plan(), key
        plan = self._plan
        entries: dict[str, Any] = {}
        storage: dict[MetadataIndex, _StorageInfo] = {}
        name = data_file_name(self.rank)
        with without_record_crc():  # [Note: one pass over the bytes] in _format/writer.py
            for item in plan.items:
                data = planner.resolve_data(item)
                start = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)
                    stream.write(data.getbuffer())
                    entries[item.index.fqn] = BytesStorageMetadata()
                else:
                    assert isinstance(data, torch.Tensor) and item.tensor_data is not None
                    _write_tensor(data, stream)
                    td = item.tensor_data
                    assert td.chunk is not None
                    entry = entries.setdefault(
                        item.index.fqn, TensorStorageMetadata(td.properties, td.size, [])
                    )
                    entry.chunks.append(td.chunk)
                storage[item.index] = _StorageInfo(name, start, stream.tell() - start)
        return Metadata(
            state_dict_metadata=entries,
            planner_data=plan.planner_data,
            storage_data=storage,
            storage_meta=StorageMeta(),
        )


def _write_tensor(data: torch.Tensor, stream: IO[bytes]) -> None:
    """``torch.save(data, stream)``'s bytes, from a template where there is one ([Note:
    blob templates] in ``_format/tensor_blob.py``: the same bytes, a third of the time)."""
    chunk = data if data.device.type == "cpu" else data.cpu()
    template = template_for(chunk) if chunk.is_contiguous() else None
    if template is None:
        torch.save(chunk, stream)
        return
    stream.write(template.head)
    stream.write(raw_bytes(chunk))
    stream.write(template.tail)


def _structure(flat: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a local save plan depends on, per value of a flattened state dict."""
    out: list[Any] = []
    for fqn, value in flat.items():
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            out.append((fqn, tuple(value.shape), value.dtype, value.placements, id(mesh)))
        elif isinstance(value, torch.Tensor):
            out.append((fqn, "tensor", tuple(value.shape), value.dtype))
        elif isinstance(value, FlatPieces):
            out.append((fqn, "pieces", value.shape, value.start, value.local.numel()))
        else:
            out.append((fqn, "bytes"))
    return tuple(out)


def merge_metadata(shards: list[Metadata]) -> Metadata:
    """The ``.metadata`` a disk save of the same state would have written: the union of
    every original rank's shard metadata, in rank order (``shards[r]`` is rank r's); a
    piece held by several ranks is taken from the lowest."""
    entries: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    planner_data: dict[str, Any] = {}
    for shard in shards:
        planner_data.update(shard.planner_data or {})
        for fqn, entry in shard.state_dict_metadata.items():
            if isinstance(entry, BytesStorageMetadata):
                if fqn not in entries:
                    entries[fqn] = entry
                    storage[MetadataIndex(fqn)] = _lookup(shard, MetadataIndex(fqn))
                continue
            assert isinstance(entry, TensorStorageMetadata)
            merged = entries.setdefault(
                fqn, TensorStorageMetadata(entry.properties, entry.size, [])
            )
            if merged.size != entry.size or merged.properties.dtype != entry.properties.dtype:
                raise CheckpointError(
                    f"snapshot: the ranks' shards of {fqn} disagree in shape or dtype "
                    f"({tuple(merged.size)} {merged.properties.dtype} against "
                    f"{tuple(entry.size)} {entry.properties.dtype})"
                )
            have = {tuple(c.offsets) for c in merged.chunks}
            for chunk in entry.chunks:
                if tuple(chunk.offsets) in have:
                    continue
                index = MetadataIndex(fqn, chunk.offsets, len(merged.chunks))
                merged.chunks.append(ChunkStorageMetadata(chunk.offsets, chunk.sizes))
                storage[index] = _lookup(shard, index)
    return Metadata(
        state_dict_metadata=entries,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=StorageMeta(),
    )


def _lookup(shard: Metadata, index: MetadataIndex) -> Any:
    assert shard.storage_data is not None
    return shard.storage_data[index]  # MetadataIndex compares without its index hint


@dataclass(frozen=True)
class ShardHeader:
    """What a snapshot file is, readable without unpickling anything."""

    generation: str  # the job incarnation that wrote it ([Note: whose snapshots])
    step: int
    rank: int  # the original rank whose pieces the data file holds
    world_size: int  # of the job that took the snapshot
    data_bytes: int  # the data file's length
    host: str  # the machine the original rank ran on
    saved_by: Mapping[str, str]  # state entry -> kind, as a disk manifest records it
    created: float  # when it was taken (seconds since the epoch)

    def to_json(self) -> str:
        return json.dumps(
            {
                "generation": self.generation,
                "step": self.step,
                "rank": self.rank,
                "world_size": self.world_size,
                "data_bytes": self.data_bytes,
                "host": self.host,
                "saved_by": dict(self.saved_by),
                "created": self.created,
            },
            sort_keys=True,
        )


def write_descriptor(header: ShardHeader, metadata: bytes) -> bytes:
    """A descriptor's bytes: the header as one JSON line, then the pickled shard
    metadata (``metadata``, from :func:`pickle_metadata`)."""
    return header.to_json().encode() + b"\n" + metadata


def pickle_metadata(metadata: Metadata) -> bytes:
    """The shard metadata as DCP pickles ``.metadata`` (only DCP's own types)."""
    import pickle

    return pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)


def read_descriptor(data: bytes, where: Path) -> tuple[ShardHeader, Metadata]:
    """The header and shard metadata of a descriptor (``where`` names it in errors); the
    metadata is unpickled admitting DCP's types only, as a disk checkpoint's is."""
    line, sep, rest = data.partition(b"\n")
    try:
        raw = json.loads(line)
        header = ShardHeader(
            generation=str(raw["generation"]),
            step=int(raw["step"]),
            rank=int(raw["rank"]),
            world_size=int(raw["world_size"]),
            data_bytes=int(raw["data_bytes"]),
            host=str(raw["host"]),
            saved_by={str(k): str(v) for k, v in dict(raw["saved_by"]).items()},
            created=float(raw["created"]),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"snapshot {where}: unreadable header ({e})") from None
    if not sep:
        raise CheckpointError(f"snapshot {where}: no shard metadata after the header")
    metadata = unpickle_metadata(io.BytesIO(rest), where.parent, where.name)
    return header, metadata
