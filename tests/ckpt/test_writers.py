"""Two writers on one checkpoint folder never damage a committed checkpoint (issue 33).

Before: two jobs saving steps 1..5 through ``CheckpointManager`` into one folder
shared ``.step_N.partial``; one renamed it while the other wrote, leaving committed
checkpoints with files missing, raw ``OSError``s, and the good ones pruned. Now a
save holds a lease on its target, writes into a directory of its own and commits
only over what it saw (see [Note: one writer per checkpoint] in ``ckpt/_format/lease.py``).

The interleavings are made deterministic by holding a lease explicitly, by running
the second writer from inside the first one's write, or (across processes) by
barriers on the default group, which the checkpoint groups never use; one test runs
two writers at once without any synchronisation.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ckpt
from ckpt._format.lease import LeaseOwner, acquire, lease_file
from ckpt._format.processes import ProcessId
from ckpt._format.writer import CheckpointWriter
from tests.ckpt._common import assert_same, linear, make_model, params
from tests.ranks import run_ranks


def _only_committed(root: Path) -> list[str]:
    """Every entry of ``root``; asserts each committed checkpoint verifies."""
    names = sorted(p.name for p in root.iterdir())
    for name in names:
        if name.startswith("step_"):
            ckpt.verify(root / name)
    return names


# ----------------------------------------------------------------- one process


def test_second_writer_is_refused_before_it_writes(tmp_path: Path) -> None:
    target = tmp_path / "run" / "step_00000001"
    target.parent.mkdir()
    held, recovered = acquire(target, "0123456789abcdef")  # another save, in this process
    assert recovered == []
    with pytest.raises(ckpt.CheckpointInUseError) as info:
        ckpt.save({"model": make_model(0)}, target)
    message = str(info.value)
    assert str(target) in message and f"pid {os.getpid()} on this host" in message, message
    assert "save 0123456789abcdef" in message and "save to another folder" in message
    assert f"remove {lease_file(target)}" in message  # the fix when the owner is elsewhere
    assert isinstance(info.value, ckpt.CheckpointError) and info.value.lease == lease_file(target)
    # Nothing was written, and the other writer's lease is as it was.
    assert sorted(p.name for p in target.parent.iterdir()) == [".step_00000001.lease"]
    owner = LeaseOwner.read(lease_file(target))
    assert owner is not None and owner.token == "0123456789abcdef"

    manager = ckpt.CheckpointManager(target.parent)
    with pytest.raises(ckpt.CheckpointInUseError):
        manager.save(1, {"model": make_model(0)})
    held.release()
    manager.save(1, {"model": make_model(0)})
    assert _only_committed(target.parent) == ["step_00000001"]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _plant_lease(target: Path, process: ProcessId) -> None:
    lease_file(target).write_text(LeaseOwner(process, "feedfeedfeedfeed", 0.0).to_json())


def test_stale_lease_is_recovered_and_a_foreign_one_reported(tmp_path: Path) -> None:
    target = tmp_path / "step_00000001"
    # A save killed on this host: its process is gone, so its lease is recovered.
    _plant_lease(target, ProcessId(socket.gethostname(), _dead_pid(), "1"))
    with pytest.warns(UserWarning, match="recovered the lease .* a save that died"):
        ckpt.save({"model": make_model(0)}, target)
    # A live process whose pid was reused is another process: also recovered.
    _plant_lease(target, ProcessId(socket.gethostname(), os.getpid(), "not-my-start"))
    with pytest.warns(UserWarning, match="recovered the lease"):
        ckpt.save({"model": make_model(1)}, target, overwrite=True)
    assert not lease_file(target).exists()
    # Another host's lease cannot be judged from here: reported, never taken.
    _plant_lease(target, ProcessId("elsewhere.example", 4242, "7"))
    with pytest.raises(ckpt.CheckpointInUseError, match=r"pid 4242 on host elsewhere\.example"):
        ckpt.save({"model": make_model(2)}, target, overwrite=True)
    fresh = make_model(3)
    ckpt.load({"model": fresh}, target)  # the last committed save, intact
    assert_same(params(fresh), params(make_model(1)))


def _during_write(monkeypatch: pytest.MonkeyPatch, other: Callable[[], None]) -> None:
    """Run ``other`` once, inside the next save's write (its lease held, files half
    written)."""
    write = CheckpointWriter.write_data
    calls: list[int] = []

    def write_data(self: CheckpointWriter, *args: Any) -> Any:
        if not calls:
            calls.append(1)
            other()
        return write(self, *args)

    monkeypatch.setattr(CheckpointWriter, "write_data", write_data)


def _another_writer_ignoring_the_lease(tmp_path: Path, target: Path, theirs: Any) -> None:
    """Commit ``theirs`` at ``target`` without its lease (moving an occupant aside)."""
    ckpt.save({"model": theirs}, tmp_path / "elsewhere")
    if target.exists():
        target.rename(tmp_path / "moved_aside")
    (tmp_path / "elsewhere").rename(target)


@pytest.mark.parametrize("overwrite", [False, True])
def test_commit_refuses_to_replace_a_checkpoint_committed_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overwrite: bool
) -> None:
    target = tmp_path / "step_00000007"
    if overwrite:
        ckpt.save({"model": make_model(2)}, target)
    theirs = make_model(1)
    _during_write(monkeypatch, lambda: _another_writer_ignoring_the_lease(tmp_path, target, theirs))
    with pytest.raises(ckpt.CheckpointInUseError, match="committed a checkpoint there while"):
        ckpt.save({"model": make_model(0)}, target, overwrite=overwrite)
    monkeypatch.undo()
    fresh = make_model(3)
    ckpt.load({"model": fresh}, target)  # theirs, whole
    assert_same(params(fresh), params(theirs))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_two_managers_on_one_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """B saves while A is inside its write of the same step (refused), and of another
    step with keep_last=1 (its pruning must spare A's running save and its target)."""
    a = ckpt.CheckpointManager(tmp_path, keep_last=1)
    b = ckpt.CheckpointManager(tmp_path, keep_last=1)
    model_a, model_b = make_model(0), make_model(1)
    a.save(1, {"model": model_a})
    seen: list[str] = []

    def b_meanwhile() -> None:
        with pytest.raises(ckpt.CheckpointInUseError):
            b.save(1, {"model": model_b}, overwrite=True)
        [partial] = b.partial()
        seen.append(partial.name)
        b.save(2, {"model": model_b})  # commits, then prunes: step 1 is A's, leased
        assert b.partial() == [partial] and b.steps() == [1, 2]

    with torch.no_grad():
        linear(model_a, 0).weight.add_(1.0)
    _during_write(monkeypatch, b_meanwhile)
    a.save(1, {"model": model_a}, overwrite=True)
    monkeypatch.undo()
    assert seen and seen[0].startswith(".step_00000001.")
    # A's commit pruned nothing newer than its own step; B's step 2 is the newest.
    assert a.steps() == [1, 2] and a.partial() == []
    b.save(3, {"model": model_b})
    assert _only_committed(tmp_path) == ["step_00000003"]


def test_rotation_keeps_only_checked_checkpoints(tmp_path: Path) -> None:
    manager = ckpt.CheckpointManager(tmp_path, keep_last=2)
    model = make_model(0)
    manager.save(1, {"model": model})
    manager.save(2, {"model": model})
    # Step 2 damaged (a file lost): it does not count as kept, so step 1 stays.
    data = next(p for p in manager.path(2).iterdir() if p.suffix == ".distcp")
    data.unlink()
    with pytest.warns(UserWarning, match="step_00000002 is damaged"):
        manager.save(3, {"model": model})
    assert manager.steps() == [1, 2, 3]
    manager.save(4, {"model": model})  # two whole ones (4, 3) newer than 1 and 2
    assert manager.steps() == [3, 4]


# ------------------------------------------------------------- two process groups


def _writer_groups(ranks_each: int) -> tuple[Any, int]:
    """Two groups of ``ranks_each`` ranks (writer 0 and writer 1); this rank's group
    and writer."""
    groups = [dist.new_group(list(range(w * ranks_each, (w + 1) * ranks_each))) for w in (0, 1)]
    writer = dist.get_rank() // ranks_each
    return groups[writer], writer


def _rank_two_writers_interleaved(root: str, ranks_each: int) -> list[str]:
    """Both writers save steps 1..5 with keep_last=2; at each step the first one holds
    its lease inside its write while the second tries the same step (refused), then the
    second overwrites it. Barriers on the default group order them."""
    group, writer = _writer_groups(ranks_each)
    manager = ckpt.CheckpointManager(root, keep_last=2, process_group=group)
    model = make_model(writer)
    outcomes: list[str] = []
    write = CheckpointWriter.write_data
    holding = [False]

    def write_data(self: CheckpointWriter, *args: Any) -> Any:
        if holding[0]:
            dist.barrier()  # 1: the second writer may try now
            dist.barrier()  # 2: it has tried
        return write(self, *args)

    CheckpointWriter.write_data = write_data  # type: ignore[method-assign]
    for step in range(1, 6):
        first = step % 2  # writer 1 first at odd steps
        holding[0] = writer == first
        if writer == first:
            manager.save(step, {"model": model})
            holding[0] = False
            dist.barrier()  # 3: committed
            dist.barrier()  # 4: the second one overwrote it
        else:
            dist.barrier()  # 1
            try:
                manager.save(step, {"model": model})
                outcomes.append("saved")
            except ckpt.CheckpointError as e:
                outcomes.append(type(e).__name__)
            dist.barrier()  # 2
            dist.barrier()  # 3
            try:
                manager.save(step, {"model": model})
            except ckpt.CheckpointExistsError:
                outcomes.append("exists")
            manager.save(step, {"model": model}, overwrite=True)
            dist.barrier()  # 4
    return outcomes


@pytest.mark.parametrize("ranks_each", [1, 2])
def test_two_writers_interleaved(tmp_path: Path, ranks_each: int) -> None:
    out = run_ranks(
        _rank_two_writers_interleaved, 2 * ranks_each, str(tmp_path), ranks_each, timeout=120
    )
    for rank, outcomes in enumerate(out):
        seconds = 3 if rank // ranks_each == 0 else 2  # writer 0 is second at odd steps
        assert outcomes == ["CheckpointInUseError", "exists"] * seconds, (rank, outcomes)
    assert _only_committed(tmp_path) == ["step_00000004", "step_00000005"]
    # The second writer of each step overwrote it: step 5's first was writer 1, so
    # writer 0's model is in it, and writer 1's in step 4.
    for step, writer in ((5, 0), (4, 1)):
        fresh = make_model(9)
        ckpt.load({"model": fresh}, tmp_path / f"step_{step:08d}")
        assert_same(params(fresh), params(make_model(writer)))


def _rank_two_writers_at_once(root: str, ranks_each: int) -> list[str]:
    """Both writers save steps 1..5 as fast as they can; any error must be a
    CheckpointError (a raw OSError fails the rank)."""
    group, writer = _writer_groups(ranks_each)
    manager = ckpt.CheckpointManager(root, keep_last=2, process_group=group)
    model = make_model(writer)
    outcomes = []
    dist.barrier()  # start together
    for step in range(1, 6):
        try:
            manager.save(step, {"model": model}, overwrite=True)
            outcomes.append("saved")
        except ckpt.CheckpointError as e:
            outcomes.append(type(e).__name__)
    return outcomes


@pytest.mark.parametrize("ranks_each", [1, 2])
def test_two_writers_at_once(tmp_path: Path, ranks_each: int) -> None:
    out = run_ranks(
        _rank_two_writers_at_once, 2 * ranks_each, str(tmp_path), ranks_each, timeout=120
    )
    kinds = {kind for o in out for kind in o}
    assert kinds <= {"saved", "CheckpointInUseError"}, out
    names = _only_committed(tmp_path)  # every committed checkpoint verifies
    assert "step_00000005" in names, names
    assert all(not n.endswith((".partial", ".lease", ".old")) for n in names), names
