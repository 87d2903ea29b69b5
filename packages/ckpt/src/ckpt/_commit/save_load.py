"""``save``, ``async_save``, ``load`` and ``verify``: DCP underneath, committed atomically.

A save is a :class:`_SaveTransaction` through the states of :class:`SaveState`:
rank 0 takes the target's lease, checks the path and creates the save's own partial
directory (``prepare``; [Note: one writer per checkpoint] in ``_format/lease.py``), every rank
writes its shards there with DCP, hashing the bytes as they are written, and rank 0,
in DCP's last step, writes the manifest and renames the directory into place
(``write``). See [Note: atomic commit] in ``layout.py``, [Note: integrity] in
``_format/manifest.py`` and [Note: one pass over the bytes] in ``_format/writer.py``.

``save`` and ``async_save`` share one path ([Note: capture, then copy or write] in
``_wrappers/fsdp1_runs.py``): the state is captured by reference without communication,
then written at once (``save``), or copied into reused host buffers (``_commit/staging.py``)
and written on a background thread over the checkpoint's own process group
(``async_save``).

A load reads the manifest (and checks its HMAC when given a key), has every rank verify
a balanced share of the files, checks the keys and shapes against the state on every
rank, and only then lets DCP read, through a reader and planner that never run code
from the checkpoint ([Note: no code from a checkpoint] in ``_format/safe_unpickling.py``).
Every decision is shared before anyone acts ([Note: one decision, every rank]). A
peer that dies or hangs inside is named ([Note: naming a fault inside a checkpoint] in
``_commit/peer_faults.py``).
"""

from __future__ import annotations

import enum
import os
import shutil
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ckpt._comm import Comm, async_group, device_of, in_phase, on_device
from ckpt._commit.agreement import check_ranks_agree
from ckpt._commit.load_fit import (
    RankFit,
    combine_fits,
    fit_rank,
    local_dtypes,
    local_shapes,
    saved_dtypes,
    saved_shapes,
)
from ckpt._commit.peer_faults import named_faults, peers, waited_for_commit
from ckpt._commit.staging import stage
from ckpt._errors import (
    CheckpointError,
    CheckpointInUseError,
    CorruptCheckpointError,
    DiskFullError,
    FileProblem,
    UnsafeCheckpointError,
)
from ckpt._format import layout
from ckpt._format.disk_space import disk_full, found_disk_full, is_disk_full, rank_failures
from ckpt._format.file_checks import check_file_set, listed_files, verify_files
from ckpt._format.lease import Lease, acquire
from ckpt._format.manifest import (
    Checksum,
    FileRecord,
    Manifest,
    balance_files,
    check_signature,
    hash_file,
    new_manifest,
    read_manifest,
    sign_manifest,
    write_manifest,
)
from ckpt._format.safe_unpickling import (
    SafeFileSystemReader,
    SafeGlobals,
    SafeLoadPlanner,
    check_objects,
    read_metadata,
)
from ckpt._format.save_planner import CheckpointSavePlanner
from ckpt._format.writer import CheckpointWriter, commit_result
from ckpt._wrappers.adapters import apply_loaded, to_state_dict
from ckpt._wrappers.fqns import adopt_saved_names

__all__ = [
    "AsyncSave",
    "CheckpointInfo",
    "async_save",
    "load",
    "read_into",
    "save",
    "verify",
    "wait_pending",
]

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint: where it is and what its manifest says."""

    path: Path
    manifest: Manifest | None  # None only for a plain DCP directory loaded with verify=False


class SaveState(enum.Enum):
    """Where a save stands; transitions only forward, or to FAILED."""

    NEW = "new"
    """Nothing on disk yet."""
    PREPARED = "prepared"
    """The path may be saved to; the empty partial directory exists on every rank's view."""
    WRITTEN = "written"
    """DCP wrote (and synced) every rank's files and the .metadata into the partial dir."""
    COMMITTED = "committed"
    """The manifest is written and the directory renamed into place."""
    FAILED = "failed"
    """A step raised; rank 0 removed the partial directory and gave up the lease where it
    could (a rank 0 that died leaves both to the next save)."""


