"""DCP's file writer for a ckpt save: hashes while it writes, commits in DCP's last step.

[Note: one pass over the bytes]
A save's cost beyond DCP's own is what it does with the bytes DCP wrote. Reading every
file back to checksum it after the write (what the manifest needs) reads the whole
state a second time, and running the commit as collectives of its own after DCP's
adds rounds of communication. So :class:`CheckpointWriter`:

* checksums each file as DCP writes it: every ``write`` DCP makes (``torch.save``'s
  zip records, the ``.metadata`` pickle) goes through :class:`_HashingStream`, which
  updates the CRC-32 or BLAKE2b of the file and counts its bytes; the digest is of the
  bytes handed to the file, which ``load`` and ``verify`` read back and compare;
* starts the disk's write-back every ``_WRITEBACK_BYTES`` while the rest of the file is
  still being serialized (Linux ``sync_file_range``), so DCP's ``fsync`` at the end of
  the file finds little left to write, instead of the whole file;
* hands each rank's file records to the coordinator inside DCP's gather of the write
  results, and commits in DCP's ``finish`` step (which runs on the coordinator once
  every rank wrote its files, and whose success or failure DCP then shares with every
  rank): ``.metadata`` is written (and hashed), then ``commit`` writes the manifest
  and renames the directory ([Note: atomic commit] in ``_format/layout.py``); its result
  comes back to every rank with DCP's (see [Note: the commit's result rides back]).

* switches off the CRC-32 that ``torch.save`` computes for every record of its zip
  archives (``torch.serialization.set_crc32_options``) while it writes: a second
  checksum of the same bytes, which nothing reads (``torch.load``, so DCP's reader,
  loads records without it) and which costs as much as the manifest's own (38 of
  the 48 ms ``torch.save`` took for 144 MiB per rank). The manifest's digest covers
  every byte and ``load`` checks it before DCP reads anything. torch keeps that
  option per thread (its config module's overrides are thread-local), so only the
  thread writing the checkpoint sees it off: the user's own ``torch.save`` calls,
  also those made while an ``async_save`` writes, keep their CRCs; the writing
  thread's setting is put back as found.

Durability is unchanged: every data file, ``.metadata`` and the manifest are synced
before the rename, the directories after it.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import os
import sys
import threading
import zlib
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckpt._format.disk_space import SpaceCheckingWriter
from ckpt._format.manifest import Checksum, FileRecord

__all__ = ["CheckpointWriter", "commit_result", "without_record_crc"]

# Start the write-back of a file's bytes to the disk every this many bytes written.
_WRITEBACK_BYTES = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2  # start write-out of dirty pages in the range, don't wait


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """Linux's ``sync_file_range(2)`` from the C library, or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return cast(Callable[[int, int, int, int], int], fn)


_sync_file_range = None if os.environ.get("CKPT_NO_WB") else _load_sync_file_range()


class _Digest:
    """Size and running checksum of the bytes of one file."""

    def __init__(self, checksum: Checksum) -> None:
        self.size = 0
        self._crc = 0
        self._blake = hashlib.blake2b(digest_size=32) if checksum is Checksum.BLAKE2B else None

    def update(self, data: memoryview) -> None:
        self.size += data.nbytes
        if self._blake is not None:
            self._blake.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return self._blake.hexdigest() if self._blake is not None else f"{self._crc:08x}"


