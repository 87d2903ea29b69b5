"""The ``ckpt`` program: ls, inspect, verify and export checkpoints, no process group.

Also ``python -m ckpt``. Every command reads through ``CheckpointReader`` and the
manifest functions, so nothing from a checkpoint is ever run ([Note: no code from a
checkpoint]). Progress bars (``rich``, installed with ``shardkit-ckpt[cli]``) appear on a
terminal for hashing and exporting; without rich or a terminal the commands print
only their results.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt import _layout
from ckpt._errors import (
    CheckpointError,
    CorruptCheckpointError,
    NotACheckpointError,
    SignatureError,
    UnsafeCheckpointError,
)
from ckpt._export import DEFAULT_BUFFER_BYTES, export, model_tensors, parse_size
from ckpt._manifest import (
    MANIFEST_NAME,
    check_file_set,
    check_signature,
    listed_files,
    verify_files,
)
from ckpt._reader import CheckpointReader
from ckpt._safe_pickle import SafeGlobals, check_objects, read_metadata

__all__ = ["EXIT_CORRUPT", "EXIT_NOT_A_CHECKPOINT", "EXIT_UNTRUSTED", "main"]

EXIT_OK = 0
EXIT_ERROR = 1  # anything else (a bug, an I/O error)
EXIT_USAGE = 2  # argparse's own code for bad arguments
EXIT_NOT_A_CHECKPOINT = 3
EXIT_CORRUPT = 4  # files differ from the manifest, or are unreadable
EXIT_UNTRUSTED = 5  # a pickle that would run code, or a keyed-manifest mismatch

_EPILOG = """exit codes: 0 ok, 1 other error, 2 bad arguments, 3 not a checkpoint,
4 corrupt (files differ from the manifest or cannot be read), 5 refused as untrusted
(a pickle that would run code, or a manifest not signed with --key-file's key)"""

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp64": torch.float64,
    "float64": torch.float64,
}


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class _Progress:
    """A rich progress bar on a terminal; nothing otherwise (or without rich)."""

    def __init__(self, enabled: bool) -> None:
        self._bar: Any = None
        if enabled and sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import (
                    BarColumn,
                    DownloadColumn,
                    Progress,
                    TextColumn,
                    TimeRemainingColumn,
                    TransferSpeedColumn,
                )
            except ImportError:  # ckpt installed without the [cli] extra
                return
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )

    @contextlib.contextmanager
    def task(self, what: str, total: int) -> Iterator[Callable[[int], None]]:
        """A bar for ``total`` bytes; yields ``advance(nbytes)``."""
        if self._bar is None:
            yield lambda n: None
            return
        with self._bar:
            task = self._bar.add_task(what, total=total)
            yield lambda n: self._bar.advance(task, n)


def _safe_globals(names: Sequence[str]) -> SafeGlobals:
    """Import the ``module.Name`` objects the user allows in non-tensor values."""
    out: list[Any] = []
    for name in names:
        module, _, attr = name.rpartition(".")
        if not module:
            raise SystemExit(f"ckpt: --safe-global {name!r}: write module.Name")
        try:
            out.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError) as e:
            raise SystemExit(f"ckpt: --safe-global {name!r}: {e}") from None
    return out


def _key(args: argparse.Namespace) -> bytes | None:
    """The HMAC key from --key-file, else the CKPT_KEY environment variable."""
    if args.key_file is not None:
        return Path(args.key_file).read_bytes().strip()
    env = os.environ.get("CKPT_KEY")
    return env.encode() if env else None


def _created(reader: CheckpointReader) -> float:
    if reader.manifest is not None:
        return reader.manifest.created
    return (reader.path / ".metadata").stat().st_mtime