class _SaveTransaction:
    """One save of one checkpoint, driven by every rank through the same steps."""

    path: Path  # the final, committed location
    comm: Comm
    call: str  # "save" or "async save", for messages
    checksum: Checksum
    key: bytes | None  # sign the manifest with it ([Note: keyed manifest])
    saved_by: dict[str, str]  # state entry -> what was saved there, for the manifest
    state: SaveState
    manifest: Manifest | None
    token: str  # this save's: its partial directory's name ([Note: one writer per checkpoint])
    expected: layout.Occupant  # what was committed at path when the save began
    lease: Lease | None  # rank 0's, from prepare until the commit or the failure
    step: str  # where DCP is ([Note: naming a fault inside a checkpoint])

    def __init__(
        self,
        path: Path,
        comm: Comm,
        checksum: Checksum,
        key: bytes | None,
        state: Mapping[str, Any],
        *,
        call: str,
    ) -> None:
        self.path = path
        self.comm = comm
        self.call = call
        self.checksum = checksum
        self.key = key
        self.saved_by = {name: _kind_of(value) for name, value in state.items()}
        self.state = SaveState.NEW
        self.manifest = None
        self.token = ""
        self.expected = None
        self.lease = None
        self.step = "preparing"

    def _expect(self, *states: SaveState) -> None:
        assert self.state in states, f"save to {self.path} is {self.state}, expected {states}"

    @property
    def partial(self) -> Path:
        """The directory this save writes into."""
        return layout.partial_path(self.path, self.token)

    def _take_lease(self, overwrite: bool) -> tuple[list[Path], str, layout.Occupant]:
        """Rank 0: the lease, then the path's checks and the partial directory."""
        layout.make_parent(self.path)
        token = self.token = layout.new_token()  # here too, for _abandon on rank 0
        self.lease, recovered = acquire(self.path, token)
        try:
            for owner in recovered:
                warnings.warn(
                    f"ckpt: recovered the lease on {self.path} of a save that died before "
                    f"its commit ({owner.describe()})",
                    stacklevel=5,
                )
            removed, expected = layout.prepare_partial(self.path, overwrite, token)
        except BaseException:
            self._release()
            raise
        return removed, token, expected

    def _release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def prepare(self, overwrite: bool) -> None:
        """Rank 0 takes the lease, checks the path and creates the partial directory;
        every rank learns the save's token (see [Note: one writer per checkpoint])."""
        self._expect(SaveState.NEW)
        try:
            with named_faults(self.call, self.path, self.comm, "preparing", self._abandon):
                removed, self.token, self.expected = self.comm.run_on_coordinator(
                    f"prepare a save to {self.path}", lambda: self._take_lease(overwrite)
                )
        except BaseException:
            self.state = SaveState.FAILED
            raise
        if removed and self.comm.is_coordinator:
            warnings.warn(
                f"ckpt: removed {', '.join(map(str, removed))}, left by an earlier save to "
                f"{self.path} that was interrupted before its commit",
                stacklevel=3,
            )
        self.state = SaveState.PREPARED

    def _abandon(self) -> str:
        """After a peer failed: rank 0 removes what this save wrote and gives up the
        lease, with no collective (the group is broken); says what became of it."""
        if self.comm.is_coordinator and self.state is SaveState.COMMITTED:
            self._release()
            return (
                f"The checkpoint {self.path} was committed and is whole (the failure came "
                f"after rank 0's commit)."
            )
        if self.comm.is_coordinator:
            if self.token:
                shutil.rmtree(self.partial, ignore_errors=True)
            self._release()
            return (
                f"Nothing of this save was committed: {self.path} is as it was (a previous "
                f"checkpoint there is intact) and the partial directory was removed."
            )
        return (
            f"Nothing of this save was committed unless rank 0 committed it: {self.path} is "
            f"as it was or whole; rank 0 removes the partial directory (or the next save "
            f"does)."
        )

    def _failed_step(self, error: BaseException) -> str:
        if self.step == "writing" and waited_for_commit(error):
            return "commit"  # sent its results; waited for rank 0's commit
        return self.step

    def _on_step(self, step: str) -> None:
        self.step = step

    def write(
        self, state_dict: dict[str, Any], on_commit: Callable[[], None] | None = None
    ) -> CheckpointInfo:
        """Every rank writes its shards into the partial directory (DCP, in parallel);
        rank 0 commits in DCP's last step, then runs ``on_commit``.

        Every rank returns only after rank 0 committed and ran ``on_commit``.
        """
        self._expect(SaveState.PREPARED)
        partial = self.partial
        writer = CheckpointWriter(
            partial,
            self.path,
            self.checksum,
            lambda records: self._seal(records, on_commit),
            self._on_step,
        )
        self.step = "planning"
        try:
            if not self.comm.distributed:
                _quiet_single_process()
            with named_faults(self.call, self.path, self.comm, self._failed_step, self._abandon):
                metadata = dcp_save(
                    state_dict,
                    storage_writer=writer,
                    planner=CheckpointSavePlanner(),
                    process_group=self.comm.group,
                    no_dist=not self.comm.distributed,
                )
        except (CheckpointException, DiskFullError) as e:
            # DCP shares a failure only after every rank finished its step (and a single
            # process's planning step raises directly), so the partial directory is no
            # one's any more.
            self.state = SaveState.FAILED
            refused = found_disk_full(e)  # [Note: naming a full disk]
            ran_out = refused is None and is_disk_full(e)

            def clean_up() -> DiskFullError | None:
                shutil.rmtree(partial, ignore_errors=True)
                self._release()
                # Rank 0's writer planned the whole save, so its estimate is the one;
                # measured after the cleanup, so the free bytes are a retry's.
                return disk_full(self.path, writer.needed) if ran_out else None

            # Every rank got the same failure from DCP, so all are here together.
            with named_faults(self.call, self.path, self.comm, "writing", self._abandon):
                full = self.comm.run_on_coordinator(
                    f"clean up the failed save to {self.path}", clean_up
                )
            if refused is not None:
                raise refused from None
            if full is not None:
                raise full from e
            if isinstance(e, CheckpointException):
                in_use = next(
                    (f for f in rank_failures(e) if isinstance(f, CheckpointInUseError)), None
                )
                if in_use is not None:
                    raise in_use from None
                raise _dcp_failure(f"write {self.path}", e) from e
            raise
        except BaseException as e:
            self.state = SaveState.FAILED
            if not self.comm.distributed:  # no one else writes there
                shutil.rmtree(partial, ignore_errors=True)
            self._release()  # another save writes into a directory of its own
            if not self.comm.distributed and is_disk_full(e):
                raise disk_full(self.path, writer.needed) from e
            raise
        manifest = commit_result(metadata)  # [Note: the commit's result rides back]
        self.manifest = manifest if isinstance(manifest, Manifest) else read_manifest(self.path)
        self.state = SaveState.COMMITTED
        return CheckpointInfo(self.path, self.manifest)

    def _seal(self, records: list[FileRecord], on_commit: Callable[[], None] | None) -> Manifest:
        """Rank 0, in DCP's finish step (every rank's files are written and synced):
        the manifest, the rename, then ``on_commit``; the lease goes last."""
        self.state = SaveState.WRITTEN
        partial = self.partial
        present = listed_files(partial)
        hashed = {r.name for r in records}
        # Anything no stream wrote (not written through DCP) is hashed here so the
        # manifest covers every file.
        records = [r for r in records if r.name in present]
        records.extend(hash_file(partial / n, self.checksum) for n in present if n not in hashed)
        vanished = sorted(hashed - set(present))
        if vanished:
            raise CheckpointError(f"files disappeared while saving: {vanished}")
        manifest = new_manifest(records, self.checksum, self.comm.world_size, self.saved_by)
        if self.key is not None:
            manifest = sign_manifest(manifest, self.key)
        try:
            write_manifest(partial, manifest)
        except OSError as e:
            if not is_disk_full(e):
                raise
            shutil.rmtree(partial, ignore_errors=True)  # [Note: naming a full disk]
            raise disk_full(self.path, None) from e
        layout.commit(self.path, self.token, self.expected)
        self.state = SaveState.COMMITTED
        self.manifest = manifest
        try:
            if on_commit is not None:  # before DCP's broadcast: ranks see it done
                try:
                    on_commit()
                except Exception as e:  # never turn a committed save into an error
                    warnings.warn(f"ckpt: after committing {self.path}: {e}", stacklevel=2)
        finally:
            self._release()
        return manifest


