"""A rank's data file of a save: its chunks as DCP lays them out, hashed as written.

Each item is one blob, back to back, as DCP's file writer puts them: a tensor chunk is
what ``torch.save`` of it writes (from a template where there is one: [Note: blob
templates] in ``_format/tensor_blob.py``), a pickled value is ``torch.save`` of it. The
bytes pass through one reused buffer into the file (a large chunk's raw bytes go
straight from the tensor's memory), are checksummed on the way ([Note: one pass over
the bytes] in ``_format/writer.py``: the manifest's digest without a second read), the
disk's write-back is started every ``WRITEBACK_BYTES``, and the file is synced before
the rank reports it written. The result says where each item lies (its blob's offset
and length, and where its raw bytes start), which rank 0 turns into the ``.metadata``
and the index (``_format/chunk_index.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt._format.chunk_index import Stored
from ckpt._format.manifest import Checksum, FileRecord
from ckpt._format.save_planner import own_storage
from ckpt._format.tensor_blob import raw_bytes, saved_bytes, template_for
from ckpt._format.writer import WRITEBACK_BYTES, Digest, start_writeback

__all__ = ["write_data_file", "write_small_file"]

# Pieces are gathered into one buffer and written when it holds this much; a piece at
# least this large is written from its own memory.
_BUFFER_BYTES = 4 << 20


class _Out:
    """The open file: pieces gathered in one buffer (checksummed as it is written out),
    large ones written from their own memory, the write-back started as it goes."""

    def __init__(self, path: Path, checksum: Checksum) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.digest = Digest(checksum)
        self.buffer = bytearray()
        self.flushed = 0  # bytes in the file
        self.synced = 0  # bytes whose write-back was started

    @property
    def written(self) -> int:
        """Bytes handed over so far (in the file or the buffer)."""
        return self.flushed + len(self.buffer)

    def put(self, *pieces: bytes | memoryview) -> None:
        for piece in pieces:
            if len(piece) >= _BUFFER_BYTES:
                self.flush()
                self._write(memoryview(piece).cast("B"))
            else:
                self.buffer += piece
        if len(self.buffer) >= _BUFFER_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            self._write(memoryview(self.buffer))
            self.buffer = bytearray()

    def _write(self, view: memoryview) -> None:
        self.digest.update(view)
        size = view.nbytes
        while view.nbytes:
            view = view[os.write(self.fd, view) :]
        self.flushed += size
        if self.flushed - self.synced >= WRITEBACK_BYTES:
            start_writeback(self.fd, self.synced, self.flushed - self.synced)
            self.synced = self.flushed


def _host(chunk: torch.Tensor) -> torch.Tensor:
    """The chunk as a contiguous CPU tensor (a copy only where it must be; its memory
    is only read, so no ``detach``)."""
    if not chunk.is_cpu:
        chunk = chunk.detach().to("cpu")
    return chunk if chunk.is_contiguous() else chunk.detach().contiguous()


def write_data_file(
    path: Path, values: Sequence[Any], checksum: Checksum
) -> tuple[list[Stored], FileRecord]:
    """Write ``values`` (tensor chunks and pickled values, in order) to a new file at
    ``path`` and sync it; where each lies, and the file's manifest record."""
    out = _Out(path, checksum)
    stored: list[Stored] = []
    try:
        for value in values:
            start = out.written
            if isinstance(value, torch.Tensor):
                chunk, template = value, template_for(value)  # most chunks: no _host
                if template is None:
                    chunk = _host(value)
                    template = template_for(chunk)
                if template is not None:
                    out.put(template.head, raw_bytes(chunk), template.tail)
                    stored.append((start, out.written - start, start + template.data_at))
                    continue
                out.put(saved_bytes(own_storage(chunk)))  # no template: torch.save it
                stored.append((start, out.written - start, -1))
                continue
            out.put(saved_bytes(value))
            stored.append((start, out.written - start, -1))
        out.flush()
        os.fsync(out.fd)
    finally:
        os.close(out.fd)
    return stored, FileRecord(path.name, out.digest.size, out.digest.hexdigest())


def write_small_file(path: Path, data: bytes, checksum: Checksum) -> FileRecord:
    """Write ``data`` to a new file at ``path``, sync it; its manifest record."""
    out = _Out(path, checksum)
    try:
        out.put(data)
        out.flush()
        os.fsync(out.fd)
    finally:
        os.close(out.fd)
    return FileRecord(path.name, out.digest.size, out.digest.hexdigest())
