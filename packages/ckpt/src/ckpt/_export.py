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

import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from ckpt._errors import CheckpointError
from ckpt._reader import CheckpointReader, TensorInfo

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "ExportedFile",
    "export",
    "model_tensors",
    "parse_size",
    "plan_shards",
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
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for name, info in tensors.items():
                self._write_tensor(f, name, info)
        tmp.replace(path)
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
) -> list[ExportedFile]:
    """Write the model of ``reader``'s checkpoint to ``to``; returns the files written.

    ``fmt``: ``"safetensors"`` (one file), ``"sharded"`` (a folder of
    ``model-0000i-of-0000n.safetensors`` files plus ``model.safetensors.index.json``,
    at most ``max_shard_size`` bytes each) or ``"torch"`` (one ``torch.save`` file);
    None chooses by ``to``: ``.safetensors`` -> one file, ``.pt``/``.pth``/``.bin``
    -> torch, anything else -> a sharded folder.
    """
    if fmt is None:
        suffix = to.suffix.lower()
        fmt = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}.get(
            suffix, "sharded"
        )
    if fmt not in ("safetensors", "sharded", "torch"):
        raise ValueError(f"format {fmt!r}: choose safetensors, sharded or torch")
    tensors = model_tensors(reader, entry)
    if not tensors:
        raise CheckpointError(f"{reader.path} holds no model tensors to export")
    if fmt == "torch":
        to.parent.mkdir(parents=True, exist_ok=True)
        out: dict[str, torch.Tensor] = {}
        for name, info in tensors.items():
            out[name] = reader.read_tensor(info).to(_target_dtype(info, dtype))
            if progress is not None:
                progress(name, out[name].numel() * out[name].element_size())
        tmp = to.with_name(to.name + ".tmp")
        torch.save(out, tmp)
        tmp.replace(to)
        return [ExportedFile(to, tuple(out), sum(t.nbytes for t in out.values()))]
    writer = _SafetensorsWriter(reader, dtype, buffer_bytes, progress)
    if fmt == "safetensors":
        to.parent.mkdir(parents=True, exist_ok=True)
        return [writer.write(to, tensors)]
    to.mkdir(parents=True, exist_ok=True)
    sizes = {n: i.numel * _target_dtype(i, dtype).itemsize for n, i in tensors.items()}
    shards = plan_shards(sizes, max_shard_size)
    files: list[ExportedFile] = []
    for i, names in enumerate(shards):
        file = to / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        part = {n: tensors[n] for n in names}
        files.append(writer.write(file, part))
    index = {
        "metadata": {"total_size": sum(sizes.values())},
        "weight_map": {n: f.path.name for f in files for n in f.names},
    }
    (to / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files
