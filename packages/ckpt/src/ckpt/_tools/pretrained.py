"""Load pretrained safetensors weights into a sharded model, each rank reading its part.

``load_pretrained(model, path)`` fills a model from a Hugging Face style safetensors
file or folder (``model.safetensors``, or shards with ``model.safetensors.index.json``):

* an fsdp model (built on the meta device or not): every rank reads, with safetensors
  slicing, only the rows that cover the elements of its own shards
  (``fsdp.local_shards``) and copies them into its shard storage; nothing is
  gathered, so a rank's memory is its shard plus one slice, never the full model;
* a DDP model (with or without zero_optim): the parameters are whole on every rank,
  so each rank reads a balanced share of the tensors and broadcasts it to the others;
* a plain module (no process group): every tensor is read.

[Note: pretrained names]
The file's keys are the unwrapped model's ``state_dict()`` names. A tied parameter may
appear under any one of its names (Hugging Face writes ``transformer.wte.weight`` and
omits ``lm_head.weight``); non-persistent buffers are never expected in the file.
Checks (missing, unexpected, shape) are made from names and shapes alone, the same on
every rank, before any tensor is read, so a mismatch raises everywhere and changes
nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import Tensor, nn

from ckpt._errors import NotACheckpointError, ShapeMismatch, StateDictMismatchError
from ckpt._format.manifest import balance_files
from fsdp import is_flat_parameter, local_shards, unwrapped_name

__all__ = ["PretrainedLoad", "load_pretrained"]

INDEX_NAME = "model.safetensors.index.json"


@dataclass
class PretrainedLoad:
    """What one rank read: for logs and for the memory claims in the tests."""

    tensors: int = 0  # tensors (or slices of tensors) read from the files
    bytes_read: int = 0  # bytes of the slices this rank read
    largest_read: int = 0  # bytes of the largest single slice (the transient buffer)
    files: list[Path] = field(default_factory=list)


class _Source:
    """The safetensors file(s) of a pretrained model: key -> file, sliced reads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.key_file: dict[str, Path] = {}
        if path.is_dir() and (path / INDEX_NAME).is_file():
            index = json.loads((path / INDEX_NAME).read_text())
            self.key_file = {str(k): path / str(v) for k, v in index["weight_map"].items()}
            return
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
        if not files:
            raise NotACheckpointError(
                path,
                f"not a .safetensors file nor a folder of them (model.safetensors, or "
                f"shards with {INDEX_NAME})",
            )
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118  (a safe_open handle, not a dict)
                    self.key_file[str(key)] = file

    def shape(self, key: str) -> tuple[int, ...]:
        """The saved shape of ``key`` (from the file's header; no data read)."""
        with safe_open(str(self.key_file[key]), framework="pt") as handle:
            return tuple(handle.get_slice(key).get_shape())

    def read_range(self, key: str, shape: torch.Size, start: int, end: int) -> Tensor:
        """Elements ``[start, end)`` of the flattened tensor, reading whole rows only
        of the rows they touch (safetensors slices along dimension 0).

        The file is opened (memory-mapped) for this read only, so the pages it touched
        stop counting against the process once the slice is copied out.
        """
        with safe_open(str(self.key_file[key]), framework="pt") as handle:
            sliced = handle.get_slice(key)
            if len(shape) == 0:
                whole: Tensor = sliced[...]
                return whole.reshape(-1)[start:end].clone()
            row = math.prod(shape[1:])
            if row == 0:
                return torch.empty(0)
            r0, r1 = start // row, -(-end // row)
            rows: Tensor = sliced[r0:r1]
            return rows.reshape(-1)[start - r0 * row : end - r0 * row]


@dataclass(frozen=True)
class _Target:
    """One tensor of the model to fill: where it goes and which names it may have."""

    names: tuple[str, ...]  # the first is the primary name; the rest are tied aliases
    shape: torch.Size
    start: int  # flattened range to fill (the whole tensor unless an fsdp shard)
    end: int
    dest: Tensor  # where the values go: a 1-D shard view, or the whole tensor
    broadcast: Tensor | None = None  # DDP: the whole tensor to broadcast from its reader


def _whole_tensors(model: nn.Module, skip: set[str]) -> Iterator[tuple[tuple[str, ...], Tensor]]:
    """Parameters outside fsdp's shards and persistent buffers, with all their names."""
    groups: dict[int, list[str]] = {}
    tensors: dict[int, Tensor] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for kind in (module._parameters, module._buffers):
            for name, t in kind.items():
                if t is None or is_flat_parameter(t):
                    continue
                if kind is module._buffers and name in module._non_persistent_buffers_set:
                    continue
                full = unwrapped_name(f"{mod_name}.{name}" if mod_name else name)
                if full in skip:
                    continue
                names = groups.setdefault(id(t), [])
                if full not in names:
                    names.append(full)
                tensors[id(t)] = t
    for key, names in groups.items():
        yield tuple(names), tensors[key]


