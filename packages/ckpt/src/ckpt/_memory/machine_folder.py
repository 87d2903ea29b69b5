"""Where a machine keeps snapshots: a folder per job and launcher in host memory.

[Note: whose snapshots]
Snapshots live in ``/dev/shm`` (tmpfs): they outlive a worker that the launcher
restarts, and go with the machine. A folder there outlives the job too, so a later job
must never take an earlier one's snapshot for its own. The folder of a snapshot is
``<root>/ckpt-snapshots/<job>/<agent>/``:

- ``<job>``: a digest of the disk checkpoint folder and torchrun's run id, so two jobs
  with different checkpoint folders or run ids never meet;
- ``<agent>``: the launcher process that started this worker (torchrun's agent, which
  restarts its workers and outlives them): host, pid and the pid's start time, so a
  reused pid never matches. A new launch is a new agent, and its workers see none of the
  folders of earlier launches: those are stale and removed (:meth:`MachineFolder.open`)
  as soon as their agent is gone. Workers restarted by the same agent find their
  predecessors' snapshots, and the replicas those received from other machines.

Inside, a snapshot file is ``<generation>.r<rank>.s<slot>.{data,snap}``: the data file
of original rank ``rank`` and its descriptor (a JSON header and the shard metadata,
[Note: a snapshot is one rank's checkpoint files]). ``generation`` names the job's
incarnation (a fresh token each time the ranks start their snapshots), so the files of
a restarted job at another world size never mix with its predecessor's. Each original
rank has two slots, written in turns: the descriptor is the commit marker, removed
before its slot is overwritten and written (atomically: a temporary name, then a
rename) only once the data file is complete, so a slot counts only with its
descriptor, and the other slot still holds the previous step.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ckpt._errors import CheckpointError
from ckpt._memory.shard_file import ShardHeader, read_descriptor

__all__ = ["DEFAULT_ROOT", "Agent", "Copy", "MachineFolder", "job_key"]

DEFAULT_ROOT = Path("/dev/shm")
_FOLDER = "ckpt-snapshots"
_AGENT = re.compile(r"^(?P<host>.+)-(?P<pid>\d+)-(?P<started>\d+)$")
_FILE = re.compile(r"^(?P<gen>[0-9a-f]+)\.r(?P<rank>\d+)\.s(?P<slot>[01])\.snap$")


def _start_time(pid: int) -> int | None:
    """Clock ticks after boot at which ``pid`` started (``/proc/<pid>/stat`` field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[19])


@dataclass(frozen=True)
class Agent:
    """The launcher process that started this worker and restarts it (see [Note: whose
    snapshots])."""

    host: str
    pid: int
    started: int

    @classmethod
    def of_this_process(cls) -> Agent:
        pid = os.getppid()
        return cls(socket.gethostname(), pid, _start_time(pid) or 0)

    @classmethod
    def parse(cls, name: str) -> Agent | None:
        match = _AGENT.match(name)
        if match is None:
            return None
        return cls(match["host"], int(match["pid"]), int(match["started"]))

    @property
    def name(self) -> str:
        return f"{self.host}-{self.pid}-{self.started}"

    def alive(self) -> bool | None:
        """Whether the agent still runs; None for another host's (unknowable here)."""
        if self.host != socket.gethostname():
            return None
        return _start_time(self.pid) == self.started


