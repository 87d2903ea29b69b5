"""What a save's two rounds carry, and what each rank keeps of them for the next save.

A save on a process group is two rounds, whatever the ranks and tensors ([Note: flat
coordination] in ``_format/chunk_table.py``):

1. every rank's :class:`Proposal` (its structure's fingerprint, its table unless the
   plan it holds was made from that table, what it could not capture) is gathered to
   rank 0, which prepares the save (the lease, the partial directory: ``save_load``),
   plans it and broadcasts a :class:`Decision` (the save's token, the plan's id, and
   every rank's rows to write when the plan is new);
2. after writing, every rank's :class:`WriteReport` (its file's manifest record, the
   byte ranges of its items unless they are those of its last save under this plan, a
   failure) is gathered to rank 0, which commits and broadcasts the outcome.

:class:`PlanMemo` is what makes the step-to-step case cheap: every rank keeps the
plan it was last told (per process group), rank 0 also the tables, the plan itself,
the byte ranges and the ``.metadata`` and index built from them; a save of the same
structure sends fingerprints and plan ids, and rank 0 reuses what it built. Both sides
change their memo at the same points (a decision every rank received; a commit), so
they never disagree about which plan is current; should they (a rank whose memo was
lost), rank 0 asks for the tables again in the decision and the round is repeated
once.
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
import threading
import weakref
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ckpt._comm import Comm, SharedFailure
from ckpt._errors import CheckpointError
from ckpt._format import layout
from ckpt._format.chunk_index import Stored, dcp_metadata, encode_index
from ckpt._format.chunk_plan import ChunkPlan, plan_chunks
from ckpt._format.chunk_table import ChunkTable, LocalItems
from ckpt._format.manifest import FileRecord
from ckpt._format.save_planner import CaptureError

__all__ = [
    "Decision",
    "PlanMemo",
    "Proposal",
    "WriteReport",
    "capture_problems",
    "encode_stored",
]


@dataclass(frozen=True)
class Proposal:
    """A rank's part of round 1."""

    fingerprint: str
    plan_id: int  # the plan this rank holds; 0: none
    table: bytes | None  # its table, unless ``plan_id`` was made from it
    problems: tuple[str, ...]  # values it could not capture ("key: why")
    foreign: tuple[str, ...]  # keys only DCP's own planner can write


@dataclass(frozen=True)
class Decision:
    """Rank 0's answer in round 1: the save is prepared and planned, or (``resend``)
    the tables are needed again."""

    removed: tuple[Path, ...] = ()  # stale leftovers rank 0 removed, to report
    token: str = ""
    expected: layout.Occupant = None
    dcp: bool = False  # write through DCP's planner (a value only it knows)
    plan_id: int = 0
    writes: tuple[tuple[int, ...], ...] | None = None  # every rank's rows, for a new plan
    resend: bool = False


@dataclass(frozen=True)
class WriteReport:
    """A rank's part of round 2."""

    stored_fingerprint: str
    stored: bytes | None  # the byte ranges of its items, unless the same as last time
    record: FileRecord | None
    failure: SharedFailure | None


def encode_stored(stored: Sequence[Stored]) -> bytes:
    """A rank's byte ranges as the int64 triples it sends."""
    return array("q", [v for triple in stored for v in triple]).tobytes()


def _decode_stored(blob: bytes) -> list[Stored]:
    values = array("q")
    values.frombytes(blob)
    flat = values.tolist()
    return [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)]


def _digest(blob: bytes) -> str:
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


_plan_ids = itertools.count(1)


@dataclass
class _Coordinated:
    """Rank 0's memo of the group's current plan and what it built from it."""

    plan_id: int
    fingerprints: list[str]
    tables: list[ChunkTable]
    plan: ChunkPlan
    stored: list[list[Stored]] | None = None
    stored_fingerprints: list[str] = field(default_factory=list)
    metadata: bytes | None = None  # the pickled .metadata of ``stored``
    index: bytes | None = None  # the index file of ``stored``