def _date(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _saved_by(reader: CheckpointReader) -> str:
    """What wrote each stateful entry (``model=fsdp.FullyShardedDataParallel``)."""
    if reader.manifest is None:
        return "torch DCP (no ckpt manifest)"
    saved = reader.manifest.saved_by
    kinds = [f"{k}={v}" for k, v in saved.items() if v not in ("tensor", "object")]
    return ", ".join(kinds) or "-"


def _ls(args: argparse.Namespace) -> int:
    root = Path(args.dir).absolute()
    if not root.is_dir():
        print(f"ckpt ls: {root} is not a directory", file=sys.stderr)
        return EXIT_NOT_A_CHECKPOINT
    candidates = [root] if _is_checkpoint(root) else sorted(p for p in root.iterdir() if p.is_dir())
    rows: list[dict[str, Any]] = []
    for path in candidates:
        if path.name.startswith(".") or not _is_checkpoint(path):
            continue
        try:
            reader = CheckpointReader(path)
        except CheckpointError as e:
            rows.append({"name": path.name, "status": "unreadable", "error": str(e)})
            continue
        rows.append(
            {
                "name": path.name,
                "status": "committed" if reader.manifest is not None else "dcp",
                "bytes": reader.manifest.total_bytes if reader.manifest else _dir_bytes(path),
                "created": _created(reader),
                "world_size": reader.world_size,
                "saved_by": _saved_by(reader),
                "signed": bool(reader.manifest and reader.manifest.mac),
            }
        )
    partial = [p for p in _layout.leftovers(root)] if not _is_checkpoint(root) else []
    for p in partial:
        rows.append({"name": p.name, "status": "partial (interrupted save, never loaded)"})
    if args.json:
        print(json.dumps(rows, indent=1))
        return EXIT_OK
    if not rows:
        print(f"{root}: no checkpoints")
        return EXIT_OK
    for row in rows:
        if "bytes" not in row:
            print(f"{row['name']:<24} {row['status']}")
            continue
        signed = " signed" if row["signed"] else ""
        print(
            f"{row['name']:<24} {_human(row['bytes']):>10}  {_date(row['created'])}  "
            f"world {row['world_size']}  {row['saved_by']}{signed}"
        )
    return EXIT_OK


def _is_checkpoint(path: Path) -> bool:
    return (path / MANIFEST_NAME).is_file() or (path / ".metadata").is_file()


def _inspect(args: argparse.Namespace) -> int:
    reader = CheckpointReader(args.path, _safe_globals(args.safe_global))
    tensors = reader.tensors()
    objects = reader.objects() if args.values else {}
    manifest = reader.manifest
    doc: dict[str, Any] = {
        "path": str(reader.path),
        "kind": "ckpt" if manifest is not None else "dcp",
        "world_size": reader.world_size,
        "tensors": {
            k: {
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "bytes": t.nbytes,
                "sharding": t.sharding,
                "chunks": len(t.chunks),
            }
            for k, t in tensors.items()
        },
        "objects": {k: repr(objects[k]) if k in objects else None for k in reader.object_keys()},
        "manifest": None
        if manifest is None
        else {
            "checksum": manifest.checksum.value,
            "created": manifest.created,
            "ckpt_version": manifest.ckpt_version,
            "torch_version": manifest.torch_version,
            "world_size": manifest.world_size,
            "signed": manifest.mac is not None,
            "saved_by": dict(manifest.saved_by),
            "files": {f.name: {"size": f.size, "digest": f.digest} for f in manifest.files},
        },
    }
    if args.json:
        print(json.dumps(doc, indent=1))
        return EXIT_OK
    print(f"{reader.path}  ({doc['kind']}, written by {reader.world_size} rank(s))")
    if manifest is not None:
        print(
            f"manifest: {len(manifest.files)} files, {_human(manifest.total_bytes)}, "
            f"{manifest.checksum.value}{', signed' if manifest.mac else ''}, "
            f"{_date(manifest.created)}, ckpt {manifest.ckpt_version}, "
            f"torch {manifest.torch_version}"
        )
        if manifest.saved_by:
            print("saved: " + ", ".join(f"{k}={v}" for k, v in manifest.saved_by.items()))
    width = max((len(k) for k in tensors), default=10)
    total = 0
    for key, t in tensors.items():
        total += t.nbytes
        shape = "x".join(map(str, t.shape)) or "scalar"
        print(
            f"  {key:<{width}}  {shape:>14}  {str(t.dtype).removeprefix('torch.'):<9} "
            f"{_human(t.nbytes):>10}  {t.sharding}"
        )
    for key in reader.object_keys():
        shown = f" = {objects[key]!r}"[:80] if key in objects else ""
        print(f"  {key:<{width}}  (object){shown}")
    print(f"{len(tensors)} tensors, {_human(total)}; {len(reader.object_keys())} objects")
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    path = Path(args.path).absolute()
    if not (path / MANIFEST_NAME).is_file():
        if (path / ".metadata").is_file():
            print(
                f"ckpt verify: {path} is a plain DCP checkpoint without a ckpt manifest: "
                f"there are no sizes or checksums to check it against",
                file=sys.stderr,
            )
            return EXIT_NOT_A_CHECKPOINT
        raise _layout.not_a_checkpoint(path)
    from ckpt._manifest import read_manifest

    manifest = read_manifest(path)
    key = _key(args)
    if key is not None:
        check_signature(manifest, key, path)
    problems = check_file_set(manifest, listed_files(path))
    progress = _Progress(not args.quiet)
    with progress.task("verify", manifest.total_bytes) as advance:
        for record in manifest.files:
            problems += verify_files(path, manifest, [record.name])
            advance(record.size)
    for problem in sorted(problems, key=lambda p: p.name):
        print(f"{path}: {problem}")
    if problems:
        return EXIT_CORRUPT
    check_objects(path, read_metadata(path), _safe_globals(args.safe_global))
    signed = ", signature ok" if key is not None else ""
    print(f"{path}: ok ({len(manifest.files)} files, {_human(manifest.total_bytes)}{signed})")
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    reader = CheckpointReader(args.path, _safe_globals(args.safe_global))
    key = _key(args)
    if key is not None:
        if reader.manifest is None:
            raise SignatureError(reader.path, "it has no ckpt manifest to check")
        check_signature(reader.manifest, key, reader.path)
    if args.verify and reader.manifest is not None:
        problems = check_file_set(reader.manifest, listed_files(reader.path))
        problems += verify_files(
            reader.path, reader.manifest, [f.name for f in reader.manifest.files]
        )
        if problems:
            raise CorruptCheckpointError(reader.path, problems)
    dtype = None if args.dtype is None else _DTYPES[args.dtype]
    tensors = model_tensors(reader, args.entry)
    total = sum(
        t.numel * (dtype if dtype and t.dtype.is_floating_point else t.dtype).itemsize
        for t in tensors.values()
    )
    fmt = args.format
    if args.max_shard_size is not None and fmt is None:
        fmt = "sharded"
    progress = _Progress(not args.quiet)
    with progress.task("export", total) as advance:
        files = export(
            reader,
            Path(args.to),
            fmt=fmt,
            dtype=dtype,
            max_shard_size=None if args.max_shard_size is None else parse_size(args.max_shard_size),
            entry=args.entry,
            buffer_bytes=parse_size(args.buffer_size),
            progress=lambda _name, n: advance(n),
        )
    for f in files:
        print(f"{f.path}: {len(f.names)} tensors, {_human(f.nbytes)}")
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckpt",
        description="Look into, check and convert ckpt and torch DCP checkpoints "
        "(no process group; nothing from a checkpoint is ever run).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=_EPILOG)
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        return p

    def safe(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--safe-global",
            action="append",
            default=[],
            metavar="MODULE.NAME",
            help="admit this class or function in non-tensor values (repeatable); only "
            "for checkpoints you trust",
        )

    def keyed(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--key-file",
            help="file holding the HMAC key the checkpoint was saved with (default: "
            "the CKPT_KEY environment variable); the manifest must be signed with it",
        )

    p = add("ls", "list the checkpoints of a CheckpointManager directory")
    p.add_argument("dir")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_ls)

    p = add("inspect", "keys, shapes, dtypes, bytes and sharding of a checkpoint")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--values", action="store_true", help="also read the non-tensor values")
    safe(p)
    p.set_defaults(run=_inspect)

    p = add("verify", "check every file against the manifest (and the key, if given)")
    p.add_argument("path")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    keyed(p)
    safe(p)
    p.set_defaults(run=_verify)

    p = add("export", "write the model weights as safetensors or a torch.save file")
    p.add_argument("path")
    p.add_argument(
        "--to",
        required=True,
        help="OUT.safetensors (one file), OUT.pt/.pth/.bin (torch.save) or a folder "
        "(sharded safetensors + model.safetensors.index.json)",
    )
    p.add_argument("--format", choices=("safetensors", "sharded", "torch"))
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="cast floating-point tensors")
    p.add_argument("--max-shard-size", help="e.g. 5GB, 500MB (sharded folder)")
    p.add_argument(
        "--entry",
        help="state entry holding the model (default: 'model' if present, else every "
        "tensor outside an optimizer entry; '' for every tensor)",
    )
    p.add_argument(
        "--buffer-size",
        default=str(DEFAULT_BUFFER_BYTES),
        help="conversion buffer (memory beyond the largest tensor), default 64MiB",
    )
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip checking the files against the manifest first",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    keyed(p)
    safe(p)
    p.set_defaults(run=_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ckpt`` program; returns its exit code (see ``--help``)."""
    args = _parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except NotACheckpointError as e:
        print(f"ckpt {args.command}: {e}", file=sys.stderr)
        return EXIT_NOT_A_CHECKPOINT
    except (UnsafeCheckpointError, SignatureError) as e:
        print(f"ckpt {args.command}: {e}", file=sys.stderr)
        return EXIT_UNTRUSTED
    except CorruptCheckpointError as e:
        print(f"ckpt {args.command}: {e}", file=sys.stderr)
        return EXIT_CORRUPT
    except (CheckpointError, ValueError, OSError) as e:
        print(f"ckpt {args.command}: {e}", file=sys.stderr)
        return EXIT_ERROR


def console_main() -> None:
    """Entry point of the ``ckpt`` console script."""
    sys.exit(main())
