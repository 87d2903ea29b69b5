"""``torch.save``'s bytes for a tensor chunk, without a ``torch.save`` per chunk.

[Note: blob templates]
A DCP data file holds each tensor chunk as the output of ``torch.save`` of that chunk,
and DCP's reader ``torch.load``s the chunk's byte range, so these bytes are the
checkpoint format torch (and ``ckpt`` before this) reads. That output is a zip archive:
the pickle of the tensor's dtype, shape and strides, a few small records, the raw bytes
of its storage as one stored record, the central directory. With ``torch.save``'s
record CRCs switched off (as ckpt's writers always have them: [Note: one pass over the
bytes] in ``_format/writer.py``) nothing in it but that one record depends on the
values: two chunks of one dtype and shape give the same bytes around their data.
``torch.save`` took 91 us for a chunk of 16 floats, a checkpoint of a few thousand
small tensors spent most of its writing time there; a template (:class:`BlobTemplate`,
the bytes before and after the data) is made once per dtype and shape by one
``torch.save``, split around the data record found through the archive's central
directory, and each chunk is then written as ``head + raw bytes + tail``, identical
to what ``torch.save`` writes (``tests/ckpt/test_flat_format.py`` compares them byte
for byte).

Where the split is not sure, there is no template and the caller uses ``torch.save``:
a dtype that is not a plain strided one, a record past zip's 4 GiB fields (zip64), or
a ``torch.save`` whose bytes around the data differ between two tensors of the same
shape (checked once per process, :func:`templates_hold`). The raw bytes also give a
load what it needs to read a chunk straight into its tensor: where they start inside
the blob (:attr:`BlobTemplate.data_at`).
"""

from __future__ import annotations

import ctypes
import functools
import io
import struct
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ckpt._format.save_planner import own_storage

__all__ = [
    "BlobTemplate",
    "raw_bytes",
    "saved_bytes",
    "template_for",
    "templates_hold",
    "without_record_crc",
]

_EOCD = b"PK\x05\x06"  # end of central directory
_CENTRAL = b"PK\x01\x02"  # a central directory entry
_LOCAL = b"PK\x03\x04"  # a local file header
_ZIP32_MAX = 0xFFFFFFFF  # a size or offset this large moved to the zip64 extra field
_DATA_RECORD = b"/data/0"  # the storage record of a lone tensor ("archive/data/0")


@contextmanager
def without_record_crc() -> Generator[None, None, None]:
    """``torch.save``'s record CRC off in this thread, then back as found (torch keeps
    the option per thread; see [Note: one pass over the bytes])."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def saved_bytes(value: object) -> bytes:
    """What ``torch.save(value)`` writes, record CRCs off."""
    buffer = io.BytesIO()
    with without_record_crc():
        torch.save(value, buffer)
    return buffer.getvalue()


@dataclass(frozen=True)
class BlobTemplate:
    """``torch.save`` of a chunk of one dtype and shape is ``head + data + tail``."""

    head: bytes
    tail: bytes

    @property
    def data_at(self) -> int:
        """Where the raw bytes start inside the blob."""
        return len(self.head)

    def length(self, nbytes: int) -> int:
        """The whole blob's length for ``nbytes`` of data."""
        return len(self.head) + nbytes + len(self.tail)


def _data_span(blob: bytes) -> tuple[int, int] | None:
    """``(start, length)`` of the tensor's storage record in a ``torch.save`` archive,
    read from the central directory; None where the archive is not as expected."""
    end = blob.rfind(_EOCD)
    if end < 0 or end + 22 > len(blob):
        return None
    count, _, at = struct.unpack_from("<HII", blob, end + 10)
    if at == _ZIP32_MAX:
        return None
    for _ in range(count):
        if blob[at : at + 4] != _CENTRAL:
            return None
        size, _ = struct.unpack_from("<II", blob, at + 20)
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", blob, at + 28)
        (local,) = struct.unpack_from("<I", blob, at + 42)
        name = blob[at + 46 : at + 46 + name_len]
        if name.endswith(_DATA_RECORD):
            if _ZIP32_MAX in (size, local) or blob[local : local + 4] != _LOCAL:
                return None
            local_name, local_extra = struct.unpack_from("<HH", blob, local + 26)
            return local + 30 + local_name + local_extra, size
        at += 46 + name_len + extra_len + comment_len
    return None


def raw_bytes(chunk: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (and without numpy, which
    torch does not require): a view of its memory, valid while ``chunk`` lives. Also
    writable, for a load that reads into it."""
    nbytes = chunk.nbytes
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(chunk.data_ptr())).cast("B")


def _split(chunk: torch.Tensor) -> BlobTemplate | None:
    """The template of ``chunk``'s dtype and shape, from one ``torch.save`` of it."""
    blob = saved_bytes(own_storage(chunk))
    span = _data_span(blob)
    nbytes = chunk.numel() * chunk.element_size()
    if span is None or span[1] != nbytes:
        return None
    start, size = span
    if blob[start : start + size] != raw_bytes(chunk).tobytes():
        return None
    return BlobTemplate(blob[:start], blob[start + size :])


@functools.lru_cache(maxsize=1)
def templates_hold() -> bool:
    """Whether ``torch.save``'s bytes around the data are the same for two tensors of
    one dtype and shape in this torch (checked once per process)."""
    one, two = torch.zeros(3, 2), torch.arange(6, dtype=torch.float32).reshape(3, 2)
    first, second = _split(one), _split(two)
    return first is not None and first == second


_templates: dict[tuple[torch.dtype, torch.Size], BlobTemplate | None] = {}
_UNKNOWN = BlobTemplate(b"", b"")  # not looked at yet (None: looked at, no template)
_MAX_TEMPLATES = 4096  # distinct (dtype, shape) kept; a model has a few dozen


def template_for(chunk: torch.Tensor) -> BlobTemplate | None:
    """The template of a contiguous CPU ``chunk``'s dtype and shape (cached per
    process), or None: write it with ``torch.save`` (see [Note: blob templates])."""
    # Called per chunk of every save: the cheapest checks (``is_cpu``, not ``device``).
    if type(chunk) is not torch.Tensor or not chunk.is_cpu or not chunk.is_contiguous():
        return None
    if chunk.layout != torch.strided:
        return None
    key = (chunk.dtype, chunk.shape)
    template = _templates.get(key, _UNKNOWN)
    if template is _UNKNOWN:
        if len(_templates) >= _MAX_TEMPLATES:
            _templates.clear()
        held = templates_hold() and not chunk.is_quantized
        template = _templates[key] = _split(chunk) if held else None
    return template
