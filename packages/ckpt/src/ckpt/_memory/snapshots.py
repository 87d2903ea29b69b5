"""``MemorySnapshots``: the training state in host memory every few steps, replicated on
another machine, and a resume that takes the newest step memory or disk holds.

A disk checkpoint every N steps loses up to N steps to a failure and costs I/O time
when taken often. A snapshot costs a copy into ``/dev/shm`` (training waits for that
alone) and a replica sent in the background to a rank on another machine; it survives
a restarted worker (the machine's memory keeps it) and the loss of one machine (the
replica does). After a failure, torchrun restarts the job (``--max-restarts``) at
whatever world size rendezvous gives (``--nnodes MIN:MAX``), and ``load_latest`` on
every rank asks what the survivors hold, picks the newest step of which every shard
survives in memory or the newest on disk, whichever is newer, and loads it at the new
world size, reading each piece from whichever machine holds it.

The notes that describe it: [Note: a snapshot is one rank's checkpoint files]
(``shard_file.py``), [Note: whose snapshots] (``machine_folder.py``), [Note: replicas
on another machine] (``placement.py``), [Note: a snapshot counts once both copies are
in] (``replication.py``).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ckpt._comm import Comm, device_of, on_device
from ckpt._commit.manager import CheckpointManager
from ckpt._commit.save_load import PathLike, _as_path, _kind_of, read_into, wait_pending
from ckpt._errors import CheckpointError
from ckpt._format.manifest import Checksum, new_manifest
from ckpt._format.safe_unpickling import SafeGlobals
from ckpt._memory.fetch_reader import FetchingReader
from ckpt._memory.machine_folder import DEFAULT_ROOT, Agent, MachineFolder, job_key
from ckpt._memory.placement import Choice, Held, Holding, choose, partners
from ckpt._memory.replication import OwnCopy, Replication
from ckpt._memory.shard_file import (
    ShardHeader,
    merge_metadata,
    pickle_metadata,
    read_descriptor,
    write_descriptor,
    write_shard,
)
from ckpt._wrappers.adapters import to_state_dict

__all__ = ["Found", "MemorySnapshots", "SnapshotError"]


class SnapshotError(CheckpointError):
    """A snapshot could not be taken, replicated or read (the message says which rank
    and why); the training state itself is unchanged."""


@dataclass(frozen=True)
class Found:
    """The newest step memory or disk holds (``find_latest``), and once loaded, how."""

    step: int | None  # None: nothing to resume from
    source: str  # "memory", "disk" or "nothing"
    world_size: int | None  # of the job that took the snapshot (memory only)
    line: str  # one line for the log, e.g. "resumed step 40 from memory (2 ranks -> 1, ...)"
    fetched_bytes: int = 0  # what this rank received from other machines (memory only)
    _choice: Choice | None = field(default=None, repr=False, compare=False)


class MemorySnapshots:
    """Snapshots of the training state in host memory, each replicated on another machine.

    ``disk`` is the job's :class:`CheckpointManager`; ``load_latest`` falls back to it,
    and takes it when it holds a newer step. ``root`` is a folder in host memory (a
    tmpfs; default ``/dev/shm``), ``run_id`` tells two jobs with the same disk folder
    apart (default: torchrun's ``TORCHELASTIC_RUN_ID``), ``machine`` names this rank's
    machine (default: its hostname; ranks of one name share a machine, and their
    replicas go to another). Construction is collective
    (every rank of ``process_group``, default the default group): it makes a gloo group
    of the snapshots' own, with ``timeout``, and learns which rank runs on which machine.

    Example (``examples/train.py --snapshot-every 1`` does this)::

        disk = ckpt.CheckpointManager("checkpoints", keep_last=2)
        memory = ckpt.MemorySnapshots(disk)
        state = {"model": model, "optim": optimizer, "trainer": trainer_state}
        start = memory.load_latest(state) or 0      # memory or disk, whichever is newer
        print(memory.resumed.line)
        for step in range(start + 1, steps + 1):
            train_one_step()
            memory.save(step, state)                 # every step: a copy and a replica
            if step % 100 == 0:
                disk.save(step, state)
        memory.close()
    """

    disk: CheckpointManager
    folder: MachineFolder
    resumed: Found | None  # what the last load loaded
    generation: str  # this incarnation's token ([Note: whose snapshots])
    hosts: list[str]  # rank -> machine
    partner: int | None  # the rank keeping this rank's replicas
    senders: list[int]  # the ranks whose replicas this rank keeps

    def __init__(
        self,
        disk: CheckpointManager,
        *,
        root: PathLike = DEFAULT_ROOT,
        run_id: str | None = None,
        process_group: dist.ProcessGroup | None = None,
        timeout: timedelta = timedelta(minutes=5),
        machine: str | None = None,
    ) -> None:
        if not isinstance(disk, CheckpointManager):
            raise TypeError(
                f"MemorySnapshots needs the job's ckpt.CheckpointManager (its disk tier), "
                f"got {type(disk).__name__}"
            )
        self.disk = disk
        self.process_group = process_group
        self._comm = Comm.of(process_group)
        run = run_id if run_id is not None else os.environ.get("TORCHELASTIC_RUN_ID", "")
        host = machine if machine is not None else socket.gethostname()
        job = job_key(disk.root, run)
        self.folder = MachineFolder(_as_path(root), job, Agent.of_this_process(), host)
        problem: str | None = None
        try:
            self.folder.open()
        except (OSError, CheckpointError) as e:
            problem = str(e)
        self._group = self._make_group(timeout)
        # One round: every rank's machine, rank 0's generation, and whether all could
        # open their folders ([Note: one decision, every rank] in _comm.py).
        found = self._all_gather((host, secrets.token_hex(4), problem))
        failed = [(r, p) for r, (_, _, p) in enumerate(found) if p is not None]
        if failed:
            raise SnapshotError("; ".join(f"rank {r} ({found[r][0]}): {p}" for r, p in failed))
        self.hosts = [h for h, _, _ in found]
        self.generation = found[0][1]
        rank = self._comm.rank
        paired = partners(self.hosts)
        self.partner = paired[rank]
        self.senders = [r for r, p in enumerate(paired) if p == rank]
        self.resumed = None
        self._running: Replication | None = None
        self._cleared_generations = False

    def _make_group(self, timeout: timedelta) -> dist.ProcessGroup | None:
        if not self._comm.distributed:
            return None
        ranks = dist.get_process_group_ranks(self._comm.group or dist.group.WORLD)
        group: dist.ProcessGroup | None = dist.new_group(
            ranks=ranks, backend="gloo", timeout=timeout
        )
        assert group is not None
        return group

    def _all_gather(self, obj: Any) -> list[Any]:
        if self._group is None:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(out, obj, group=self._group)
        return out

    # ---- taking snapshots

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Snapshot ``state`` as ``step``: this rank's shard into host memory now (training
        waits for this copy alone), the replica to another machine in the background.
        Collective; call it on every rank with the same step, after the optimizer step.
        First waits for the previous snapshot's replication and raises its failure."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        self.wait()
        rank = self._comm.rank
        with on_device(device_of(state)):
            state_dict, _ = to_state_dict(state, self.process_group)  # by reference
            slot = self.folder.slot(self.generation, rank)
            path = self.folder.begin(self.generation, rank, slot)
            try:
                with open(path, "r+b" if path.exists() else "w+b") as f:
                    metadata = write_shard(state_dict, f, rank)
                    f.truncate()
                    size = f.tell()
            except OSError as e:
                raise SnapshotError(
                    f"rank {rank}: could not write its snapshot of step {step} to {path}: "
                    f"{e}. Snapshots live in {self.folder.jobs.parent} (host memory): give "
                    f"it room (a container's /dev/shm is often 64 MiB: docker run "
                    f"--shm-size=...) or pass root= another tmpfs"
                ) from e
        header = ShardHeader(
            generation=self.generation,
            step=step,
            rank=rank,
            world_size=self._comm.world_size,
            data_bytes=size,
            host=self.hosts[rank],
            saved_by={name: _kind_of(value) for name, value in state.items()},
            created=time.time(),
        )
        descriptor = write_descriptor(header, pickle_metadata(metadata))
        self.folder.commit(self.generation, rank, slot, descriptor)
        own = OwnCopy(self.generation, step, rank, path, size, descriptor)
        self._running = Replication(
            own,
            folder=self.folder,
            group=self._group,
            partner=self.partner,
            senders=self.senders,
            on_agreed=self._agreed,
        )
        self._running.start()

    def _agreed(self, own: OwnCopy) -> None:
        """Both copies of ``own.step`` are in on every rank: earlier generations go."""
        if not self._cleared_generations:
            self.folder.drop_generations(keep=self.generation)
            self._cleared_generations = True

    def wait(self) -> None:
        """Wait for the last snapshot's replication; raise :class:`SnapshotError` if it
        failed (a peer lost meanwhile: the job is about to be restarted anyway)."""
        running, self._running = self._running, None
        if running is None:
            return
        try:
            running.wait()
        except BaseException as e:
            raise SnapshotError(
                f"rank {self._comm.rank}: replicating the snapshot of step {running.own.step} "
                f"failed ({type(e).__name__}: {e}); the previous step's snapshot is intact"
            ) from e

    def close(self) -> None:
        """Wait for the last replication (its failure is raised); call before exiting."""
        self.wait()

    # ---- resuming

    def find_latest(self) -> Found:
        """Where the newest step is: memory (every shard surviving somewhere, own copy
        or replica) or disk, whichever is newer (memory on a tie: no disk read).
        Collective; loads nothing (:meth:`load` does)."""
        self.wait()
        wait_pending()
        copies = self.folder.copies()
        mine = Holding(
            self.hosts[self._comm.rank],
            tuple(
                Held(
                    c.header.generation,
                    c.header.step,
                    c.header.rank,
                    c.header.world_size,
                    c.header.created,
                    c.replica,
                )
                for c in copies
            ),
        )
        on_disk = self.disk.latest() if self._comm.rank == 0 else None
        reports = self._all_gather((mine, on_disk))
        disk_step: int | None = reports[0][1]
        choice, missing = choose([holding for holding, _ in reports])
        if choice is not None and (disk_step is None or choice.step >= disk_step):
            return self._in_memory(choice)
        why = ""
        if missing is not None and (choice is None or missing.step > choice.step):
            lost = ", ".join(map(str, missing.lost))
            why = (
                f": memory lost the snapshot of step {missing.step} (no copy of rank"
                f"{'s' if len(missing.lost) > 1 else ''} {lost} of {missing.world_size} "
                f"survives: their machine and the one holding their replica are gone)"
            )
        elif choice is not None:
            why = f" (newer than memory's step {choice.step})"
        elif disk_step is not None:
            why = " (memory holds no snapshot)"
        if disk_step is None:
            return Found(None, "nothing", None, f"nothing to resume from{why}")
        return Found(disk_step, "disk", None, f"resumed step {disk_step} from disk{why}")

    def _in_memory(self, choice: Choice) -> Found:
        now = self._comm.world_size
        if choice.world_size != now:
            parts = [f"{choice.world_size} ranks -> {now}"]
        else:
            parts = [f"{now} rank{'s' if now != 1 else ''}"]
        if choice.from_replica:
            n = choice.from_replica
            parts.append(f"{n} shard{'s' if n != 1 else ''} from a replica")
        line = f"resumed step {choice.step} from memory ({', '.join(parts)})"
        return Found(choice.step, "memory", choice.world_size, line, _choice=choice)

    def load(
        self,
        state: Mapping[str, Any],
        found: Found,
        *,
        strict: bool = True,
        safe_globals: SafeGlobals = (),
    ) -> Found:
        """Load what :meth:`find_latest` found into ``state`` at this world size (each
        piece from whichever machine holds it, or from disk); collective. Returns
        ``found`` with the bytes this rank received from other machines, also kept as
        ``self.resumed``. Entries of ``state`` are loaded as ``ckpt.load`` loads them
        (``strict``, ``safe_globals``): load ``{"trainer": ...}`` alone first to check
        what the snapshot is of, then the rest."""
        if found.source == "disk" and found.step is not None:
            self.disk.load(state, found.step, strict=strict, safe_globals=safe_globals)
            self.resumed = found
            return found
        choice = found._choice
        if found.source != "memory" or choice is None:
            raise ValueError(f"nothing to load: {found.line}")
        copies = [
            c
            for c in self.folder.copies()
            if c.header.generation == choice.generation and c.header.step == choice.step
        ]
        served = {
            c.header.rank: c.descriptor.read_bytes()
            for c in copies
            if choice.server[c.header.rank] == self._comm.rank
        }
        descriptors: dict[int, bytes] = {}
        for part in self._all_gather(served):
            descriptors.update(part)
        missing = [r for r in range(choice.world_size) if r not in descriptors]
        if missing:  # removed between find_latest and load: the machine's memory changed
            raise SnapshotError(
                f"the snapshot of step {choice.step} lost ranks {missing}'s descriptors "
                "between find_latest and load; call find_latest again"
            )
        shards = [
            read_descriptor(descriptors[r], self.folder.own / f"rank {r}'s descriptor")
            for r in range(choice.world_size)
        ]
        label = self.folder.own / f"step_{choice.step:08d}"
        reader = FetchingReader(
            label,
            merge_metadata([metadata for _, metadata in shards]),
            {c.header.rank: c.data for c in copies},
            choice.server,
            self._group,
        )
        manifest = new_manifest([], Checksum.CRC32, choice.world_size, shards[0][0].saved_by)
        with on_device(device_of(state)):
            read_into(
                state, label, reader, manifest,
                comm=self._comm, strict=strict, safe_globals=safe_globals,
                process_group=self.process_group, call="load a snapshot",
            )  # fmt: skip
        self.resumed = dataclasses.replace(found, fetched_bytes=reader.fetched_bytes)
        return self.resumed

    def load_latest(
        self,
        state: Mapping[str, Any],
        *,
        strict: bool = True,
        safe_globals: SafeGlobals = (),
    ) -> int | None:
        """:meth:`find_latest`, then :meth:`load` into ``state``; returns the step (None:
        neither memory nor disk holds one). Collective. ``self.resumed.line`` says where
        it came from."""
        found = self.find_latest()
        if found.step is None:
            self.resumed = found
            return None
        return self.load(state, found, strict=strict, safe_globals=safe_globals).step

    def __repr__(self) -> str:
        return f"MemorySnapshots({str(self.folder.own)!r}, partner={self.partner})"
