"""Does a checkpoint fit the state it is loaded into? Keys and global shapes, per rank.

Pure functions of key -> shape maps, so the rules are tested without files or ranks:

* a key this rank needs that the checkpoint lacks is *missing*;
* a checkpoint key under one of the loaded top-level entries that *no* rank needs is
  *unexpected* (sharded-by-key states such as ZeRO's need different keys on each rank,
  so one rank's view is not enough); entries of the checkpoint that the state does not
  mention at all are simply not loaded (loading only ``model`` from a training
  checkpoint is fine);
* a tensor whose global shape differs is a *shape mismatch*; a tensor on one side and
  a plain object on the other is a *kind mismatch*.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ckpt._errors import CheckpointError, ShapeMismatch, StateDictMismatchError
from ckpt._format.chunk_index import ChunkIndex
from ckpt._format.chunk_table import BYTES
from ckpt._format.flat_pieces import FlatPieces

__all__ = [
    "PackedFit",
    "RankFit",
    "SavedKeys",
    "combine_fits",
    "fit_rank",
    "local_dtypes",
    "local_shapes",
    "pack_fit",
    "saved_dtypes",
    "saved_shapes",
    "unpack_fits",
]

# Shape of a tensor entry; None for a plain (pickled) object.
Shape = tuple[int, ...] | None

# Below this fraction of matching keys a mismatch is reported as "another model".
_OTHER_MODEL_OVERLAP = 0.5


def local_shapes(flat: Mapping[str, Any]) -> dict[str, Shape]:
    """The keys of a flattened state dict (DCP's ``flatten_state_dict``) with their
    global shapes (DTensor, runs: the whole tensor's)."""
    return {
        key: tuple(value.shape) if isinstance(value, (torch.Tensor, FlatPieces)) else None
        for key, value in flat.items()
    }


def saved_shapes(metadata: Metadata) -> dict[str, Shape]:
    """The keys of a DCP checkpoint with their global shapes (None: a pickled object)."""
    return {
        key: tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
        for key, md in metadata.state_dict_metadata.items()
    }


def local_dtypes(flat: Mapping[str, Any]) -> dict[str, torch.dtype]:
    """The dtype of every tensor entry of a flattened state dict, by key."""
    return {k: v.dtype for k, v in flat.items() if isinstance(v, (torch.Tensor, FlatPieces))}


def saved_dtypes(metadata: Metadata) -> dict[str, torch.dtype]:
    """The dtype of every tensor of a DCP checkpoint, by key."""
    return {
        key: md.properties.dtype
        for key, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


@dataclass(frozen=True)
class SavedKeys:
    """A checkpoint's keys with their global shapes (None: a pickled value) and the
    dtypes of its tensors, from its index or from DCP's metadata."""

    shapes: dict[str, Shape]
    dtypes: dict[str, torch.dtype]

    @classmethod
    def of_metadata(cls, metadata: Metadata) -> SavedKeys:
        return cls(saved_shapes(metadata), saved_dtypes(metadata))

    @classmethod
    def of_index(cls, index: ChunkIndex) -> SavedKeys:
        shapes: dict[str, Shape] = {}
        dtypes: dict[str, torch.dtype] = {}
        for key, saved in index.keys.items():
            shapes[key] = None if saved.kind == BYTES else saved.shape
            if saved.dtype is not None:
                dtypes[key] = saved.dtype
        return cls(shapes, dtypes)


# A key of an FSDP LOCAL_STATE_DICT: the flat parameter itself.
_LOCAL_KEY = "_flat_param"


@dataclass(frozen=True)
class RankFit:
    """One rank's comparison; combined over ranks by ``combine_fits``."""

    missing: tuple[str, ...]
    not_needed: frozenset[str]  # checkpoint keys under loaded entries this rank lacks
    shape_mismatches: tuple[ShapeMismatch, ...]
    kind_mismatches: tuple[str, ...]
    matched: int  # this rank's keys found in the checkpoint with the same shape and kind
    needed: int  # this rank's keys
    absent_entries: tuple[str, ...] = ()  # top-level entries the checkpoint has no key of
    dtype_mismatches: tuple[str, ...] = ()  # "key: checkpoint float32, state bfloat16"
    local_mismatch: bool = False  # one side is an FSDP LOCAL_STATE_DICT, the other is not


def _entry_of(key: str, entries: Iterable[str]) -> bool:
    return any(key == e or key.startswith(e + ".") for e in entries)


def fit_rank(
    local: Mapping[str, Shape],
    saved: Mapping[str, Shape],
    entries: Sequence[str],
    dtypes: tuple[Mapping[str, torch.dtype], Mapping[str, torch.dtype]] | None = None,
) -> RankFit:
    """Compare this rank's keys (``local``) with the checkpoint's (``saved``).

    ``entries`` are the top-level keys of the state being loaded; ``dtypes``
    (local, saved) adds a dtype comparison: DCP would cast silently.
    """
    missing = sorted(k for k in local if k not in saved)
    absent = tuple(
        e
        for e in entries
        if any(_entry_of(k, [e]) for k in local) and not any(_entry_of(k, [e]) for k in saved)
    )
    dtype_mismatches: list[str] = []
    if dtypes is not None:
        mine_d, theirs_d = dtypes
        for key in sorted(mine_d.keys() & theirs_d.keys()):
            if mine_d[key] != theirs_d[key]:
                dtype_mismatches.append(
                    f"{key}: checkpoint {str(theirs_d[key]).removeprefix('torch.')}, "
                    f"the state being loaded {str(mine_d[key]).removeprefix('torch.')}"
                )
    mine_local = any(k.endswith(_LOCAL_KEY) for k in local)
    saved_local = any(k.endswith(_LOCAL_KEY) for k in saved if _entry_of(k, entries))
    local_mismatch = bool(local) and mine_local != saved_local
    shapes: list[ShapeMismatch] = []
    kinds: list[str] = []
    for key in sorted(local.keys() & saved.keys()):
        mine, theirs = local[key], saved[key]
        if (mine is None) != (theirs is None):
            kinds.append(key)
        elif mine is not None and theirs is not None and mine != theirs:
            shapes.append(ShapeMismatch(key, theirs, mine))
    not_needed = frozenset(k for k in saved if k not in local and _entry_of(k, entries))
    return RankFit(
        missing=tuple(missing),
        not_needed=not_needed,
        shape_mismatches=tuple(shapes),
        kind_mismatches=tuple(kinds),
        matched=len(local) - len(missing) - len(shapes) - len(kinds),
        needed=len(local),
        absent_entries=absent,
        dtype_mismatches=tuple(dtype_mismatches),
        local_mismatch=local_mismatch,
    )


def combine_fits(
    path: Path, fits: Sequence[RankFit], strict: bool
) -> StateDictMismatchError | None:
    """The error every rank raises, or None when the checkpoint fits on every rank.

    Without ``strict`` only shape and kind mismatches are errors (DCP cannot load a
    tensor of another shape); missing keys keep their current values.
    """
    missing = sorted({k for f in fits for k in f.missing})
    unexpected = sorted(frozenset.intersection(*(f.not_needed for f in fits))) if fits else []
    shapes = sorted({m for f in fits for m in f.shape_mismatches}, key=lambda m: m.key)
    kinds = sorted({k for f in fits for k in f.kind_mismatches})
    dtypes = sorted({k for f in fits for k in f.dtype_mismatches})
    absent = sorted({e for f in fits for e in f.absent_entries})
    local_mismatch = any(f.local_mismatch for f in fits)
    if not strict:
        missing, unexpected, absent = [], [], []
    if not (missing or unexpected or shapes or kinds or dtypes or absent):
        return None
    # "Another model": most keys a rank needs (in entries the checkpoint has) are absent or
    # do not fit; an entry missing as a whole or a LOCAL state dict is said as such instead.
    other_model = not local_mismatch and any(
        f.matched < _OTHER_MODEL_OVERLAP * (f.needed - _keys_in(f.missing, f.absent_entries))
        for f in fits
    )
    return StateDictMismatchError(
        path,
        missing=missing,
        unexpected=unexpected,
        shape_mismatches=shapes,
        kind_mismatches=kinds,
        other_model=other_model,
        dtype_mismatches=dtypes,
        absent_entries=absent,
        local_state_dict=local_mismatch,
    )


def _keys_in(keys: Sequence[str], entries: Sequence[str]) -> int:
    return sum(1 for k in keys if _entry_of(k, entries))


@dataclass(frozen=True)
class PackedFit:
    """A rank's fit as the ranks exchange it: ``not_needed`` as a bitmask over the
    checkpoint's sorted keys (one bit per key, not one string: the keys of a sharded
    optimizer's state each rank lacks number in the thousands), or the error it met."""

    fit: RankFit | CheckpointError
    not_needed: bytes


def _sorted_keys(saved: SavedKeys | None) -> list[str]:
    return sorted(saved.shapes) if saved is not None else []


def pack_fit(fit: RankFit | CheckpointError, saved: SavedKeys | None) -> PackedFit:
    """``fit`` ready to be sent (see :class:`PackedFit`)."""
    if isinstance(fit, CheckpointError):
        return PackedFit(fit, b"")
    keys = _sorted_keys(saved)
    mask = 0
    for i, key in enumerate(keys):
        if key in fit.not_needed:
            mask |= 1 << i
    packed = mask.to_bytes((len(keys) + 7) // 8, "little")
    return PackedFit(dataclasses.replace(fit, not_needed=frozenset()), packed)


def unpack_fits(packed: Sequence[PackedFit], saved: SavedKeys | None) -> list[RankFit]:
    """The ranks' fits for :func:`combine_fits`, from what they sent (no errors among
    them: the caller raised those). Only the keys no rank needs matter, so each fit
    carries those."""
    fits = [p for p in packed if isinstance(p.fit, RankFit)]
    keys = _sorted_keys(saved)
    common = -1
    for p in fits:
        common &= int.from_bytes(p.not_needed, "little")
    nobody = frozenset(k for i, k in enumerate(keys) if fits and common >> i & 1)
    return [
        dataclasses.replace(p.fit, not_needed=nobody) for p in fits if isinstance(p.fit, RankFit)
    ]
