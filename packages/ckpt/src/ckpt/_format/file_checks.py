"""Cheap checks of a checkpoint's files: sizes only, no hashing.

Two kinds of checkpoint, two sources of truth:

- a ckpt checkpoint's manifest records every file's exact size, so a stat per file
  finds a missing, extra, truncated or grown file (``manifest_size_problems``); the
  checksums (``_manifest.verify_files``) are the expensive second step;
- a plain DCP checkpoint (torch's FSDP, ``dcp.save``) has no manifest, but its
  ``.metadata`` says which file holds each stored item, at which offset and how many
  bytes long (DCP's ``_StorageInfo``): every file it references must exist and reach
  at least the end of its last item (``dcp_file_problems``). A file grown, altered
  in place or left over beside them cannot be told from a good one this way.

``ckpt ls`` runs the first (or the second) on every checkpoint it lists; ``ckpt
verify`` runs the second on plain DCP checkpoints, where it is all there is.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata

from ckpt._errors import FileProblem
from ckpt._format.manifest import Manifest, check_file_set, listed_files

__all__ = ["dcp_file_problems", "dcp_referenced_bytes", "manifest_size_problems"]


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
        if size != record.size:
            how = "truncated" if size < record.size else "grown"
            problems.append(
                FileProblem(
                    record.name,
                    "size",
                    f"{how}: {size} bytes on disk, manifest says {record.size}",
                )
            )
    return sorted(problems, key=lambda p: p.name)


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
