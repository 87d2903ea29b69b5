"""DCP's reader for a snapshot whose files lie in the memory of several machines.

A disk load reads every piece a rank needs from one shared folder. A snapshot's data
files are spread over the surviving machines (each in its own ``/dev/shm``, some as
replicas), so :class:`FetchingReader` first gets the byte ranges this rank needs from
the files its own machine lacks: every rank says which ranges it wants from which
server (one all-gather of the requests), and each server sends what was asked of it
(one all-to-all of the bytes, on the snapshots' gloo group). Then DCP's own file
reading runs unchanged over streams that serve those ranges, or over the local files,
so every piece is deserialized and resharded exactly as a disk load would.
"""

from __future__ import annotations

import bisect
import io
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from ckpt._format.safe_unpickling import SafeFileSystemReader

__all__ = ["FetchingReader"]

Range = tuple[int, int, int]  # (original rank, offset, length) of a data file


def _rank_of(relative_path: str) -> int:
    """The original rank of DCP's data file name ``__<rank>_0.distcp``."""
    return int(relative_path[2:].split("_", 1)[0])


def _as_tensor(buffer: bytearray) -> torch.Tensor:
    """``buffer`` as a uint8 tensor sharing its memory."""
    if not buffer:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buffer, dtype=torch.uint8)


class _Pieces(io.RawIOBase):
    """A read-only, seekable file of which only some byte ranges were fetched."""

    def __init__(self, pieces: Mapping[int, memoryview]) -> None:
        super().__init__()
        self._starts = sorted(pieces)
        self._pieces = pieces
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self._pos = offset
        elif whence == io.SEEK_CUR:
            self._pos += offset
        else:
            raise io.UnsupportedOperation("a fetched file has no known end")
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        i = bisect.bisect_right(self._starts, self._pos) - 1
        if i < 0:
            return 0
        start = self._starts[i]
        piece = self._pieces[start]
        at = self._pos - start
        n = max(0, min(len(out), len(piece) - at))
        out[:n] = piece[at : at + n]
        self._pos += n
        return n


class _SnapshotFiles(FileSystem):
    """DCP's file system over the local data files and the fetched ranges of the rest."""

    def __init__(self, local: Mapping[int, Path]) -> None:
        super().__init__()
        self.local = local
        self.fetched: dict[int, dict[int, memoryview]] = {}

    @contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        assert "r" in mode, mode
        rank = _rank_of(Path(path).name)
        if rank in self.local:
            with open(self.local[rank], "rb") as stream:
                yield stream
        else:
            yield _Pieces(self.fetched.get(rank, {}))


class FetchingReader(SafeFileSystemReader):
    """Reads a snapshot from the machines that hold it (see the module docstring)."""

    fs: _SnapshotFiles

    def __init__(
        self,
        label: Path,
        metadata: Metadata,
        local: Mapping[int, Path],
        server: tuple[int, ...],
        group: dist.ProcessGroup | None,
    ) -> None:
        super().__init__(label)
        self._metadata = metadata
        self.fs = _SnapshotFiles(local)
        self._server = server
        self._group = group
        self.fetched_bytes = 0  # what this rank received from other machines

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        assert self._metadata is not None
        self._metadata.storage_meta = self._metadata.storage_meta or StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fetch the ranges this rank lacks (collective: DCP calls it on every rank
        once), then read as from files."""
        wanted: dict[int, list[Range]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            rank = _rank_of(info.relative_path)
            if rank not in self.fs.local:
                wanted.setdefault(self._server[rank], []).append((rank, info.offset, info.length))
        if self._group is not None:
            self.fs.fetched = self._exchange(wanted)
        return super().read_data(plan, planner)

    def _exchange(self, wanted: dict[int, list[Range]]) -> dict[int, dict[int, memoryview]]:
        world = dist.get_world_size(self._group)
        me = dist.get_rank(self._group)
        asks: list[dict[int, list[Range]] | None] = [None] * world
        dist.all_gather_object(asks, wanted, group=self._group)
        to_send = [(asks[q] or {}).get(me, []) for q in range(world)]
        send_sizes = [sum(length for _, _, length in ranges) for ranges in to_send]
        recv_sizes = [sum(length for _, _, length in wanted.get(s, [])) for s in range(world)]
        send_buffer = bytearray(sum(send_sizes))
        view = memoryview(send_buffer)
        at = 0
        files: dict[int, io.BufferedReader] = {}
        try:
            for ranges in to_send:
                for rank, offset, length in ranges:
                    f = files.get(rank)
                    if f is None:
                        f = files[rank] = open(self.fs.local[rank], "rb")  # noqa: SIM115
                    f.seek(offset)
                    if f.readinto(view[at : at + length]) != length:
                        raise OSError(f"snapshot file of rank {rank} ends before {offset + length}")
                    at += length
        finally:
            for f in files.values():
                f.close()
        recv_buffer = bytearray(sum(recv_sizes))
        dist.all_to_all_single(
            _as_tensor(recv_buffer), _as_tensor(send_buffer), recv_sizes, send_sizes,
            group=self._group,
        )  # fmt: skip
        self.fetched_bytes = len(recv_buffer)
        got = memoryview(recv_buffer)
        fetched: dict[int, dict[int, memoryview]] = {}
        at = 0
        for server in range(world):
            for rank, offset, length in wanted.get(server, []):
                fetched.setdefault(rank, {})[offset] = got[at : at + length]
                at += length
        return fetched