def job_key(disk_root: Path, run_id: str) -> str:
    """The job's folder name: a digest of its disk checkpoint folder and run id."""
    return hashlib.sha256(f"{disk_root}\0{run_id}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Copy:
    """A committed snapshot file on this machine: its descriptor's header, and where."""

    folder: Path
    stem: str  # <generation>.r<rank>.s<slot>
    header: ShardHeader

    @property
    def data(self) -> Path:
        return self.folder / f"{self.stem}.data"

    @property
    def descriptor(self) -> Path:
        return self.folder / f"{self.stem}.snap"

    replica: bool  # received from the original rank's machine


def stem(generation: str, rank: int, slot: int) -> str:
    return f"{generation}.r{rank:05d}.s{slot}"


class MachineFolder:
    """This worker's snapshot folder, and the other live ones of its job on this machine."""

    jobs: Path  # <root>/ckpt-snapshots
    job: Path  # <jobs>/<job key>
    own: Path  # <job>/<agent>: where this worker writes
    machine: str  # this machine's name, as snapshot headers record it

    def __init__(self, root: Path, job: str, agent: Agent, machine: str) -> None:
        self.machine = machine
        self.jobs = root / _FOLDER
        self.job = self.jobs / job
        self.own = self.job / agent.name

    def open(self) -> list[Path]:
        """Create the folder; remove every folder of an agent of this host that is gone
        (earlier launches, any job); returns what was removed."""
        if not self.jobs.parent.is_dir():
            raise CheckpointError(
                f"snapshots: {self.jobs.parent} does not exist; snapshots live in host memory "
                "(a tmpfs such as /dev/shm): pass an existing folder as root="
            )
        self.own.mkdir(parents=True, exist_ok=True)
        removed = []
        for folder in self._agent_folders(every_job=True):
            agent = Agent.parse(folder.name)
            if agent is not None and agent.alive() is False:
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
        return removed

    def _agent_folders(self, *, every_job: bool) -> Iterator[Path]:
        jobs = list(self.jobs.iterdir()) if every_job and self.jobs.is_dir() else [self.job]
        for job in jobs:
            if job.is_dir():
                yield from (p for p in job.iterdir() if p.is_dir())

    def copies(self) -> list[Copy]:
        """Every committed snapshot file of this job on this machine, in the folders of
        live agents of this host (other hosts' and dead agents' are never used)."""
        found = []
        for folder in self._agent_folders(every_job=False):
            agent = Agent.parse(folder.name)
            if agent is None or not agent.alive():
                continue
            for path in folder.iterdir():
                match = _FILE.match(path.name)
                if match is None:
                    continue
                copy = self._committed(folder, path.name[: -len(".snap")])
                if copy is not None:
                    found.append(copy)
        return found

    def _committed(self, folder: Path, name: str) -> Copy | None:
        """The copy named ``name`` if its descriptor reads and its data file is whole."""
        descriptor = folder / f"{name}.snap"
        try:
            header, _ = read_descriptor(descriptor.read_bytes(), descriptor)
            size = (folder / f"{name}.data").stat().st_size
        except (OSError, CheckpointError):
            return None  # removed meanwhile, or a descriptor being replaced
        if size < header.data_bytes:
            return None
        return Copy(folder, name, header, replica=header.host != self.machine)

    def slot(self, generation: str, rank: int) -> int:
        """The slot rank ``rank``'s next snapshot goes to in this folder: the one not
        holding its newest committed step."""
        newest: tuple[int, int] | None = None  # (step, slot)
        for s in (0, 1):
            copy = self._committed(self.own, stem(generation, rank, s))
            if copy is not None and (newest is None or copy.header.step > newest[0]):
                newest = (copy.header.step, s)
        return 0 if newest is None else 1 - newest[1]

    def begin(self, generation: str, rank: int, slot: int) -> Path:
        """Uncommit ``slot`` (its descriptor goes first) and return its data file's path."""
        name = stem(generation, rank, slot)
        with contextlib.suppress(FileNotFoundError):
            (self.own / f"{name}.snap").unlink()
        return self.own / f"{name}.data"

    def commit(self, generation: str, rank: int, slot: int, descriptor: bytes) -> Path:
        """Write ``descriptor``, the commit marker of the slot's complete data file."""
        final = self.own / f"{stem(generation, rank, slot)}.snap"
        partial = final.with_suffix(".snap.partial")
        partial.write_bytes(descriptor)
        os.replace(partial, final)
        return final

    def drop_generations(self, keep: str) -> None:
        """Remove this folder's files of every generation but ``keep``."""
        for path in self.own.iterdir():
            if not path.name.startswith(f"{keep}."):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
