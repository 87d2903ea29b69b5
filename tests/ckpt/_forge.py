"""Forged checkpoints: what someone who can write a checkpoint's files could do.

Each forgery leaves a checkpoint that passes the plain (unkeyed) manifest check, and
whose unrestricted unpickling creates a marker directory: the tests assert the marker
never appears, and first that torch's own reader does create it, so a forgery that
stopped working would fail the test instead of passing it vacuously.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import pickletools
import zlib
from pathlib import Path
from typing import Any

import ckpt


class Payload:
    """Pickles as a call of ``os.mkdir(marker)``: "code ran" is "the marker exists"."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


def fragment(marker: Path) -> bytes:
    """Pickle opcodes that run ``os.mkdir(marker)`` and leave the stack as it was.

    Protocol 2 (no framing) without memo writes (which would shift the genuine pickle's
    memo indices), its PROTO header and STOP, followed by POP: put in front of a
    genuine pickle, the whole still unpickles to the genuine object.
    """
    data = pickletools.optimize(pickle.dumps(Payload(marker), protocol=2))
    assert data[:2] == b"\x80\x02" and data[-1:] == b"."
    return data[2:-1] + b"0"


def rehash_manifest(path: Path) -> None:
    """Recompute sizes and checksums in the manifest, as a forger can (no key needed)."""
    manifest_path = path / ckpt.MANIFEST_NAME
    body = json.loads(manifest_path.read_text())
    for record in body["files"]:
        data = (path / record["name"]).read_bytes()
        record["size"] = len(data)
        if body["checksum"] == "crc32":
            record["digest"] = f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"
        else:
            record["digest"] = hashlib.blake2b(data, digest_size=32).hexdigest()
    manifest_path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")


def forge_metadata(path: Path, marker: Path, *, rehash: bool = True) -> None:
    """Put the code-running fragment in front of the genuine ``.metadata``."""
    meta = path / ".metadata"
    meta.write_bytes(fragment(marker) + meta.read_bytes())
    if rehash and (path / ckpt.MANIFEST_NAME).exists():
        rehash_manifest(path)


def drop_index(path: Path) -> None:
    """Make ``path`` a checkpoint of ckpt before the index (``ckpt-index.bin``): loads
    then read DCP's ``.metadata`` through DCP's planner. The manifest is rewritten as a
    forger (or that older ckpt) would have it."""
    (path / "ckpt-index.bin").unlink()
    manifest_path = path / ckpt.MANIFEST_NAME
    body = json.loads(manifest_path.read_text())
    body["files"] = [f for f in body["files"] if f["name"] != "ckpt-index.bin"]
    manifest_path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
