"""What a rank holds of a checkpoint, as one compact table: the records a save sends.

[Note: flat coordination]
DCP coordinates a save by gathering every rank's plan to the coordinator as pickled
``WriteItem`` trees (one per tensor chunk), scattering pickled plans back and gathering
pickled write results, and a load the same way with read items; its coordinator then
pickles a ``Metadata`` entry per chunk, and every loading rank unpickles all of them.
Measured on this machine with ``fully_shard`` and AdamW at 4 ranks and 1,000
tensors, that pickling was most of a save's and a load's time, and it grows with ranks
times tensors. ckpt coordinates in a fixed number of collective rounds whatever the
counts, with compact records:

* each rank describes its items as a :class:`ChunkTable`: one int64 row per item (a
  tensor chunk: its key, offsets, sizes, global shape and dtype; a pickled value: its
  key) and the keys' paths once, as JSON; its fingerprint names the structure;
* a save gathers the tables once to rank 0, which plans (who writes a chunk several
  ranks hold; the checks: ``_format/chunk_plan.py``) and answers in the broadcast that
  also carries the save's token; each rank writes its own data file with no further
  round; one gather of the written byte ranges (an int64 row per item) and one
  broadcast of the commit's outcome end it;
* an unchanged structure (every rank's fingerprint as at the last save on the group,
  the training loop's case) sends only the fingerprints, and rank 0 reuses its plan,
  and when the byte ranges are the same too, the ``.metadata`` and index it wrote
  then (``_commit/save_rounds.py``);
* rank 0 writes, beside DCP's ``.metadata``, a compact index of every chunk and where
  its raw bytes lie (``_format/chunk_index.py``); a load reads the index, not the
  pickle, and each rank reads only the byte ranges of the chunks it needs, straight
  into its tensors where the chunk matches (``_format/chunk_reader.py``).

The files stay DCP's: torch's ``dcp.load`` reads a ckpt checkpoint, and ckpt reads
torch's (without an index, through DCP's own planner).
"""

from __future__ import annotations

import hashlib
import json
import struct
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ckpt._format.flat_keys import KeyPath, flatten
from ckpt._format.flat_pieces import FlatPieces
from ckpt._format.save_planner import CaptureProblem

__all__ = [
    "BYTES",
    "TENSOR",
    "ChunkTable",
    "KeyPath",
    "LocalItems",
    "Row",
    "dtensor_box",
    "dtype_code",
    "dtype_of",
    "local_items",
]

TENSOR = 0  # a row's kind: a tensor chunk
BYTES = 1  # a row's kind: a value saved pickled (torch.save)

# Every dtype torch names, in a fixed order, so a dtype travels as its index (the ranks
# of a job share one torch).
_DTYPES: tuple[torch.dtype, ...] = tuple(
    sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
)
_CODES = {d: i for i, d in enumerate(_DTYPES)}
_MAGIC = b"CKT1"
_HEAD = "<4sIQQ"  # magic, width, header bytes, int64 values


def dtype_code(dtype: torch.dtype) -> int:
    """The index a dtype travels as."""
    return _CODES[dtype]


def dtype_of(code: int) -> torch.dtype:
    """The dtype of an index from :func:`dtype_code`."""
    return _DTYPES[code]


Box = tuple[int, ...]  # offsets, sizes or a shape


class Row(NamedTuple):
    """One item of a table, decoded: ``offsets``/``sizes``/``shape`` are ``()`` for a
    pickled value (a tuple: a rank makes thousands per save)."""

    key: int  # index into the table's paths
    kind: int  # TENSOR or BYTES
    dtype: int  # dtype_code; -1 for BYTES
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    shape: tuple[int, ...]  # the whole tensor's