def _kind_of(value: object) -> str:
    """``package.Class`` of a state entry (the package is the top-level module)."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    cls = type(value)
    package = cls.__module__.split(".")[0]
    return "object" if package == "builtins" else f"{package}.{cls.__qualname__}"


def _dcp_failure(what: str, error: CheckpointException) -> CheckpointError:
    """DCP's CheckpointException derives from BaseException (``except Exception`` misses
    it); turn it into a CheckpointError that names the ranks and their errors."""
    causes = "; ".join(
        f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in error.failures.items()
    )
    return CheckpointError(f"failed to {what}: {causes}\n{error}")


_SINGLE_PROCESS_WARNING = (
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is "
    r"to (save|load) in a single process"
)


def _quiet_single_process() -> None:
    """Silence DCP's warning that it runs without a process group (idempotent: an
    identical filter is replaced, not added again).

    For ckpt a single process is a supported mode, not a mistake, and the warning would
    also fire on the background thread of ``async_save`` (where ``catch_warnings``,
    being process-wide, cannot be used safely). The filter matches only that message.
    """
    warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)


class AsyncSave:
    """A save running in the background; ``wait()`` for its result.

    The state was copied to CPU memory before ``async_save`` returned, so training may
    change the model and optimizer at once. The checkpoint appears (is committed) only
    when the write finishes. Call ``wait()`` (or ``ckpt.wait_pending()``) before
    destroying the process group or exiting.
    """

    path: Path
    _done: threading.Event
    _result: CheckpointInfo | None
    _error: BaseException | None
    _thread: threading.Thread | None

    def __init__(self, path: Path) -> None:
        self.path = path
        self._done = threading.Event()
        self._result = None
        self._error = None
        self._thread = None

    def _start(self, work: Callable[[], CheckpointInfo]) -> None:
        def run() -> None:
            try:
                self._result = work()
            except BaseException as e:
                self._error = e
            finally:
                self._done.set()

        self._thread = threading.Thread(target=run, name=f"ckpt-save:{self.path.name}")
        self._thread.start()

    def done(self) -> bool:
        """Whether the save has finished (committed or failed); never blocks."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """Block until committed and return it; re-raise the save's error if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the asynchronous save to {self.path} is still running")
        if self._thread is not None:
            self._thread.join()
        with _Pending.lock:  # waited for: no longer pending for the next save or load
            if _Pending.save is self:
                _Pending.save = None
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def __repr__(self) -> str:
        status = "running" if not self.done() else ("failed" if self._error else "committed")
        return f"AsyncSave({str(self.path)!r}, {status})"