@dataclass
class PlanMemo:
    """What this process keeps of the last save on one process group."""

    fingerprint: str = ""
    plan_id: int = 0
    writes: tuple[int, ...] = ()  # this rank's rows to write under ``plan_id``
    stored_fingerprint: str = ""  # of the byte ranges this rank last reported
    coordinated: _Coordinated | None = None  # rank 0's

    @classmethod
    def of(cls, comm: Comm) -> PlanMemo:
        """This process's memo for ``comm``'s group (one per group; a world of one has
        its own)."""
        key: Any = comm.group if comm.group is not None else dist.group.WORLD
        with _lock:
            if key is None:
                return _single
            memo = _memos.get(key)
            if memo is None:
                memo = _memos[key] = cls()
            return memo

    # ------------------------------------------------------------- round 1

    def propose(self, items: LocalItems, *, resend: bool = False) -> Proposal:
        """This rank's proposal for a save of ``items``."""
        table = items.table
        blob = table.encode()
        fingerprint = _digest(blob)
        known = not resend and self.plan_id != 0 and fingerprint == self.fingerprint
        return Proposal(
            fingerprint, self.plan_id if known else 0, None if known else blob,
            items.problems, items.foreign,
        )  # fmt: skip

    def plan(self, proposals: Sequence[Proposal]) -> tuple[int, ChunkPlan, bool] | None:
        """Rank 0: the plan for these proposals, its id, and whether it is new; None
        when a rank's table is needed and lost (the caller asks for all again)."""
        current = self.coordinated
        if current is not None and [(p.plan_id, p.fingerprint) for p in proposals] == [
            (current.plan_id, f) for f in current.fingerprints
        ]:
            return current.plan_id, current.plan, False
        tables: list[ChunkTable] = []
        for rank, p in enumerate(proposals):
            if p.table is not None:
                tables.append(ChunkTable.decode(p.table))
            elif (
                current is not None
                and rank < len(current.tables)
                and (current.fingerprints[rank] == p.fingerprint)
            ):
                tables.append(current.tables[rank])
            else:
                return None
        plan = plan_chunks(tables)
        plan_id = next(_plan_ids)
        fingerprints = [p.fingerprint for p in proposals]
        self.coordinated = _Coordinated(plan_id, fingerprints, tables, plan)
        return plan_id, plan, True

    def adopt(self, decision: Decision, rank: int, fingerprint: str) -> None:
        """Every rank, after round 1: the plan it now holds."""
        if decision.dcp:
            return
        if decision.writes is not None:
            self.writes = decision.writes[rank]
            self.stored_fingerprint = ""
        self.plan_id = decision.plan_id
        self.fingerprint = fingerprint

    # ------------------------------------------------------------- round 2

    def report(self, stored: Sequence[Stored], record: FileRecord) -> WriteReport:
        """This rank's report of a written file."""
        blob = encode_stored(stored)
        fingerprint = _digest(blob)
        same = fingerprint == self.stored_fingerprint
        self.stored_fingerprint = fingerprint
        return WriteReport(fingerprint, None if same else blob, record, None)

    def built(self, reports: Sequence[WriteReport]) -> tuple[bytes, bytes]:
        """Rank 0: the pickled ``.metadata`` and the index of the current plan with the
        byte ranges of ``reports`` (rebuilt only where they changed)."""
        current = self.coordinated
        assert current is not None, "round 2 without a plan"
        fingerprints = [r.stored_fingerprint for r in reports]
        if (
            current.metadata is not None
            and current.index is not None
            and fingerprints == current.stored_fingerprints
        ):
            return current.metadata, current.index
        stored: list[list[Stored]] = []
        for rank, r in enumerate(reports):
            if r.stored is not None:
                stored.append(_decode_stored(r.stored))
            elif current.stored is not None and (
                current.stored_fingerprints[rank] == r.stored_fingerprint
            ):
                stored.append(current.stored[rank])
            else:
                raise CheckpointError(
                    f"rank {rank} reported its byte ranges unchanged, but rank 0 does not "
                    "have them; save again (every rank sends them anew)"
                )
        metadata = pickle.dumps(dcp_metadata(current.plan, stored), protocol=4)
        index = encode_index(current.plan, stored)
        current.stored, current.stored_fingerprints = stored, fingerprints
        current.metadata, current.index = metadata, index
        return metadata, index

    def cached_files(self) -> tuple[bytes, bytes] | None:
        """Rank 0: the ``.metadata`` and index the current plan last produced, if any."""
        current = self.coordinated
        if current is None or current.metadata is None or current.index is None:
            return None
        return current.metadata, current.index

    def forget_reports(self) -> None:
        """After a failed write: the next report sends its byte ranges again (rank 0
        may not have taken them in)."""
        self.stored_fingerprint = ""


def capture_problems(proposals: Sequence[Proposal]) -> CaptureError | None:
    """The error naming what any rank could not capture, or None."""
    said = [f"rank {r}: {p}" for r, pr in enumerate(proposals) for p in pr.problems]
    return CaptureError("; ".join(said)) if said else None


_lock = threading.Lock()
_memos: weakref.WeakKeyDictionary[dist.ProcessGroup, PlanMemo] = weakref.WeakKeyDictionary()
_single = PlanMemo()
