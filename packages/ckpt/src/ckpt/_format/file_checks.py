"""Checks of a checkpoint's files against what it says it holds: the cheap ones (sizes
only, no hashing) and the checksums.

Two kinds of checkpoint, two sources of truth:

- a ckpt checkpoint's manifest records every file's exact size, so a stat per file
  finds a missing, extra, truncated or grown file (``manifest_size_problems``); the
  checksums (:func:`verify_files`) are the expensive second step;
- a plain DCP checkpoint (torch's FSDP, ``dcp.save``) has no manifest, but its
  ``.metadata`` says which file holds each stored item, at which offset and how many
  bytes long (DCP's ``_StorageInfo``): every file it references must exist and reach
  at least the end of its last item (``dcp_file_problems``). A file grown, altered
  in place or left over beside them cannot be told from a good one this way.

``ckpt ls`` runs the first (or the second) on every checkpoint it lists; ``ckpt
verify`` runs the second on plain DCP checkpoints, where it is all there is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata

from ckpt._errors import FileProblem
from ckpt._format.manifest import MANIFEST_NAME, FileRecord, Manifest, hash_file

__all__ = [
    "check_file_set",
    "dcp_file_problems",
    "dcp_referenced_bytes",
    "listed_files",
    "manifest_size_problems",
    "verify_files",
]


def manifest_size_problems(directory: Path, manifest: Manifest) -> list[FileProblem]:
    """Files missing, extra, or of another size than the manifest records."""
    problems = check_file_set(manifest, listed_files(directory))
    for record in manifest.files:
        try:
            size = (directory / record.name).stat().st_size
        except FileNotFoundError:
            continue  # reported by check_file_set
        except OSError as e:
            problems.append(FileProblem(record.name, "unreadable", f"{type(e).__name__}: {e}"))
            continue
        problems += _size_problem(record, size)
    return sorted(problems, key=lambda p: p.name)


def _size_problem(record: FileRecord, size: int) -> list[FileProblem]:
    if size == record.size:
        return []
    how = "truncated" if size < record.size else "grown"
    detail = f"{how}: {size} bytes on disk, manifest says {record.size}"
    return [FileProblem(record.name, "size", detail)]


def dcp_referenced_bytes(metadata: Metadata) -> dict[str, int]:
    """Data file name -> the least size it must have: the end of its last stored item
    (``offset + length``, exclusive)."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        end = int(info.offset) + int(info.length)
        needed[name] = max(needed.get(name, 0), end)
    return needed


def dcp_file_problems(directory: Path, metadata: Metadata) -> list[FileProblem]:
    """Every data file ``metadata`` references: present, and long enough for its items."""
    problems: list[FileProblem] = []
    for name, end in sorted(dcp_referenced_bytes(metadata).items()):
        try:
            size = (directory / name).stat().st_size
        except FileNotFoundError:
            problems.append(FileProblem(name, "missing", "referenced by .metadata, not on disk"))
            continue
        except OSError as e:
            problems.append(FileProblem(name, "unreadable", f"{type(e).__name__}: {e}"))
            continue
        if size < end:
            problems.append(
                FileProblem(
                    name,
                    "size",
                    f"truncated: {size} bytes on disk, .metadata places data up to byte {end}",
                )
            )
    return problems


def listed_files(directory: Path) -> list[str]:
    """The names a manifest must cover: every entry of ``directory`` but the manifest."""
    return sorted(p.name for p in directory.iterdir() if p.name != MANIFEST_NAME)


def check_file_set(manifest: Manifest, present: Sequence[str]) -> list[FileProblem]:
    """Files the manifest lists that are absent, and files present it does not list."""
    expected = {f.name for f in manifest.files}
    found = set(present)
    problems = [
        FileProblem(name, "missing", "listed in the manifest but not on disk")
        for name in sorted(expected - found)
    ]
    problems += [
        FileProblem(name, "unexpected", "on disk but not in the manifest")
        for name in sorted(found - expected)
    ]
    return problems


def verify_files(directory: Path, manifest: Manifest, names: Iterable[str]) -> list[FileProblem]:
    """Check the size, then the checksum, of each named file against the manifest.

    Files absent from disk are skipped here (``check_file_set`` reports them); a size
    mismatch is reported without hashing, since it already proves damage.
    """
    records = {f.name: f for f in manifest.files}
    problems: list[FileProblem] = []
    for name in names:
        rec = records[name]
        path = directory / name
        try:
            wrong_size = _size_problem(rec, path.stat().st_size)
            if wrong_size:
                problems += wrong_size
                continue
            actual = hash_file(path, manifest.checksum)
        except FileNotFoundError:
            continue
        except OSError as e:
            problems.append(FileProblem(name, "unreadable", f"{type(e).__name__}: {e}"))
            continue
        if actual.digest != rec.digest:
            problems.append(
                FileProblem(
                    name,
                    "checksum",
                    f"content altered: {manifest.checksum.value} {actual.digest} on disk, "
                    f"manifest says {rec.digest}",
                )
            )
    return problems
