"""A checkpoint read without a process group: what it holds, one tensor at a time.

:class:`CheckpointReader` opens a committed ckpt checkpoint or a plain DCP directory
(written by torch's FSDP1/FSDP2 or ``torch.distributed.checkpoint.save``, no manifest)
read-only. Everything goes through ``_format.safe_unpickling`` ([Note: no code from a
checkpoint]): the metadata with DCP's types only, non-tensor values and tensor chunks
with ``weights_only``. Tensors are read chunk by chunk, as saved (a DTensor's shards,
a rank's rows, the boxes of an fsdp rank's runs: [Note: flat pieces] in
``_format/flat_pieces.py``), so a caller can stream a checkpoint larger than memory; see
:meth:`CheckpointReader.iter_row_blocks`.
"""

from __future__ import annotations

import io
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ckpt._errors import CorruptCheckpointError, NotACheckpointError, file_problem
from ckpt._format import layout
from ckpt._format.manifest import MANIFEST_NAME, Manifest, read_manifest
from ckpt._format.safe_unpickling import (
    METADATA_NAME,
    SafeGlobals,
    load_object,
    read_metadata,
    read_slice,
)

__all__ = ["CheckpointReader", "TensorInfo"]

# DCP names rank r's data files "__<r>_<i>.distcp".
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint: global shape and dtype, and how it was split."""

    key: str  # DCP's flattened key, e.g. "model.layers.0.weight"
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (offsets, sizes) each

    @property
    def numel(self) -> int:
        """Elements of the whole tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor in its saved dtype."""
        return self.numel * self.dtype.itemsize

    @property
    def rows_tiled(self) -> bool:
        """Whether the chunks are whole row ranges (dim-0 shards): streamable in order."""
        if not self.shape:
            return len(self.chunks) == 1
        rest = self.shape[1:]
        return all(
            sizes[1:] == rest and all(o == 0 for o in offsets[1:]) for offsets, sizes in self.chunks
        )

    @property
    def runs_tiled(self) -> bool:
        """Whether every chunk is a run of the tensor's row-major elements (row chunks,
        and the boxes of fsdp's flat shards): streamable in order of their first element."""
        return all(_is_run(offsets, sizes, self.shape) for offsets, sizes in self.chunks)

    def run_start(self, offsets: tuple[int, ...]) -> int:
        """The row-major index of a chunk's first element."""
        at, stride = 0, 1
        for o, d in zip(reversed(offsets), reversed(self.shape), strict=True):
            at += o * stride
            stride *= d
        return at

    @property
    def sharding(self) -> str:
        """A short description for ``ckpt inspect``."""
        parts = [c for c in self.chunks if math.prod(c[1]) > 0]
        if len(parts) <= 1:
            return "whole"
        if self.rows_tiled:
            return f"{len(parts)} row chunks"
        if self.runs_tiled:
            return f"{len(parts)} runs"
        return f"{len(parts)} chunks"