@dataclass(frozen=True)
class ChunkTable:
    """A rank's items: the keys' paths, and per item one row of int64
    ``[key, kind, dtype, ndim, offsets * width, sizes * width, shape * width]``."""

    paths: tuple[KeyPath, ...]
    rows: array[int]  # the rows one after another (typecode "q")
    width: int  # the largest ndim among the items

    @classmethod
    def of(cls, paths: Sequence[KeyPath], rows: Sequence[Row]) -> ChunkTable:
        width = max((len(r.shape) for r in rows), default=0)
        values: list[int] = []
        for key, kind, dtype, offsets, sizes, shape in rows:
            ndim = len(shape)
            values += (key, kind, dtype, ndim)
            if ndim == width:
                values += offsets
                values += sizes
                values += shape
            else:
                pad = (0,) * (width - ndim)
                values += offsets
                values += pad
                values += sizes
                values += pad
                values += shape
                values += pad
        return cls(tuple(paths), array("q", values), width)

    @property
    def count(self) -> int:
        """How many items."""
        return len(self.rows) // (4 + 3 * self.width)

    def keys(self) -> list[str]:
        """The flattened key of each path (DCP's: its parts joined by dots)."""
        return [".".join(map(str, p)) for p in self.paths]

    def items(self) -> Iterator[tuple[int, int, int, Box, Box, Box]]:
        """The rows as ``(key, kind, dtype, offsets, sizes, shape)``, in order."""
        w, step = self.width, 4 + 3 * self.width
        flat = self.rows.tolist()
        for at in range(0, len(flat), step):
            n = flat[at + 3]
            box = at + 4
            yield (
                flat[at],
                flat[at + 1],
                flat[at + 2],
                tuple(flat[box : box + n]),
                tuple(flat[box + w : box + w + n]),
                tuple(flat[box + 2 * w : box + 2 * w + n]),
            )

    def decoded(self) -> list[Row]:
        """The rows as :class:`Row` s."""
        return [Row(*item) for item in self.items()]

    def encode(self) -> bytes:
        """The bytes a rank sends: a header, the paths as JSON, the rows."""
        header = _paths_json(self.paths)
        head = struct.pack(_HEAD, _MAGIC, self.width, len(header), len(self.rows))
        return head + header + self.rows.tobytes()

    @classmethod
    def decode(cls, blob: bytes) -> ChunkTable:
        """The table another rank sent (inverse of :meth:`encode`)."""
        magic, width, header_len, count = struct.unpack_from(_HEAD, blob)
        if magic != _MAGIC:
            raise ValueError("not a chunk table")
        at = struct.calcsize(_HEAD)
        paths = tuple(tuple(p) for p in json.loads(blob[at : at + header_len]))
        rows = array("q")
        rows.frombytes(blob[at + header_len : at + header_len + 8 * count])
        return cls(paths, rows, width)

    def fingerprint(self) -> str:
        """Names the structure: equal for equal keys, chunks, shapes and dtypes."""
        return hashlib.blake2b(self.encode(), digest_size=16).hexdigest()


# The JSON of the last paths encoded: a training loop's saves encode the same paths
# every time, and writing them out was a twentieth of a repeated save; comparing them
# costs a tenth of that. One entry, replaced whole (saves on two threads only miss).
_last_paths: list[tuple[tuple[KeyPath, ...], bytes]] = [((), b"[]")]


def _paths_json(paths: tuple[KeyPath, ...]) -> bytes:
    known, header = _last_paths[0]
    if paths != known:
        header = json.dumps([list(p) for p in paths]).encode()
        _last_paths[0] = (paths, header)
    return header


@dataclass(frozen=True)
class LocalItems:
    """A rank's state dict as items: the table, each row's value (a tensor chunk, a
    view where it can be, or the object), and what the fast path cannot take."""

    table: ChunkTable
    values: tuple[Any, ...]  # per row
    problems: tuple[str, ...]  # "key: why" of values this rank could not capture
    foreign: tuple[str, ...]  # keys of values only DCP's own planner knows


_boxes: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}


def dtensor_box(value: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of this rank's shard of ``value`` (cached by global shape,
    mesh and placements: the same for every parameter of a shape; read from the
    ``DTensor``'s spec, a third of the cost of its public properties, which a save
    pays per tensor)."""
    spec = value._spec
    key = (spec.shape, spec.mesh, spec.placements)
    box = _boxes.get(key)
    if box is None:
        if len(_boxes) >= 4096:  # shapes of a few models; never a leak
            _boxes.clear()
        sizes, offsets = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        box = _boxes[key] = (tuple(offsets), tuple(sizes))
    return box


def _plain(value: object) -> bool:
    return type(value) is torch.Tensor or type(value) is torch.nn.Parameter


def local_items(state_dict: Mapping[str, Any]) -> LocalItems:
    """This rank's items of ``state_dict`` in DCP's flattened key order."""
    flat, mappings = flatten(state_dict)
    paths: list[KeyPath] = []
    rows: list[Row] = []
    values: list[Any] = []
    problems: list[str] = []
    foreign: list[str] = []
    for key, value in flat.items():
        index = len(paths)
        if isinstance(value, CaptureProblem):
            problems.append(f"{key}: {value.message}")
            continue
        if isinstance(value, DTensor):
            offsets, sizes = dtensor_box(value)
            local = value._local_tensor
            if not _plain(local) or local.shape != sizes:
                foreign.append(key)
                continue
            code, shape = _CODES[local.dtype], tuple(value._spec.shape)
            rows.append(Row(index, TENSOR, code, offsets, sizes, shape))
            values.append(local)
        elif isinstance(value, FlatPieces):
            code, shape = dtype_code(value.dtype), tuple(value.shape)
            for box in value.boxes:
                rows.append(Row(index, TENSOR, code, box.offsets, box.sizes, shape))
                values.append(value.local[box.at : box.at + box.numel].view(box.sizes))
        elif _plain(value):
            shape = tuple(value.shape)
            rows.append(
                Row(index, TENSOR, dtype_code(value.dtype), (0,) * len(shape), shape, shape)
            )
            # A parameter (a save's capture holds them as they are): its plain tensor,
            # which the writer takes as a chunk.
            values.append(value if type(value) is torch.Tensor else value.detach())
        elif isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
            foreign.append(key)  # ShardedTensor, other tensor subclasses
            continue
        else:
            rows.append(Row(index, BYTES, -1, (), (), ()))
            values.append(value)
        paths.append(tuple(mappings[key]))
    return LocalItems(ChunkTable.of(paths, rows), tuple(values), tuple(problems), tuple(foreign))