class _Pending:
    """This process's running asynchronous save, if any (at most one at a time)."""

    lock = threading.Lock()
    save: AsyncSave | None = None


def wait_pending() -> CheckpointInfo | None:
    """Wait for this process's asynchronous save, if one is running.

    ``save``, ``async_save`` and ``load`` call it first, so saves never overlap and a
    load never races a commit. Raises the background save's error if it failed.
    """
    with _Pending.lock:
        pending, _Pending.save = _Pending.save, None
    if pending is None:
        return None
    try:
        return pending.wait()
    except CheckpointError:  # names its save ("async save") and path: keep its class
        raise
    except Exception as e:
        raise CheckpointError(
            f"the previous asynchronous save to {pending.path} failed: {e}"
        ) from e


def _nothing_written() -> str:
    return "Nothing of this save was written; a previous checkpoint there is intact."


def _nothing_read() -> str:
    return "Nothing was loaded; the checkpoint on disk is unchanged."


def _partly_read() -> str:
    return (
        "The checkpoint on disk is unchanged, but the state being loaded may be partly "
        "loaded: load it again before training on."
    )


def _as_path(path: PathLike) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return Path(os.path.abspath(os.fspath(path)))


def _as_checksum(checksum: str | Checksum | None, key: bytes | None) -> Checksum:
    """The checksum to record: CRC-32 by default, BLAKE2b (required) with a key."""
    if checksum is None:
        return Checksum.BLAKE2B if key is not None else Checksum.CRC32
    try:
        chosen = Checksum(checksum)
    except ValueError:
        names = ", ".join(repr(c.value) for c in Checksum)
        raise ValueError(f"unknown checksum {checksum!r}; choose one of {names}") from None
    if key is not None and chosen is not Checksum.BLAKE2B:
        raise ValueError(
            f"checksum={chosen.value!r} cannot be combined with key=: a keyed manifest "
            f"needs 'blake2b' digests (CRC-32 can be forged to match); leave checksum unset"
        )
    return chosen