def _is_run(offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether the box is contiguous in row-major order: single indices up to one
    dimension, whole dimensions after it."""
    for d, size in enumerate(sizes):
        if size != 1:
            return all(sizes[k] == shape[k] and offsets[k] == 0 for k in range(d + 1, len(shape)))
    return True


class _FileView(io.RawIOBase):
    """A seekable, read-only window ``[offset, offset + length)`` of an open file.

    torch.load needs a seekable stream; reading through the window avoids copying a
    chunk's bytes into memory before torch copies them into the tensor.
    """

    def __init__(self, file: io.BufferedIOBase, offset: int, length: int) -> None:
        super().__init__()
        self._file = file
        self._start = offset
        self._length = length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + offset))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._length - self._pos)
        if n <= 0:
            return 0
        self._file.seek(self._start + self._pos)
        got = self._file.readinto(view[:n])
        got = 0 if got is None else got
        self._pos += got
        return got


class CheckpointReader:
    """Read-only access to a checkpoint directory, no process group needed.

    ``manifest`` is None for a plain DCP directory (written by torch). The metadata
    is read (safely) once, when the reader is created.
    """

    path: Path
    manifest: Manifest | None
    metadata: Metadata
    safe_globals: SafeGlobals

    def __init__(self, path: Path | str, safe_globals: SafeGlobals = ()) -> None:
        self.path = Path(path).absolute()
        if not self.path.is_dir():
            raise layout.not_a_checkpoint(self.path)
        if (self.path / MANIFEST_NAME).is_file():
            self.manifest = read_manifest(self.path)
        elif (self.path / METADATA_NAME).is_file():
            self.manifest = None
        else:
            raise NotACheckpointError(
                self.path, f"the directory has neither a {MANIFEST_NAME} nor DCP's {METADATA_NAME}"
            )
        self.metadata = read_metadata(self.path)
        self.safe_globals = safe_globals

    @property
    def is_plain_dcp(self) -> bool:
        """True for a DCP directory without a ckpt manifest (torch wrote it)."""
        return self.manifest is None

    @property
    def world_size(self) -> int | None:
        """The ranks that wrote it: the manifest's, else DCP's per-rank file names."""
        if self.manifest is not None:
            return self.manifest.world_size
        ranks = [
            int(m.group(1))
            for p in self.path.iterdir()
            if (m := _RANK_FILE.match(p.name)) is not None
        ]
        return max(ranks) + 1 if ranks else None

    def tensors(self) -> dict[str, TensorInfo]:
        """Every tensor key with its global shape, dtype and chunks, in key order."""
        out: dict[str, TensorInfo] = {}
        for key in sorted(self.metadata.state_dict_metadata):
            md = self.metadata.state_dict_metadata[key]
            if isinstance(md, TensorStorageMetadata):
                out[key] = TensorInfo(
                    key=key,
                    shape=tuple(int(s) for s in md.size),
                    dtype=md.properties.dtype,
                    chunks=tuple(
                        (tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes))
                        for c in md.chunks
                    ),
                )
        return out

    def object_keys(self) -> list[str]:
        """Keys of the non-tensor (pickled) values."""
        return sorted(
            k
            for k, md in self.metadata.state_dict_metadata.items()
            if isinstance(md, BytesStorageMetadata)
        )

    def objects(self) -> dict[str, Any]:
        """Every non-tensor value, read with weights_only semantics."""
        out: dict[str, Any] = {}
        for key in self.object_keys():
            info = self._storage(key, None)
            out[key] = load_object(
                io.BytesIO(read_slice(self.path, info)), self.path, key, self.safe_globals
            )
        return out

    def _storage(self, key: str, offsets: tuple[int, ...] | None) -> Any:
        index = MetadataIndex(key, None if offsets is None else torch.Size(offsets))
        info = (self.metadata.storage_data or {}).get(index)
        if info is None:
            raise file_problem(
                self.path, METADATA_NAME, "unreadable", f"no storage entry for {key}"
            )
        if getattr(info, "transform_descriptors", None):
            raise file_problem(
                self.path,
                str(info.relative_path),
                "unreadable",
                f"{key} is stored with transforms {info.transform_descriptors}, "
                f"which this reader does not apply",
            )
        return info

    def read_chunk(self, tensor: TensorInfo, offsets: tuple[int, ...]) -> torch.Tensor:
        """One saved chunk of ``tensor`` (weights_only), in its saved dtype."""
        info = self._storage(tensor.key, offsets)
        name = str(info.relative_path)
        with self._open_data(name, int(info.offset) + int(info.length), tensor.key) as f:
            view = _FileView(f, int(info.offset), int(info.length))
            try:
                chunk = torch.load(io.BufferedReader(view), map_location="cpu", weights_only=True)
            except Exception as e:
                raise file_problem(
                    self.path,
                    name,
                    "unreadable",
                    f"chunk {list(offsets)} of {tensor.key}: {type(e).__name__}: {e}",
                ) from None
        sizes = dict(tensor.chunks)[offsets]
        if not isinstance(chunk, torch.Tensor) or tuple(chunk.shape) != sizes:
            raise file_problem(self.path, name, "unreadable", f"bad chunk of {tensor.key}")
        return chunk

    def _open_data(self, name: str, end: int, key: str) -> io.BufferedReader:
        """Open data file ``name`` for an item ending at byte ``end``; a missing, short
        or unreadable file is a ``CorruptCheckpointError`` naming it (status 4 in the
        ``ckpt`` program), never a raw ``OSError``."""

        def problem(kind: str, detail: str) -> CorruptCheckpointError:
            return file_problem(self.path, name, kind, detail)

        try:
            f = open(self.path / name, "rb")  # noqa: SIM115 - returned to a with-block
        except FileNotFoundError:
            raise problem("missing", f"referenced by .metadata for {key}, not on disk") from None
        except OSError as e:
            raise problem("unreadable", f"{type(e).__name__}: {e}") from None
        size = os.fstat(f.fileno()).st_size
        if size < end:
            f.close()
            raise problem(
                "size", f"truncated: {size} bytes, .metadata places {key} up to byte {end}"
            )
        return f

    def read_tensor(self, tensor: TensorInfo) -> torch.Tensor:
        """The whole tensor, assembled from its chunks."""
        out = torch.empty(tensor.shape, dtype=tensor.dtype)
        for offsets, sizes in tensor.chunks:
            if math.prod(sizes) == 0:
                continue
            region = out
            for dim, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
                region = region.narrow(dim, o, s)
            region.copy_(self.read_chunk(tensor, offsets))
        return out

    def iter_row_blocks(
        self, tensor: TensorInfo, dtype: torch.dtype | None, buffer_bytes: int
    ) -> Iterator[torch.Tensor]:
        """The tensor's elements in row-major order, as contiguous 1-D blocks.

        Tensors chunked in runs of row-major elements (dim-0 shards, whole tensors, the
        runs of fsdp's flat shards) go one chunk at a time, each converted to ``dtype``
        in blocks of at most ``buffer_bytes``: memory stays at one chunk plus the
        buffer. Other chunkings are assembled whole first.
        """
        target = dtype or tensor.dtype
        if tensor.runs_tiled:
            ordered = sorted(
                (c for c in tensor.chunks if math.prod(c[1]) > 0),
                key=lambda c: tensor.run_start(c[0]),
            )
            parts: Iterator[torch.Tensor] = (self.read_chunk(tensor, o) for o, _ in ordered)
        else:
            parts = iter([self.read_tensor(tensor)])
        step = max(1, buffer_bytes // max(1, target.itemsize))
        for part in parts:
            flat = part.reshape(-1)
            for start in range(0, flat.numel(), step):
                yield flat[start : start + step].to(target).contiguous()
            del part, flat
