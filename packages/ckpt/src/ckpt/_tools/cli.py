"""The ``ckpt`` program: ls, inspect, verify and export checkpoints, no process group.

Also ``python -m ckpt``. Every command reads through ``CheckpointReader`` and the
manifest functions, so nothing from a checkpoint is ever run ([Note: no code from a
checkpoint]). Progress bars (``rich``, installed with ``shardkit-ckpt[cli]``) appear on a
terminal for hashing and exporting; without rich or a terminal the commands print
only their results.

[Note: a program for scripts]
Scripts branch on the exit status and parse ``--json``, so both are a contract:

- every subcommand takes ``--json``: one JSON document on stdout whatever happens
  (a failure is ``{"error": {"status", "kind", "message", "problems"}}``), with real
  JSON values (``_tools.json_values``), never Python reprs;
- every problem with a checkpoint's files has its status (4: missing, truncated,
  unreadable or differing from the manifest), and the message names the file;
- a reader that goes away (``ckpt inspect CK | head``) ends the program quietly with
  status 0, as for other Unix tools whose output was cut short by choice;
- ``export`` is all or nothing and never replaces a target unless told to.
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

from ckpt._errors import (
    CheckpointError,
    CorruptCheckpointError,
    FileProblem,
    NotACheckpointError,
    SignatureError,
    UnsafeCheckpointError,
)
from ckpt._format import layout
from ckpt._format.file_checks import (
    check_file_set,
    dcp_file_problems,
    dcp_referenced_bytes,
    listed_files,
    manifest_size_problems,
    verify_files,
)
from ckpt._format.manifest import MANIFEST_NAME, check_signature, read_manifest
from ckpt._format.reader import CheckpointReader
from ckpt._format.safe_unpickling import METADATA_NAME, SafeGlobals, check_objects, read_metadata
from ckpt._tools.export import (
    DEFAULT_BUFFER_BYTES,
    ExportTargetError,
    export,
    model_tensors,
    parse_size,
    target_format,
)
from ckpt._tools.json_values import json_value

__all__ = ["EXIT_CORRUPT", "EXIT_NOT_A_CHECKPOINT", "EXIT_UNTRUSTED", "main"]

EXIT_OK = 0
EXIT_ERROR = 1  # anything else (a bug, an I/O error, a full disk)
EXIT_USAGE = 2  # bad arguments (argparse's code), an export target that is taken
EXIT_NOT_A_CHECKPOINT = 3
EXIT_CORRUPT = 4  # files missing, truncated, unreadable, or differing from the manifest
EXIT_UNTRUSTED = 5  # a pickle that would run code, or a keyed-manifest mismatch
EXIT_INTERRUPTED = 130  # Ctrl-C (an export removes what it wrote)

_EPILOG = """exit codes: 0 ok, 1 other error, 2 bad arguments (also: an export target
that exists without --overwrite, or an unknown --to suffix), 3 not a checkpoint,
4 corrupt (a file missing, truncated, unreadable or differing from the manifest;
for ls: a listed checkpoint is), 5 refused as untrusted (a pickle that would run
code, or a manifest not signed with --key-file's key). With --json the output is one
JSON document, {"error": {...}} on failure."""

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


def _problem_docs(problems: Sequence[FileProblem]) -> list[dict[str, str]]:
    return [{"file": p.name, "kind": p.kind, "detail": p.detail} for p in problems]


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=1, allow_nan=False))


def _saved_by(reader: CheckpointReader) -> str:
    """What wrote each stateful entry (``model=fsdp.FullyShardedDataParallel``)."""
    if reader.manifest is None:
        return "torch DCP (no ckpt manifest)"
    saved = reader.manifest.saved_by
    kinds = [f"{k}={v}" for k, v in saved.items() if v not in ("tensor", "object")]
    return ", ".join(kinds) or "-"


def _ls_row(path: Path) -> tuple[dict[str, Any], int]:
    """One checkpoint's row and the status it calls for: its files checked by size
    against the manifest, or (plain DCP) against the metadata's byte ranges."""
    try:
        reader = CheckpointReader(path)
    except UnsafeCheckpointError as e:
        return {"name": path.name, "status": "untrusted", "error": str(e)}, EXIT_UNTRUSTED
    except CorruptCheckpointError as e:
        damaged = {"name": path.name, "status": "damaged", "problems": _problem_docs(e.problems)}
        return damaged, EXIT_CORRUPT
    except CheckpointError as e:
        return {"name": path.name, "status": "unreadable", "error": str(e)}, EXIT_CORRUPT
    manifest = reader.manifest
    if manifest is not None:
        problems = manifest_size_problems(path, manifest)
    else:
        problems = dcp_file_problems(path, reader.metadata)
    row: dict[str, Any] = {
        "name": path.name,
        "status": "damaged" if problems else ("committed" if manifest is not None else "dcp"),
        "bytes": manifest.total_bytes if manifest is not None else _dir_bytes(path),
        "created": _created(reader),
        "world_size": reader.world_size,
        "saved_by": _saved_by(reader),
        "signed": bool(manifest and manifest.mac),
        "problems": _problem_docs(problems),
    }
    return row, EXIT_CORRUPT if problems else EXIT_OK


def _ls(args: argparse.Namespace) -> int:
    root = Path(args.dir).absolute()
    if not root.is_dir():
        raise NotACheckpointError(root, "no such directory")
    candidates = [root] if _is_checkpoint(root) else sorted(p for p in root.iterdir() if p.is_dir())
    rows: list[dict[str, Any]] = []
    status = EXIT_OK
    for path in candidates:
        if path.name.startswith(".") or not _is_checkpoint(path):
            continue
        row, row_status = _ls_row(path)
        rows.append(row)
        status = max(status, row_status)
    partial = list(layout.leftovers(root)) if not _is_checkpoint(root) else []
    for p in partial:
        rows.append({"name": p.name, "status": "partial (interrupted save, never loaded)"})
    if args.json:
        _print_json(rows)
        return status
    if not rows:
        print(f"{root}: no checkpoints")
        return status
    for row in rows:
        if "bytes" not in row:
            print(f"{row['name']:<24} {row['status']}")
            for problem in row.get("problems", ()):
                print(f"    {problem['file']}: {problem['kind']}: {problem['detail']}")
            if "error" in row:
                print(f"    {row['error']}")
            continue
        signed = " signed" if row["signed"] else ""
        damaged = "  DAMAGED" if row["status"] == "damaged" else ""
        print(
            f"{row['name']:<24} {_human(row['bytes']):>10}  {_date(row['created'])}  "
            f"world {row['world_size'] or '?'}  {row['saved_by']}{signed}{damaged}"
        )
        for problem in row["problems"]:
            print(f"    {problem['file']}: {problem['kind']}: {problem['detail']}")
    if status == EXIT_CORRUPT:
        print(
            f"ckpt ls: damaged checkpoints in {root}; `ckpt verify PATH` checks one in full",
            file=sys.stderr,
        )
    return status


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
        "values_read": bool(args.values),
        "objects": {
            k: json_value(objects[k]) if k in objects else None for k in reader.object_keys()
        },
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
        _print_json(doc)
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
        if (path / METADATA_NAME).is_file():
            return _verify_dcp(path, args)
        raise layout.not_a_checkpoint(path)
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
    problems = sorted(problems, key=lambda p: p.name)
    if not problems:
        check_objects(path, read_metadata(path), _safe_globals(args.safe_global))
    doc = {
        "path": str(path),
        "kind": "ckpt",
        "ok": not problems,
        "files": len(manifest.files),
        "bytes": manifest.total_bytes,
        "checksum": manifest.checksum.value,
        "signature_checked": key is not None,
        "problems": _problem_docs(problems),
    }
    signed = ", signature ok" if key is not None else ""
    ok = f"ok ({len(manifest.files)} files, {_human(manifest.total_bytes)}{signed})"
    return _report_verify(path, args, doc, problems, ok)


def _report_verify(
    path: Path,
    args: argparse.Namespace,
    doc: dict[str, Any],
    problems: Sequence[FileProblem],
    ok: str,
) -> int:
    """``verify``'s output (``doc`` as JSON, or each problem or ``ok`` as a line) and
    exit status, the same for both kinds of checkpoint."""
    if args.json:
        _print_json(doc)
    else:
        for problem in problems:
            print(f"{path}: {problem}")
        if not problems:
            print(f"{path}: {ok}")
    return EXIT_CORRUPT if problems else EXIT_OK


def _verify_dcp(path: Path, args: argparse.Namespace) -> int:
    """A plain DCP checkpoint (no manifest): as far as its metadata allows, every data
    file it references is present and long enough, and the non-tensor values are
    readable without running code. There are no checksums to compare."""
    if _key(args) is not None:
        raise SignatureError(path, "it is a plain DCP checkpoint, with no ckpt manifest to sign")
    metadata = read_metadata(path)
    problems = dcp_file_problems(path, metadata)
    if not problems:
        check_objects(path, metadata, _safe_globals(args.safe_global))
    referenced = dcp_referenced_bytes(metadata)
    doc = {
        "path": str(path),
        "kind": "dcp",
        "ok": not problems,
        "files": len(referenced) + 1,  # and .metadata
        "bytes": sum(referenced.values()),
        "checksum": None,
        "signature_checked": False,
        "problems": _problem_docs(problems),
    }
    ok = (
        "ok as far as a plain DCP checkpoint can be checked: the "
        f"{len(referenced)} data files .metadata references are present and long "
        f"enough ({_human(sum(referenced.values()))}); it has no ckpt manifest, so "
        "no checksums were compared"
    )
    return _report_verify(path, args, doc, problems, ok)


def _export(args: argparse.Namespace) -> int:
    fmt = args.format
    if args.max_shard_size is not None and fmt is None:
        fmt = "sharded"
    to = Path(args.to).absolute()
    fmt = target_format(to, fmt)  # an unknown suffix is refused before any reading
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
    if args.verify and reader.manifest is None:
        problems = dcp_file_problems(reader.path, reader.metadata)
        if problems:
            raise CorruptCheckpointError(reader.path, problems)
    dtype = None if args.dtype is None else _DTYPES[args.dtype]
    tensors = model_tensors(reader, args.entry)
    total = sum(
        t.numel * (dtype if dtype and t.dtype.is_floating_point else t.dtype).itemsize
        for t in tensors.values()
    )
    progress = _Progress(not args.quiet)
    with progress.task("export", total) as advance:
        files = export(
            reader,
            to,
            fmt=fmt,
            overwrite=args.overwrite,
            dtype=dtype,
            max_shard_size=None if args.max_shard_size is None else parse_size(args.max_shard_size),
            entry=args.entry,
            buffer_bytes=parse_size(args.buffer_size),
            progress=lambda _name, n: advance(n),
        )
    if args.json:
        _print_json(
            {
                "source": str(reader.path),
                "to": str(to),
                "format": fmt,
                "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
                "bytes": sum(f.nbytes for f in files),
                "files": [
                    {"path": str(f.path), "tensors": len(f.names), "bytes": f.nbytes} for f in files
                ],
            }
        )
        return EXIT_OK
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

    def json_flag(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--json", action="store_true", help="one JSON document on stdout (also on failure)"
        )

    p = add(
        "ls",
        "list the checkpoints of a CheckpointManager directory; each one's files are "
        "checked by size (exit 4 when one is damaged)",
    )
    p.add_argument("dir")
    json_flag(p)
    p.set_defaults(run=_ls)

    p = add("inspect", "keys, shapes, dtypes, bytes and sharding of a checkpoint")
    p.add_argument("path")
    json_flag(p)
    p.add_argument("--values", action="store_true", help="also read the non-tensor values")
    safe(p)
    p.set_defaults(run=_inspect)

    p = add(
        "verify",
        "check every file against the manifest (and the key, if given); a plain DCP "
        "checkpoint as far as its metadata allows (every data file present and long enough)",
    )
    p.add_argument("path")
    json_flag(p)
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
        "(sharded safetensors + model.safetensors.index.json); another suffix needs --format",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing target whole (a folder's earlier shards and index; "
        "other files in it stay)",
    )
    json_flag(p)
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


def _drop_stdout() -> None:
    """Point stdout's file descriptor at /dev/null once its reader has gone away
    (``ckpt ls | head``), so that the interpreter's last flush has nowhere to fail and
    prints no "Exception ignored ... BrokenPipeError" on the way out."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _status_of(error: BaseException) -> int | None:
    """The documented exit status for ``error``; None for a bug (re-raised)."""
    if isinstance(error, ExportTargetError):
        return EXIT_USAGE
    if isinstance(error, NotACheckpointError):
        return EXIT_NOT_A_CHECKPOINT
    if isinstance(error, UnsafeCheckpointError | SignatureError):
        return EXIT_UNTRUSTED
    if isinstance(error, CorruptCheckpointError):
        return EXIT_CORRUPT
    if isinstance(error, CheckpointError | ValueError | OSError):
        return EXIT_ERROR
    return None


def _report(args: argparse.Namespace, error: Exception, status: int) -> None:
    """The error on stderr, and with ``--json`` as the one document on stdout."""
    print(f"ckpt {args.command}: {error}", file=sys.stderr)
    if getattr(args, "json", False):
        problems = getattr(error, "problems", ())
        _print_json(
            {
                "error": {
                    "status": status,
                    "kind": type(error).__name__,
                    "message": str(error),
                    "problems": _problem_docs(problems) if isinstance(problems, tuple) else [],
                }
            }
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ckpt`` program; returns its exit code (see ``--help``).

    See [Note: a program for scripts] for what the statuses and ``--json`` promise.
    """
    args = _parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        try:
            status = run(args)
        except BrokenPipeError:
            raise
        except KeyboardInterrupt:
            print(f"ckpt {args.command}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except Exception as e:
            status_for = _status_of(e)
            if status_for is None:
                raise
            _report(args, e, status_for)
            status = status_for
        sys.stdout.flush()
        return status
    except BrokenPipeError:  # the reader of our output went away: [Note: a program ...]
        _drop_stdout()
        return EXIT_OK


def console_main() -> None:
    """Entry point of the ``ckpt`` console script."""
    sys.exit(main())
