"""Reading a checkpoint's pickles without ever running code from them.

[Note: no code from a checkpoint]
A DCP checkpoint holds pickles in two places: the ``.metadata`` file (DCP's
``Metadata`` dataclass tree) and, inside the data files, every non-tensor value of the
state (``torch.save`` of the object). Unpickling calls whatever callables the pickle
names, so a checkpoint written by someone else could run any code on every rank. DCP's
own reader unpickles both without restriction; ckpt never lets it:

* ``.metadata`` goes through :class:`_MetadataUnpickler`, whose ``find_class`` admits
  only the types DCP itself writes there (``_METADATA_GLOBALS``: its metadata
  dataclasses, ``torch.Size``, dtypes, layouts, paths) and raises
  :class:`~ckpt.UnsafeCheckpointError` for anything else, before any callable is
  called. Every global a pickle uses passes through ``find_class`` (extension codes
  too), and calling an admitted type only builds a value.
* Non-tensor values are read by ``torch.load(weights_only=True)``: primitives,
  containers, tensors and whatever the caller lists in ``safe_globals`` (an explicit
  argument of ``load``/``verify``/the CLI, passed to torch's ``safe_globals``).
* Tensors were already read with ``weights_only=True`` by DCP's reader.

:class:`SafeFileSystemReader` and :class:`SafeLoadPlanner` plug both into DCP's load;
the reader also keeps the metadata it read, so a load unpickles ``.metadata`` once per
rank (ckpt's shape check and DCP's planning share it).
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import filesystem as _dcp_filesystem
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ckpt._errors import CorruptCheckpointError, UnsafeCheckpointError, file_problem
from ckpt._format.flat_pieces import FlatPieces
from ckpt._format.save_planner import raise_capture_problems

__all__ = [
    "METADATA_NAME",
    "SafeFileSystemReader",
    "SafeGlobals",
    "SafeLoadPlanner",
    "check_objects",
    "load_object",
    "read_metadata",
    "unpickle_metadata",
]

METADATA_NAME = ".metadata"

# What callers may add to the objects torch.load(weights_only=True) admits: classes and
# functions, or (callable, "module.name") pairs, exactly as torch.serialization.safe_globals.
SafeGlobals = Sequence[Callable[..., Any] | tuple[Callable[..., Any], str]]


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> object for everything DCP writes into ``.metadata``."""
    admitted: dict[tuple[str, str], Any] = {}
    for cls in (
        _dcp_metadata.Metadata,
        _dcp_metadata.TensorStorageMetadata,
        _dcp_metadata.BytesStorageMetadata,
        _dcp_metadata.ChunkStorageMetadata,
        _dcp_metadata.TensorProperties,
        _dcp_metadata.MetadataIndex,
        _dcp_metadata.StorageMeta,
        _dcp_metadata._MEM_FORMAT_ENCODING,
        _dcp_filesystem._StorageInfo,
    ):
        admitted[(cls.__module__, cls.__qualname__)] = cls
    admitted[("torch", "Size")] = torch.Size
    # dtypes pickle as the global torch.<name> (torch.float32, ...)
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            admitted[("torch", name)] = value
    # TensorProperties pickles its layout through this lookup by name
    admitted[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    # StorageMeta.checkpoint_id is the path the checkpoint was written to
    for path_cls in (
        pathlib.PosixPath,
        pathlib.WindowsPath,
        pathlib.PurePosixPath,
        pathlib.PureWindowsPath,
    ):
        admitted[("pathlib", path_cls.__name__)] = path_cls
    for builtin in (set, frozenset):
        admitted[("builtins", builtin.__name__)] = builtin
    return admitted


_METADATA_GLOBALS = _metadata_globals()


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only DCP's metadata types (see [Note: no code ...])."""

    def __init__(self, file: IO[bytes], where: Path) -> None:
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        found = _METADATA_GLOBALS.get((module, name))
        if found is None:
            raise UnsafeCheckpointError(
                self._where,
                METADATA_NAME,
                f"{module}.{name}",
                "DCP's metadata never holds it; it is refused before anything is run",
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(
            self._where, METADATA_NAME, "a persistent id", "DCP's metadata never holds one"
        )


def read_metadata(directory: Path) -> Metadata:
    """``directory``'s DCP metadata, unpickled with only DCP's own types admitted.

    Raises ``UnsafeCheckpointError`` for a pickle naming anything else, and
    ``CorruptCheckpointError`` for a missing, truncated or malformed file, so a broken
    checkpoint never reaches the caller as a raw ``AttributeError`` from DCP.
    """
    try:
        with open(directory / METADATA_NAME, "rb") as f:
            return unpickle_metadata(f, directory, METADATA_NAME)
    except FileNotFoundError:
        raise file_problem(
            directory, METADATA_NAME, "unreadable", "missing: a DCP checkpoint always has one"
        ) from None


def unpickle_metadata(stream: IO[bytes], directory: Path, name: str) -> Metadata:
    """DCP metadata pickled in ``stream`` up to its end (``name`` in ``directory``, for
    messages), with the checks of :func:`read_metadata`."""

    def broken(detail: str) -> CorruptCheckpointError:
        return file_problem(directory, name, "unreadable", detail)

    try:
        metadata = _MetadataUnpickler(stream, directory).load()
        trailing = stream.read(1)
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # any malformed pickle: EOFError, UnpicklingError, TypeError, ...
        raise broken(f"not a DCP metadata pickle ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise broken(f"holds a {type(metadata).__name__}, not DCP's Metadata")
    if trailing:
        raise broken("bytes follow the pickle (DCP writes exactly one)")
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(
        metadata.storage_data, (dict, type(None))
    ):
        raise broken("its state_dict_metadata or storage_data is not a dict")
    for info in (metadata.storage_data or {}).values():
        file = getattr(info, "relative_path", None)
        plain = isinstance(file, str) and Path(file).name == file and file not in ("", ".", "..")
        if not plain or "\\" in str(file):
            raise UnsafeCheckpointError(
                directory,
                name,
                f"a data file path {file!r}",
                "DCP names its data files inside the checkpoint directory; this one is not",
            )
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def load_object(data: IO[bytes], directory: Path, key: str, safe_globals: SafeGlobals) -> Any:
    """One non-tensor value of a checkpoint, read with ``weights_only`` semantics.

    ``safe_globals`` widens what is admitted (torch's ``safe_globals``); anything else
    raises ``UnsafeCheckpointError`` naming ``key`` and the refused global.
    """
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            directory,
            key,
            _refused_global(str(e)),
            "torch.load(weights_only=True) refused it; if you trust this checkpoint and "
            "the type, pass it in safe_globals=[...]",
        ) from None


def _refused_global(message: str) -> str:
    """The global torch's weights-only unpickler named in its error, or its last line."""
    named = re.search(r"GLOBAL ([\w.]+)", message)
    if named is not None:
        return named.group(1)
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "an object"


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read safely and only once."""

    _directory: Path
    _metadata: Metadata | None
    on_read: Callable[[], None]  # told when DCP starts reading this rank's items

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._directory = path
        self._metadata = None
        self.on_read = lambda: None

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read, after telling ``on_read`` (which names a failure's step)."""
        self.on_read()
        return super().read_data(plan, planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata (restricted unpickling; cached for the load)."""
        if self._metadata is None:
            self._metadata = read_metadata(self._directory)
        self._metadata.storage_meta = self._metadata.storage_meta or StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with weights_only.

    It also reads into :class:`~ckpt._format.flat_pieces.FlatPieces` (an fsdp rank's runs of its
    parameters, [Note: loading runs] in ``_wrappers/fsdp1_runs.py``): DCP's planner looks targets
    up only on tensors, and its set-up step replaces values it does not know with None,
    so the pieces are set aside during it and looked up here. A ``CaptureProblem`` in
    the template fails this rank's planning step, which DCP reports on every rank.
    """

    _directory: Path
    _safe_globals: SafeGlobals

    def __init__(
        self, directory: Path, safe_globals: SafeGlobals, allow_partial_load: bool
    ) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self._directory = directory
        self._safe_globals = safe_globals

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        flat, _ = flatten_state_dict(state_dict)
        raise_capture_problems(flat)
        pieces = {k: v for k, v in flat.items() if isinstance(v, FlatPieces)}
        aside = _set_aside(state_dict, FlatPieces)
        try:
            super().set_up_planner(state_dict, metadata, is_coordinator)
        finally:
            for container, key, value in aside:
                container[key] = value
        self.state_dict.update(pieces)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, FlatPieces):
            return value.__get_tensor_shard__(index)
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Unpickle one non-tensor value safely and put it where DCP would."""
        fqn = read_item.dest_index.fqn
        obj = load_object(value, self._directory, fqn, self._safe_globals)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _set_aside(tree: Any, kind: type) -> list[tuple[Any, Any, Any]]:
    """Replace every ``kind`` value in nested dicts and lists by an empty tensor (which
    DCP's set-up step leaves alone); (container, key, value) to put them back."""
    found: list[tuple[Any, Any, Any]] = []
    items: Iterable[tuple[Any, Any]] = ()
    if isinstance(tree, dict):
        items = list(tree.items())
    elif isinstance(tree, list):
        items = list(enumerate(tree))
    for key, value in items:
        if isinstance(value, kind):
            found.append((tree, key, value))
            tree[key] = torch.empty(0)
        else:
            found.extend(_set_aside(value, kind))
    return found


def check_objects(
    directory: Path,
    metadata: Metadata,
    safe_globals: SafeGlobals,
    keys: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Read every non-tensor value (or those of ``keys``) safely; key -> value.

    Used by ``verify`` and the CLI to prove a checkpoint holds nothing that a load
    would refuse, without a model to load into.
    """
    wanted = None if keys is None else set(keys)
    storage = metadata.storage_data or {}
    out: dict[str, Any] = {}
    for index, info in storage.items():
        fqn = index.fqn
        if wanted is not None and fqn not in wanted:
            continue
        if not isinstance(metadata.state_dict_metadata.get(fqn), BytesStorageMetadata):
            continue
        out[fqn] = load_object(
            io.BytesIO(read_slice(directory, info)), directory, fqn, safe_globals
        )
    return out


def read_slice(directory: Path, info: Any) -> bytes:
    """The bytes of one stored item (a ``_StorageInfo``: file, offset, length)."""
    name = str(info.relative_path)  # a plain file name: read_metadata checked it
    try:
        with open(directory / name, "rb") as f:
            f.seek(int(info.offset))
            data = f.read(int(info.length))
    except FileNotFoundError:
        raise file_problem(
            directory, name, "missing", "referenced by .metadata, not on disk"
        ) from None
    except OSError as e:
        raise file_problem(directory, name, "unreadable", f"{type(e).__name__}: {e}") from None
    if len(data) != int(info.length):
        raise file_problem(
            directory, name, "size", f"an item at {info.offset} runs past the end of file"
        )
    return data