def _as_key(key: bytes | str | None) -> bytes | None:
    """The HMAC key as bytes; a str is taken as UTF-8. Refuses an empty key."""
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"key must be bytes or str, got {type(key).__name__}")
    if len(key) < 16:
        raise ValueError(
            f"key has {len(key)} bytes; use at least 16 random bytes (e.g. os.urandom(32))"
        )
    return bytes(key)


@in_phase("save")
def save(
    state: Mapping[str, Any],
    path: PathLike,
    *,
    overwrite: bool = False,
    checksum: str | Checksum | None = None,
    key: bytes | str | None = None,
    process_group: dist.ProcessGroup | None = None,
    _on_commit: Callable[[], None] | None = None,
) -> CheckpointInfo:
    """Save ``state`` to ``path`` from every rank; the checkpoint appears atomically.

    Call on every rank of ``process_group`` (default: the default group, or no group at
    all in a single process). ``state`` maps names to models, optimizers, other
    stateful objects, tensors and plain objects. Each rank writes its own shards in
    parallel into a sibling directory; the path only appears, complete and with a
    manifest of checksums, after every rank finished, so a crash mid-save never leaves
    a damaged checkpoint at ``path``. ``overwrite=True`` replaces an existing
    checkpoint (atomically as well).

    ``checksum`` is ``"crc32"`` (default) or ``"blake2b"``. With ``key`` (bytes kept
    apart from the checkpoints) the manifest records BLAKE2b digests and is signed
    with an HMAC, so a ``load``/``verify`` given the same key refuses a checkpoint
    that anyone without the key wrote or changed ([Note: keyed manifest]).
    """
    wait_pending()
    target = _as_path(path)
    comm = Comm.of(process_group)
    mac_key = _as_key(key)
    sum_kind = _as_checksum(checksum, mac_key)
    options = {"overwrite": overwrite, "checksum": sum_kind, "keyed": mac_key is not None}
    with on_device(device_of(state)):  # [Note: choosing the CUDA device] in fsdp
        with named_faults("save", target, comm, "agreement", _nothing_written):
            check_ranks_agree("ckpt.save", comm, target, options)
            peers(comm)
        state_dict, _ = to_state_dict(state, process_group)  # by reference, no collective
        tx = _SaveTransaction(target, comm, sum_kind, mac_key, state, call="save")
        tx.prepare(overwrite)
        return tx.write(state_dict, _on_commit)


@in_phase("async save")
def async_save(
    state: Mapping[str, Any],
    path: PathLike,
    *,
    overwrite: bool = False,
    checksum: str | Checksum | None = None,
    key: bytes | str | None = None,
    process_group: dist.ProcessGroup | None = None,
    _on_commit: Callable[[], None] | None = None,
) -> AsyncSave:
    """Like ``save``, but return once this rank's state is copied to host memory.

    Training is blocked only for that copy: what each rank holds (its flat shards,
    ``DTensor`` shards, optimizer state, plain values), copied without communication
    into host buffers that the next asynchronous save reuses (pinned on CUDA; see
    [Note: staging] in ``_commit/staging.py``). Everything else (DCP's planning, the writes,
    the hashing and the commit) runs on a background thread while training continues
    and changes the live tensors; the returned handle's ``wait()`` gives the committed
    checkpoint, which holds the state as it was when ``async_save`` was called. A later
    save or load first waits for this one. The background collectives run on a
    dedicated gloo group (created on the first call, on every rank), so they never meet
    the training loop's; or on ``process_group`` if given, which the training loop must
    then not use meanwhile.
    """
    wait_pending()
    target = _as_path(path)
    group = process_group if process_group is not None else async_group()
    comm = Comm.of(group)
    mac_key = _as_key(key)
    sum_kind = _as_checksum(checksum, mac_key)
    options = {"overwrite": overwrite, "checksum": sum_kind, "keyed": mac_key is not None}
    device = device_of(state)
    with on_device(device):
        with named_faults("async save", target, comm, "agreement", _nothing_written):
            check_ranks_agree("ckpt.async_save", comm, target, options)
            peers(comm)
        staged = stage(to_state_dict(state, group)[0])  # [Note: staging]
        tx = _SaveTransaction(target, comm, sum_kind, mac_key, state, call="async save")
        tx.prepare(overwrite)

    def work() -> CheckpointInfo:
        with on_device(device):
            return tx.write(staged.state_dict(), _on_commit)

    handle = AsyncSave(target)
    with _Pending.lock:
        _Pending.save = handle
    handle._start(work)
    return handle


