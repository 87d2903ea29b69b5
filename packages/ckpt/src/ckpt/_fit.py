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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ckpt._errors import ShapeMismatch, StateDictMismatchError

__all__ = ["RankFit", "combine_fits", "fit_rank", "local_shapes", "saved_shapes"]

# Shape of a tensor entry; None for a plain (pickled) object.
Shape = tuple[int, ...] | None

# Below this fraction of matching keys a mismatch is reported as "another model".
_OTHER_MODEL_OVERLAP = 0.5


def local_shapes(state_dict: Mapping[str, Any]) -> dict[str, Shape]:
    """Flattened DCP keys of a state dict with their global shapes (DTensor: global)."""
    flat, _ = flatten_state_dict(dict(state_dict))
    return {
        key: tuple(value.shape) if isinstance(value, torch.Tensor) else None
        for key, value in flat.items()
    }


def saved_shapes(metadata: Metadata) -> dict[str, Shape]:
    """The keys of a DCP checkpoint with their global shapes (None: a pickled object)."""
    return {
        key: tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
        for key, md in metadata.state_dict_metadata.items()
    }


@dataclass(frozen=True)
class RankFit:
    """One rank's comparison; combined over ranks by ``combine_fits``."""

    missing: tuple[str, ...]
    not_needed: frozenset[str]  # checkpoint keys under loaded entries this rank lacks
    shape_mismatches: tuple[ShapeMismatch, ...]
    kind_mismatches: tuple[str, ...]
    matched: int  # this rank's keys found in the checkpoint with the same shape and kind
    needed: int  # this rank's keys


def _entry_of(key: str, entries: Iterable[str]) -> bool:
    return any(key == e or key.startswith(e + ".") for e in entries)


def fit_rank(
    local: Mapping[str, Shape], saved: Mapping[str, Shape], entries: Sequence[str]
) -> RankFit:
    """Compare this rank's keys (``local``) with the checkpoint's (``saved``).

    ``entries`` are the top-level keys of the state being loaded.
    """
    missing = sorted(k for k in local if k not in saved)
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
    if not strict:
        missing, unexpected = [], []
    if not (missing or unexpected or shapes or kinds):
        return None
    # "Another model": most keys a rank needs are absent or do not fit.
    other_model = any(f.matched < _OTHER_MODEL_OVERLAP * f.needed for f in fits)
    return StateDictMismatchError(
        path,
        missing=missing,
        unexpected=unexpected,
        shape_mismatches=shapes,
        kind_mismatches=kinds,
        other_model=other_model,
    )
