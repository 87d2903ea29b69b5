"""A load's reads: each rank reads the byte ranges its tensors need, and nothing else.

With a checkpoint's index ([Note: flat coordination] in ``_format/chunk_table.py``) a
rank knows, for every key of the state it loads, where each saved chunk lies and where
its raw bytes start. For each of its own boxes (a ``DTensor`` shard, the boxes of an
fsdp rank's runs, a whole tensor) it reads the saved chunks that overlap it:

* a chunk that is exactly the box (a load at the world size and layout that saved)
  is read with one ``preadv`` straight into the tensor's memory (or a host buffer and
  one copy, for a tensor on a GPU);
* a chunk that overlaps the box in part is read only over the rows (dimension 0) the
  overlap spans, a contiguous byte range, into a buffer, and the overlap copied;
* a chunk stored without raw bytes (``torch.save``'d whole; a checkpoint from another
  machine's byte order) is read whole and loaded by ``torch.load(weights_only=True)``;
* a pickled value is read and unpickled with ``weights_only`` semantics and put in its
  place in the state dict ([Note: no code from a checkpoint] in
  ``_format/safe_unpickling.py``).

No pickle of the checkpoint's is run to find anything, and no collective is needed:
the reads of one rank are its own.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.tensor import DTensor

from ckpt._errors import file_problem
from ckpt._format.chunk_index import ChunkIndex, IndexedChunk
from ckpt._format.chunk_table import BYTES, dtensor_box
from ckpt._format.flat_pieces import FlatPieces
from ckpt._format.safe_unpickling import SafeGlobals, load_object
from ckpt._format.tensor_blob import raw_bytes

__all__ = ["Template", "read_chunks", "readable"]

Box = tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]  # offsets, sizes, the tensor


def _plain(value: object) -> bool:
    return type(value) is torch.Tensor or type(value) is torch.nn.Parameter


def _boxes(value: Any) -> list[Box] | None:
    """The boxes a load fills of ``value``; None for a pickled value."""
    if isinstance(value, DTensor):
        offsets, sizes = dtensor_box(value)
        return [(offsets, sizes, value._local_tensor)]
    if isinstance(value, FlatPieces):
        return [
            (b.offsets, b.sizes, value.local[b.at : b.at + b.numel].view(b.sizes))
            for b in value.boxes
        ]
    if isinstance(value, torch.Tensor):
        return [((0,) * value.dim(), tuple(value.shape), value)]
    return None


def readable(flat: Mapping[str, Any]) -> bool:
    """Whether every value of the (flattened) template is one these reads fill (else the
    load goes through DCP's planner: a ``ShardedTensor``, another tensor subclass)."""
    return all(_fills(value) for value in flat.values())


def _fills(value: object) -> bool:
    if isinstance(value, FlatPieces):
        return True
    if isinstance(value, DTensor):
        return _plain(value._local_tensor)
    if isinstance(value, torch.Tensor):
        return _plain(value)
    return not hasattr(value, "__create_write_items__")


class _Files:
    """The data files a rank reads, each opened once."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.fds: dict[str, int] = {}

    def read_into(self, name: str, at: int, buffer: memoryview) -> None:
        """Fill ``buffer`` from byte ``at`` of data file ``name``."""
        fd = self.fds.get(name)
        try:
            if fd is None:
                fd = self.fds[name] = os.open(self.directory / name, os.O_RDONLY)
            done = 0
            while done < buffer.nbytes:
                got = os.preadv(fd, [buffer[done:]], at + done)
                if got == 0:
                    raise file_problem(
                        self.directory, name, "size", f"ends before byte {at + buffer.nbytes}"
                    )
                done += got
        except FileNotFoundError:
            raise file_problem(
                self.directory, name, "missing", "in the index, not on disk"
            ) from None
        except OSError as e:
            raise file_problem(
                self.directory, name, "unreadable", f"{type(e).__name__}: {e}"
            ) from None

    def read(self, name: str, at: int, length: int) -> bytes:
        buffer = bytearray(length)
        self.read_into(name, at, memoryview(buffer))
        return bytes(buffer)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _overlap(
    a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]
) -> list[tuple[int, int]] | None:
    """``[lo, hi)`` per dimension of two boxes' intersection; None if it is empty."""
    out = []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return out


def _region(
    tensor: torch.Tensor, origin: tuple[int, ...], span: list[tuple[int, int]]
) -> torch.Tensor:
    """The part of ``tensor`` (whose element 0 is at ``origin``) that ``span`` covers."""
    for dim, ((lo, hi), o) in enumerate(zip(span, origin, strict=True)):
        tensor = tensor.narrow(dim, lo - o, hi - lo)
    return tensor


def _fill_whole(files: _Files, chunk: IndexedChunk, target: torch.Tensor) -> None:
    """A chunk that is exactly the box: its raw bytes straight into the tensor."""
    direct = target.device.type == "cpu" and target.is_contiguous()
    host = target.detach() if direct else torch.empty(chunk.sizes, dtype=target.dtype)
    files.read_into(chunk.file, chunk.data_at, raw_bytes(host))
    if not direct:
        target.detach().copy_(host)


def _chunk_part(
    files: _Files, chunk: IndexedChunk, dtype: torch.dtype, rows: tuple[int, int], native: bool
) -> torch.Tensor:
    """Rows ``[rows)`` of a saved chunk (relative to the chunk), from the fewest bytes."""
    if chunk.data_at < 0 or not native:
        blob = files.read(chunk.file, chunk.offset, chunk.length)
        whole = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        if not isinstance(whole, torch.Tensor) or tuple(whole.shape) != chunk.sizes:
            raise file_problem(
                files.directory, chunk.file, "unreadable", "a chunk of another shape"
            )
        return whole.narrow(0, rows[0], rows[1] - rows[0]) if chunk.sizes else whole
    if not chunk.sizes:  # a 0-dim tensor
        part = torch.empty((), dtype=dtype)
        files.read_into(chunk.file, chunk.data_at, raw_bytes(part))
        return part
    part = torch.empty((rows[1] - rows[0], *chunk.sizes[1:]), dtype=dtype)
    row_bytes = part[0].numel() * part.element_size() if part.shape[0] else 0
    files.read_into(chunk.file, chunk.data_at + rows[0] * row_bytes, raw_bytes(part))
    return part


def _fill(files: _Files, chunks: tuple[IndexedChunk, ...], box: Box, native: bool) -> None:
    """Every saved chunk that overlaps ``box``, into it."""
    offsets, sizes, target = box
    for chunk in chunks:
        if chunk.offsets == offsets and chunk.sizes == sizes and chunk.data_at >= 0 and native:
            _fill_whole(files, chunk, target)
            continue
        span = _overlap((chunk.offsets, chunk.sizes), (offsets, sizes))
        if span is None:
            continue
        rows = (span[0][0] - chunk.offsets[0], span[0][1] - chunk.offsets[0]) if span else (0, 0)
        part = _chunk_part(files, chunk, target.dtype, rows, native)
        origin = (span[0][0], *chunk.offsets[1:]) if span else ()
        with torch.no_grad():
            _region(target.detach(), offsets, span).copy_(_region(part, origin, span))


@dataclass(frozen=True)
class Template:
    """What a load fills: the state dict, DCP's flattening of it, and the path of each
    flattened key in the state dict (DCP's mappings)."""

    state_dict: dict[str, Any]
    flat: Mapping[str, Any]
    mappings: Mapping[str, Any]


def read_chunks(
    directory: Path, index: ChunkIndex, template: Template, safe_globals: SafeGlobals
) -> None:
    """Fill ``template`` from the checkpoint at ``directory``: tensors in place, pickled
    values put in their places in its state dict. Keys the checkpoint lacks are left as
    they are (the caller checked which may be)."""
    state_dict, flat, mappings = template.state_dict, template.flat, template.mappings
    files = _Files(directory)
    try:
        for key, value in flat.items():
            path = mappings[key]
            saved = index.keys.get(key)
            if saved is None:
                continue
            boxes = _boxes(value)
            if boxes is None or saved.kind == BYTES:
                [chunk] = saved.chunks
                blob = files.read(chunk.file, chunk.offset, chunk.length)
                obj = load_object(io.BytesIO(blob), directory, key, safe_globals)
                set_element(state_dict, path, obj)
                continue
            for box in boxes:
                _fill(files, saved.chunks, box, index.native)
    finally:
        files.close()