def _open_checkpoint(
    path: Path, comm: Comm, verify: bool, key: bytes | None = None
) -> Manifest | None:
    """Rank 0 checks ``path`` is a committed checkpoint, reads its manifest and (``key``)
    checks its HMAC; then (``verify``) every rank checks its share of the files. Raises
    on every rank. Nothing is unpickled here."""
    if key is not None and not verify:
        raise ValueError("key= checks the files against the signed manifest: keep verify=True")

    def open_on_rank0() -> tuple[Manifest | None, list[FileProblem]]:
        if not layout.is_committed(path):
            if not verify and (path / ".metadata").is_file():
                return None, []
            raise layout.not_a_checkpoint(path)
        manifest = read_manifest(path)
        if key is not None:
            check_signature(manifest, key, path)
        problems = check_file_set(manifest, listed_files(path)) if verify else []
        return manifest, problems

    manifest, problems = comm.run_on_coordinator(f"open {path}", open_on_rank0)
    if not verify or manifest is None:
        return manifest
    sizes = {f.name: f.size for f in manifest.files}
    share = balance_files(sizes, comm.world_size)[comm.rank]
    found = comm.all_gather(verify_files(path, manifest, share))
    problems = problems + [p for rank_problems in found for p in rank_problems]
    if problems:
        raise CorruptCheckpointError(path, sorted(problems, key=lambda p: p.name))
    return manifest


@in_phase("verify")
def verify(
    path: PathLike,
    *,
    key: bytes | str | None = None,
    safe_globals: SafeGlobals = (),
    process_group: dist.ProcessGroup | None = None,
) -> Manifest:
    """Check a committed checkpoint's files against its manifest without loading it.

    Call on every rank (or in one process): the files are split over the ranks. Raises
    ``CorruptCheckpointError`` naming each missing, extra, truncated or altered file,
    ``SignatureError`` when ``key`` is given and the manifest is not signed with it,
    and ``UnsafeCheckpointError`` when the metadata or a non-tensor value would need
    more than ``load`` admits (``safe_globals`` widens it as for ``load``). Nothing
    from the checkpoint is run. The checksums catch accidents (corruption, truncation,
    files of two checkpoints mixed); only ``key`` also catches someone who rewrote
    the manifest.
    """
    wait_pending()
    source = _as_path(path)
    comm = Comm.of(process_group)
    with named_faults("verify", source, comm, "agreement", _nothing_read):
        check_ranks_agree("ckpt.verify", comm, source, {"keyed": key is not None})
        peers(comm)
    with named_faults("verify", source, comm, "verifying", _nothing_read):
        manifest = _open_checkpoint(source, comm, verify=True, key=_as_key(key))
    assert manifest is not None
    comm.run_on_coordinator(
        f"check the pickles of {source}",
        lambda: check_objects(source, read_metadata(source), safe_globals),
    )
    return manifest