@contextmanager
def without_record_crc() -> Generator[None, None, None]:
    """``torch.save``'s record CRC off in this thread, then back as found."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


class _HashingStream(io.RawIOBase):
    """A file opened for writing whose bytes are checksummed as they pass
    (see [Note: one pass over the bytes])."""

    def __init__(self, file: io.IOBase, digest: _Digest) -> None:
        super().__init__()
        self._file = file
        self._digest = digest
        self._synced = 0  # bytes whose write-back was started

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        taken = self._file.write(view)
        written = 0 if taken is None else int(taken)  # None: a non-blocking raw stream
        self._digest.update(view[:written])
        if _sync_file_range is not None and self._digest.size - self._synced >= _WRITEBACK_BYTES:
            self._file.flush()
            _sync_file_range(
                self._file.fileno(),
                self._synced,
                self._digest.size - self._synced,
                _SYNC_FILE_RANGE_WRITE,
            )  # only a head start: a failure here is DCP's fsync's to report
            self._synced = self._digest.size
        return written

    def tell(self) -> int:
        return int(self._file.tell())

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return int(self._file.fileno())

    def close(self) -> None:
        if self.closed:
            return
        try:
            super().close()  # flushes
        finally:
            self._file.close()


class _HashingFileSystem(FileSystem):
    """DCP's local file system whose write streams hash; ``records`` by file name."""

    def __init__(self, checksum: Checksum) -> None:
        super().__init__()
        self.checksum = checksum
        self.records: dict[str, FileRecord] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            digest = _Digest(self.checksum)
            with _HashingStream(stream, digest) as hashing:
                yield hashing
        name = Path(path).name
        with self._lock:
            self.records[name] = FileRecord(name, digest.size, digest.hexdigest())

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            record = self.records.pop(Path(path).name, None)
            if record is not None:
                name = Path(new_path).name
                self.records[name] = FileRecord(name, record.size, record.digest)


# [Note: the commit's result rides back]
# The coordinator commits inside DCP's finish step; DCP then broadcasts its ``Metadata``
# object to every rank as the save's result. The writer attaches the commit's result (the
# manifest) to that object as an attribute that DCP neither reads nor writes (``.metadata``
# was pickled before), so every rank has it without a collective of its own. Should a
# later DCP not carry it, :func:`commit_result` is None and the caller reads it from disk.
_RESULT_ATTR = "_ckpt_commit_result"


def commit_result(metadata: object) -> Any:
    """What ``commit`` returned on the coordinator, on every rank; None if it was lost."""
    return getattr(metadata, _RESULT_ATTR, None)


@dataclass(frozen=True)
class _RankFiles:
    """One rank's file records, riding with its write results to the coordinator."""

    records: tuple[FileRecord, ...]


class CheckpointWriter(SpaceCheckingWriter):
    """DCP's file writer for a ckpt save (see [Note: one pass over the bytes]).

    ``commit(records)`` runs on the coordinator in DCP's finish step with every file's
    record (every rank's data files and ``.metadata``); what it raises fails the save on
    every rank, what it returns reaches every rank (:func:`commit_result`).
    """

    commit: Callable[[list[FileRecord]], Any]
    fs: _HashingFileSystem
    on_step: Callable[[str], None]  # told "writing", then (the coordinator) "commit"

    def __init__(
        self,
        path: Path,
        report_path: Path,
        checksum: Checksum,
        commit: Callable[[list[FileRecord]], Any],
        on_step: Callable[[str], None] = lambda step: None,
    ) -> None:
        super().__init__(path, report_path, sync_files=True, overwrite=False)
        self.fs = _HashingFileSystem(checksum)
        self.commit = commit
        self.on_step = on_step

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.on_step("writing")
        with without_record_crc():
            results = super().write_data(plan, planner).value()
        with_files: list[Any] = [*results, _RankFiles(tuple(self.fs.records.values()))]
        done: Future[list[WriteResult]] = Future()
        done.set_result(with_files)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.on_step("commit")
        records: list[FileRecord] = []
        plain: list[list[WriteResult]] = []
        for rank_results in results:
            plain.append([r for r in rank_results if isinstance(r, WriteResult)])
            for extra in rank_results:
                if isinstance(extra, _RankFiles):
                    records.extend(extra.records)
        super().finish(metadata, plain)
        known = {r.name for r in records}
        records.extend(r for name, r in self.fs.records.items() if name not in known)
        setattr(metadata, _RESULT_ATTR, self.commit(records))
