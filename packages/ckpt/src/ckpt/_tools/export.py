"""Export a checkpoint's model weights: safetensors (one file or sharded) or torch.save.

Keys are named as the unwrapped model's ``state_dict()`` (the ``model.`` entry prefix
and wrapper prefixes such as DDP's ``module.`` removed), so Hugging Face
``from_pretrained`` loads an exported transformers model.

[Note: streaming export]
A safetensors file is an 8-byte header length, a JSON header giving every tensor's
dtype, shape and byte range, then the tensors' bytes back to back. The checkpoint's
metadata gives every shape and dtype up front, so the header is written first and
then each tensor's bytes in order, chunk by chunk as saved, converted (``dtype``) in
blocks of at most ``buffer_bytes``: memory stays at the largest chunk (at most the
largest tensor) plus that buffer, whatever the model's size. The ``safetensors``
library writes from a dict of whole tensors in memory, so the writer here is ours;
files are read back with ``safetensors`` in the tests. A ``torch.save`` file has no
such layout: that format holds the whole model in memory once.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from ckpt._errors import CheckpointError, DiskFullError
from ckpt._format.disk_space import check_space, disk_full, is_disk_full
from ckpt._format.reader import CheckpointReader, TensorInfo

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "ExportExistsError",
    "ExportTargetError",
    "ExportedFile",
    "export",
    "model_tensors",
    "parse_size",
    "plan_shards",
    "target_format",
]

DEFAULT_BUFFER_BYTES = 64 << 20
INDEX_NAME = "model.safetensors.index.json"
# Name components that torch.compile, FSDP1 and activation checkpointing insert.
_WRAPPER_COMPONENTS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_OPTIMIZER_ENTRIES = ("optim", "optimizer", "optimizers")

_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}

ProgressFn = Callable[[str, int], None]  # (tensor name, bytes written) after each block


@dataclass(frozen=True)
class ExportedFile:
    """One written file and the tensors it holds."""

    path: Path
    names: tuple[str, ...]
    nbytes: int


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"``, ``"1000"`` -> bytes (as Hugging Face reads them)."""
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 1 << 10,
        "MIB": 1 << 20,
        "GIB": 1 << 30,
        "TIB": 1 << 40,
    }
    stripped = text.strip().upper()
    number = stripped.rstrip("KMGTIB")
    unit = stripped[len(number) :]
    try:
        value = float(number) * units[unit]
    except (KeyError, ValueError):
        raise ValueError(
            f"size {text!r}: write e.g. 5GB, 500MB, 2GiB or a number of bytes"
        ) from None
    if value < 1:
        raise ValueError(f"size {text!r} must be at least one byte")
    return int(value)