@in_phase("load")
def load(
    state: Mapping[str, Any],
    path: PathLike,
    *,
    strict: bool = True,
    verify: bool = True,
    key: bytes | str | None = None,
    safe_globals: SafeGlobals = (),
    process_group: dist.ProcessGroup | None = None,
) -> CheckpointInfo:
    """Load the checkpoint at ``path`` into ``state`` on every rank, in place.

    Models, optimizers and stateful objects load their state; tensors are filled in
    place; plain objects are replaced in ``state``. Before anything is read: the files
    are checked against the manifest (``verify``), and the keys and global shapes are
    checked against ``state`` on every rank, so a corrupt checkpoint or one of another
    model raises a clear error and changes nothing. ``strict=False`` loads the keys
    both sides have and leaves the rest. Entries of the checkpoint that ``state`` does
    not name are not loaded (load just ``{"model": model}`` from a training checkpoint).
    The world size may differ from the one that saved.

    Loading never runs code from the checkpoint: DCP's metadata is unpickled admitting
    only DCP's own types, and non-tensor values with ``torch.load(weights_only=True)``
    semantics, widened only by ``safe_globals`` (classes or functions you trust, as
    for ``torch.serialization.safe_globals``); anything else raises
    ``UnsafeCheckpointError`` before it runs. ``key``: the manifest must carry an HMAC
    under this key (``save(..., key=)``), checked before anything is unpickled.
    """
    wait_pending()
    source = _as_path(path)
    comm = Comm.of(process_group)
    with on_device(device_of(state)):
        with named_faults("load", source, comm, "agreement", _nothing_read):
            check_ranks_agree(
                "ckpt.load",
                comm,
                source,
                {"strict": strict, "verify": verify, "keyed": key is not None},
            )
            peers(comm)
        with named_faults("load", source, comm, "verifying", _nothing_read):
            manifest = _open_checkpoint(source, comm, verify, _as_key(key))
        read_into(
            state, source, SafeFileSystemReader(source), manifest,
            comm=comm, strict=strict, safe_globals=safe_globals, process_group=process_group,
        )  # fmt: skip
        return CheckpointInfo(source, manifest)


def read_into(
    state: Mapping[str, Any],
    source: Path,
    reader: SafeFileSystemReader,
    manifest: Manifest | None,
    *,
    comm: Comm,
    strict: bool,
    safe_globals: SafeGlobals,
    process_group: dist.ProcessGroup | None,
    call: str = "load",
) -> None:
    """The reading half of ``load``, from wherever ``reader`` reads: every rank checks
    that the saved keys and shapes fit ``state`` (all share the verdict), then DCP reads
    the pieces each rank needs (resharding to this world size) and ``state`` takes them.

    ``source`` names the checkpoint in errors; ``manifest`` (if any) tells adapters what
    was saved. A disk load passes a reader of the checkpoint's folder; the memory tier
    (``_memory/``) one that reads each piece from whichever surviving rank holds it.
    """
    state_dict, ctx = to_state_dict(state, process_group, manifest, loading=True)
    try:
        metadata = reader.read_metadata()
        adopt_saved_names(state_dict, state, ctx.module_for, metadata.state_dict_metadata)
        dtypes = (local_dtypes(state_dict), saved_dtypes(metadata))
        fit: RankFit | CheckpointError = fit_rank(
            local_shapes(state_dict), saved_shapes(metadata), list(state), dtypes
        )
    except CheckpointError as e:
        fit = e
    step = ["planning"]  # DCP's plan, then its reads ([Note: naming a fault ...])
    with named_faults(call, source, comm, lambda e: step[0], _partly_read):
        fits = comm.all_gather(fit)
        for rank_fit in fits:  # the same files on every rank: normally all or none fail
            if isinstance(rank_fit, CheckpointError):
                raise rank_fit
        error = combine_fits(source, [f for f in fits if isinstance(f, RankFit)], strict)
        if error is not None:
            raise error
        reader.on_read = lambda: step.__setitem__(0, "reading")
        try:
            if not comm.distributed:
                _quiet_single_process()
            dcp_load(
                state_dict,
                storage_reader=reader,
                planner=SafeLoadPlanner(source, safe_globals, allow_partial_load=not strict),
                process_group=process_group,
                no_dist=not comm.distributed,
            )
        except CheckpointException as e:
            for exc, _ in e.failures.values():
                if isinstance(exc, UnsafeCheckpointError):
                    raise exc from None
            raise _dcp_failure(f"read {source}", e) from e
    apply_loaded(state, state_dict, ctx)