def _non_persistent(model: nn.Module) -> set[str]:
    out: set[str] = set()
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for name in module._non_persistent_buffers_set:
            out.add(unwrapped_name(f"{mod_name}.{name}" if mod_name else name))
    return out


def _group_of(process_group: Any) -> Any:
    if process_group is not None:
        return process_group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def load_pretrained(
    model: nn.Module,
    path: str | Path,
    *,
    strict: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> PretrainedLoad:
    """Fill ``model``'s parameters and persistent buffers from safetensors weights.

    Call on every rank. ``model`` is an fsdp model (each rank reads only the slices
    its shards hold; a meta-device model wrapped with fsdp is fine, its shards are
    overwritten), a DDP model (each rank reads a share and broadcasts it; pass the
    DDP model, with zero_optim or any optimizer, before training) or a plain
    module. ``path`` is a ``.safetensors`` file or a folder as ``save_pretrained``
    writes it. Keys are the unwrapped model's names ([Note: pretrained names]);
    ``strict=False`` skips missing and extra keys (shapes must still match).
    Returns what this rank read. Non-persistent buffers are not in such files: a
    meta-device model must materialise them itself (``param_init_fn``).
    """
    source_path = Path(path).absolute()
    report = PretrainedLoad()
    group = _group_of(process_group)
    is_ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    assert isinstance(inner, nn.Module)
    source = _Source(source_path)
    report.files = sorted(set(source.key_file.values()))
    targets: list[_Target] = []
    shards = local_shards(inner)
    sharded_names = {s.name for s in shards} | {a for s in shards for a in s.aliases}
    for s in shards:
        targets.append(_Target((s.name, *s.aliases), s.shape, s.start, s.end, s.local))
    for names, tensor in _whole_tensors(inner, sharded_names):
        data = tensor.data
        targets.append(_Target(names, data.shape, 0, data.numel(), data, data if is_ddp else None))
    _check(source, targets, _non_persistent(inner), strict)
    found = [t for t in targets if _key_of(source, t) is not None]
    if is_ddp and group is not None and dist.get_world_size(group) > 1:
        _load_shared(source, found, group, report)
    else:
        for target in found:
            _fill(source, target, report)
    return report


def _key_of(source: _Source, target: _Target) -> str | None:
    return next((n for n in target.names if n in source.key_file), None)


def _fill(source: _Source, target: _Target, report: PretrainedLoad) -> None:
    if target.end <= target.start:
        return
    key = _key_of(source, target)
    assert key is not None
    with torch.no_grad():
        values = source.read_range(key, target.shape, target.start, target.end)
        target.dest.copy_(values.reshape(target.dest.shape))
    nbytes = values.numel() * values.element_size()
    report.tensors += 1
    report.bytes_read += nbytes
    report.largest_read = max(report.largest_read, nbytes)
    del values


def _load_shared(
    source: _Source, targets: list[_Target], group: Any, report: PretrainedLoad
) -> None:
    """DDP: each rank reads a balanced share of the tensors, then broadcasts it."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = {str(i): t.dest.numel() * t.dest.element_size() for i, t in enumerate(targets)}
    shares = balance_files(sizes, world)
    owner = {int(i): r for r, names in enumerate(shares) for i in names}
    for i, target in enumerate(targets):
        if owner[i] == rank:
            _fill(source, target, report)
        whole = target.broadcast
        assert whole is not None
        dist.broadcast(whole, src=dist.get_global_rank(group, owner[i]), group=group)


def _check(source: _Source, targets: list[_Target], ignorable: set[str], strict: bool) -> None:
    """Names and shapes against the file(s), before anything is read."""
    missing: list[str] = []
    shapes: list[ShapeMismatch] = []
    claimed: set[str] = set()
    for target in targets:
        claimed.update(target.names)
        key = _key_of(source, target)
        if key is None:
            missing.append(target.names[0])
            continue
        saved = source.shape(key)
        if saved != tuple(target.shape):
            shapes.append(ShapeMismatch(key, saved, tuple(target.shape)))
    unexpected = sorted(k for k in source.key_file if k not in claimed and k not in ignorable)
    if not strict:
        missing, unexpected = [], []
    if missing or unexpected or shapes:
        raise StateDictMismatchError(
            source.path,
            missing=sorted(missing),
            unexpected=unexpected,
            shape_mismatches=shapes,
        )