def _strip_wrappers(name: str) -> str:
    """The unwrapped model's name: wrapper components dropped anywhere, DDP's
    ``module`` only in front (a user's own submodule may be called ``module``)."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_COMPONENTS]
    if len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def model_tensors(reader: CheckpointReader, entry: str | None) -> dict[str, TensorInfo]:
    """The model's tensors under the unwrapped model's ``state_dict()`` names.

    ``entry`` is the top-level state key of the model (``"model"`` as in
    ``ckpt.save({"model": model, ...})``); ``""`` takes every tensor as is; None picks
    ``"model"`` when present, else every tensor outside an optimizer entry (a
    ``dcp.save(model.state_dict())`` directory).
    """
    tensors = reader.tensors()
    entries = sorted({k.split(".", 1)[0] for k in tensors})
    if entry is None:
        if "model" in entries:
            entry = "model"
        else:
            entry = ""
            tensors = {
                k: v for k, v in tensors.items() if k.split(".", 1)[0] not in _OPTIMIZER_ENTRIES
            }
    if entry:
        prefix = entry + "."
        picked = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not picked:
            raise CheckpointError(
                f"{reader.path} has no tensors under {entry!r}; its entries are "
                f"{', '.join(entries)} (choose one with --entry)"
            )
    else:
        picked = dict(tensors)
    flat = [k for k in picked if k.endswith("_flat_param")]
    if flat:
        raise CheckpointError(
            f"{reader.path} holds fsdp LOCAL flat parameters ({flat[0]}, ...), which have "
            f"no original names; save with the SHARDED or FULL state-dict type to export"
        )
    out: dict[str, TensorInfo] = {}
    for key, info in picked.items():
        name = _strip_wrappers(key)
        if name in out:
            raise CheckpointError(f"{key} and another key both become {name!r} unwrapped")
        out[name] = info
    return out


def plan_shards(sizes: Mapping[str, int], max_shard_size: int | None) -> list[list[str]]:
    """Names per output file, in order; a new file starts before one would overflow.

    A tensor larger than ``max_shard_size`` gets a file of its own (as in Hugging
    Face's ``save_pretrained``). None: everything in one file.
    """
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if max_shard_size is not None and shards[-1] and used + size > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _target_dtype(info: TensorInfo, dtype: torch.dtype | None) -> torch.dtype:
    """``dtype`` applies to floating-point tensors; integer and bool ones keep theirs."""
    if dtype is not None and info.dtype.is_floating_point:
        return dtype
    return info.dtype


@dataclass(frozen=True)
class _SafetensorsWriter:
    """Streams tensors of one checkpoint into safetensors files ([Note: streaming export])."""

    reader: CheckpointReader
    dtype: torch.dtype | None
    buffer_bytes: int
    progress: ProgressFn | None

    def write(self, path: Path, tensors: Mapping[str, TensorInfo]) -> ExportedFile:
        """Header first (every shape and offset is known), then the bytes in order."""
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, info in tensors.items():
            target = _target_dtype(info, self.dtype)
            if target not in _SAFETENSORS_DTYPES:
                raise CheckpointError(f"{name}: safetensors has no dtype {target}")
            size = info.numel * target.itemsize
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[target],
                "shape": list(info.shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        with open(path, "wb") as f:  # a staged path: export() renames it into place
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for name, info in tensors.items():
                self._write_tensor(f, name, info)
        return ExportedFile(path, tuple(tensors), offset)

    def _write_tensor(self, f: IO[bytes], name: str, info: TensorInfo) -> None:
        target = _target_dtype(info, self.dtype)
        written = 0
        for block in self.reader.iter_row_blocks(info, target, self.buffer_bytes):
            if block.numel():
                f.write(block.view(torch.uint8).numpy().data)
            written += block.numel() * target.itemsize
            if self.progress is not None:
                self.progress(name, block.numel() * target.itemsize)
        expected = info.numel * target.itemsize
        if written != expected:
            raise CheckpointError(f"{name}: wrote {written} bytes, expected {expected}")


class ExportTargetError(ValueError):
    """``--to`` names something an export will not write: an unknown suffix, a file
    where a folder is meant (or the other way round). A usage error: nothing was
    written."""


class ExportExistsError(ExportTargetError):
    """The target already holds an export (or another file) and ``overwrite`` is off."""


_SUFFIX_FORMATS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}
_FORMATS = ("safetensors", "sharded", "torch")
# Bytes beyond the tensors' data an export may write (headers, index, torch.save framing).
_HEADER_SLACK = 1 << 20
# What a sharded export writes into its folder; re-exporting replaces exactly these.
_SHARD_NAME = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


def target_format(to: Path, fmt: str | None) -> str:
    """The format to write ``to`` in: ``fmt`` if given, else by ``to``'s suffix
    (``.safetensors`` one file, ``.pt``/``.pth``/``.bin`` torch.save, none or an
    existing folder: sharded). Any other suffix is refused rather than guessed."""
    if fmt is not None and fmt not in _FORMATS:
        raise ExportTargetError(f"format {fmt!r}: choose safetensors, sharded or torch")
    if to.is_dir():
        if fmt not in (None, "sharded"):
            raise ExportTargetError(
                f"--to {to} is a folder, and --format {fmt} writes one file: give a file "
                f"name (e.g. {to / 'model.safetensors'}) or --format sharded"
            )
        return "sharded"
    if fmt is not None:
        return fmt
    suffix = to.suffix.lower()
    if suffix in _SUFFIX_FORMATS:
        return _SUFFIX_FORMATS[suffix]
    if not suffix:
        return "sharded"
    raise ExportTargetError(
        f"--to {to}: {suffix!r} is not a format ckpt writes; name OUT.safetensors (one "
        "safetensors file), OUT.pt, OUT.pth or OUT.bin (a torch.save file) or a folder "
        "without a suffix (sharded safetensors and model.safetensors.index.json), or "
        "choose with --format"
    )


def _earlier_export(folder: Path) -> list[Path]:
    """The files an earlier sharded export left in ``folder`` (its index, the shards
    the index names, and any ``model*.safetensors``); other files stay."""
    if not folder.is_dir():
        return []
    found = {p for p in folder.iterdir() if _SHARD_NAME.match(p.name) or p.name == INDEX_NAME}
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            found |= {folder / str(name) for name in weight_map.values()}
        except (ValueError, AttributeError, OSError):
            pass  # a broken index is replaced like the rest
    return sorted(p for p in found if p.is_file() and p.parent == folder)


def _check_target(to: Path, fmt: str, overwrite: bool) -> list[Path]:
    """Refuse a target that holds something unless ``overwrite``; returns what a
    sharded export will replace."""
    if fmt == "sharded":
        if to.exists() and not to.is_dir():
            raise ExportTargetError(
                f"--to {to} is a file; a sharded export writes a folder: choose a folder "
                f"name, or a file name ending in .safetensors"
            )
        earlier = _earlier_export(to)
        if earlier and not overwrite:
            names = ", ".join(p.name for p in earlier[:4]) + (", ..." if len(earlier) > 4 else "")
            raise ExportExistsError(
                f"--to {to} already holds an export ({names}); pass --overwrite to replace "
                "it whole (other files in the folder stay), or choose another folder"
            )
        return earlier
    if to.is_dir():
        raise ExportTargetError(f"--to {to} is a folder; --format {fmt} writes one file")
    if to.exists() and not overwrite:
        raise ExportExistsError(
            f"--to {to} already exists; pass --overwrite to replace it, or choose another name"
        )
    return []


def _make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing ancestors; returns those created, outermost
    first, so a failed export can remove them again."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()][::-1]
    for p in missing:
        p.mkdir()
    return missing


def _output_bytes(tensors: Mapping[str, TensorInfo], dtype: torch.dtype | None) -> int:
    return sum(i.numel * _target_dtype(i, dtype).itemsize for i in tensors.values())


def export(
    reader: CheckpointReader,
    to: Path,
    *,
    fmt: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | None = None,
    entry: str | None = None,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    progress: ProgressFn | None = None,
    overwrite: bool = False,
) -> list[ExportedFile]:
    """Write the model of ``reader``'s checkpoint to ``to``; returns the files written.

    ``fmt``: ``"safetensors"`` (one file), ``"sharded"`` (a folder of
    ``model-0000i-of-0000n.safetensors`` files plus ``model.safetensors.index.json``,
    at most ``max_shard_size`` bytes each) or ``"torch"`` (one ``torch.save`` file);
    None chooses by ``to`` (``target_format``), refusing a suffix it does not know.

    All or nothing: the output is written beside the target (``.NAME.partial``) and
    renamed into place when complete, so a failed export (an unreadable chunk, a full
    disk, Ctrl-C) leaves nothing behind, not even the folders it created. An existing
    target is refused unless ``overwrite``; then it is replaced whole: a sharded
    export's earlier shards and index go (files it did not write, such as a
    ``config.json``, stay).
    """
    fmt = target_format(to, fmt)
    tensors = model_tensors(reader, entry)
    if not tensors:
        raise CheckpointError(f"{reader.path} holds no model tensors to export")
    earlier = _check_target(to, fmt, overwrite)
    total = _output_bytes(tensors, dtype)
    staged = to.parent / f".{to.name}.partial"
    created: list[Path] = []
    try:
        created = _make_parents(to.parent)
        check_space(to, total + _HEADER_SLACK, what="export", at=to.parent)
        if staged.is_dir():  # left by an export that was killed
            shutil.rmtree(staged)
        files = _write(
            reader, to, staged, fmt=fmt, tensors=tensors, dtype=dtype,
            max_shard_size=max_shard_size, buffer_bytes=buffer_bytes, progress=progress,
            earlier=earlier,
        )  # fmt: skip
    except BaseException as e:
        if staged.is_dir():
            shutil.rmtree(staged, ignore_errors=True)
        else:
            staged.unlink(missing_ok=True)
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if still empty
        if isinstance(e, Exception) and not isinstance(e, DiskFullError) and is_disk_full(e):
            raise disk_full(to, total, what="export") from e
        raise
    return files


def _write(
    reader: CheckpointReader,
    to: Path,
    staged: Path,
    *,
    fmt: str,
    tensors: Mapping[str, TensorInfo],
    dtype: torch.dtype | None,
    max_shard_size: int | None,
    buffer_bytes: int,
    progress: ProgressFn | None,
    earlier: list[Path],
) -> list[ExportedFile]:
    """Write into ``staged``, then put it in place of ``to`` (see ``export``)."""
    if fmt == "torch":
        out: dict[str, torch.Tensor] = {}
        for name, info in tensors.items():
            out[name] = reader.read_tensor(info).to(_target_dtype(info, dtype))
            if progress is not None:
                progress(name, out[name].numel() * out[name].element_size())
        torch.save(out, staged)
        staged.replace(to)
        return [ExportedFile(to, tuple(out), sum(t.nbytes for t in out.values()))]
    writer = _SafetensorsWriter(reader, dtype, buffer_bytes, progress)
    if fmt == "safetensors":
        written = writer.write(staged, tensors)
        staged.replace(to)
        return [ExportedFile(to, written.names, written.nbytes)]
    staged.mkdir()
    sizes = {n: i.numel * _target_dtype(i, dtype).itemsize for n, i in tensors.items()}
    shards = plan_shards(sizes, max_shard_size)
    files: list[ExportedFile] = []
    for i, names in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        part = {n: tensors[n] for n in names}
        written = writer.write(staged / name, part)
        files.append(ExportedFile(to / name, written.names, written.nbytes))
    index = {
        "metadata": {"total_size": sum(sizes.values())},
        "weight_map": {n: f.path.name for f in files for n in f.names},
    }
    (staged / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if to.is_dir():
        for old in earlier:
            old.unlink(missing_ok=True)
        for new in sorted(staged.iterdir()):
            new.replace(to / new.name)
        staged.rmdir()
    else:
        staged.rename(to)
    return files
