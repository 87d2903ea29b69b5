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
from ckpt._commit import save_load
from ckpt._format.lease import LeaseOwner, acquire, lease_file
from ckpt._format.processes import ProcessId
from tests.ckpt._common import assert_same, linear, make_model, params
from tests.ranks import run_ranks


def _only_committed(root: Path) -> list[str]:
    """Every entry of ``root`` but a job's lease; asserts each committed checkpoint
    verifies."""
    names = sorted(p.name for p in root.iterdir() if p.name != ".ckpt-job.lease")
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
    write = save_load.write_data_file
    calls: list[int] = []

    def write_data_file(*args: Any) -> Any:
        if not calls:
            calls.append(1)
            other()
        return write(*args)

    monkeypatch.setattr(save_load, "write_data_file", write_data_file)


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


# ------------------------------------------------------------- two jobs, one folder
#
# The scenario of issue 39: two jobs (a 1-rank one and a 2-rank one, each a process
# group of its own) given the same CheckpointManager folder. A step may be reported
# saved by one job only, and every committed checkpoint verifies.


def _jobs() -> tuple[Any, str]:
    """Job "a" is rank 0 alone, job "b" ranks 1 and 2; this rank's group and job."""
    groups = {"a": dist.new_group([0]), "b": dist.new_group([1, 2])}
    job = "a" if dist.get_rank() == 0 else "b"
    return groups[job], job


def _attempt(outcomes: list[str], step: int, call: Callable[[], object]) -> None:
    """Record ``saved N`` or the name of the ckpt error the call raised."""
    try:
        call()
        outcomes.append(f"saved {step}")
    except ckpt.CheckpointError as e:
        outcomes.append(type(e).__name__)
        if isinstance(e, ckpt.CheckpointInUseError):  # names the holder and the fix
            said = str(e)
            assert all(w in said for w in ("pid ", "on this host", "started ", "Fix:")), said


def _rank_two_jobs_in_turns(root: str, first: str) -> list[str]:
    """``first`` saves steps 1-3 while the other job tries to save and load (refused:
    the folder is held); ``first`` closes its manager; the other then cannot save an
    older step, loads the newest and continues with 4 and 5; ``first`` is refused in
    turn. Barriers on the default group (which no checkpoint uses) order the jobs."""
    group, job = _jobs()
    manager = ckpt.CheckpointManager(root, keep_last=2, process_group=group)
    model = make_model(0 if job == "a" else 1)
    out: list[str] = []
    if job == first:
        for step in (1, 2, 3):
            _attempt(out, step, lambda step=step: manager.save(step, {"model": model}))
    dist.barrier()  # 1: the first job holds the folder
    if job != first:
        _attempt(out, 1, lambda: manager.save(1, {"model": model}))
        _attempt(out, 0, lambda: manager.load_latest({"model": model}))
    dist.barrier()  # 2
    if job == first:
        manager.close()
    dist.barrier()  # 3: it let go
    if job != first:
        _attempt(out, 2, lambda: manager.save(2, {"model": model}))  # older than 3
        assert manager.load_latest({"model": make_model(5)}) == 3
        for step in (4, 5):
            _attempt(out, step, lambda step=step: manager.save(step, {"model": model}))
    dist.barrier()  # 4: the second job holds it now
    if job == first:
        _attempt(out, 4, lambda: manager.save(4, {"model": model}, overwrite=True))
    dist.barrier()  # 5
    return out


@pytest.mark.parametrize("first", ["a", "b"])
def test_two_jobs_in_turns(tmp_path: Path, first: str) -> None:
    out = run_ranks(_rank_two_jobs_in_turns, 3, str(tmp_path), first, timeout=120)
    jobs = {"a": [out[0]], "b": [out[1], out[2]]}
    second = "b" if first == "a" else "a"
    for outcomes in jobs[first]:
        assert outcomes == ["saved 1", "saved 2", "saved 3", "CheckpointInUseError"], outcomes
    for outcomes in jobs[second]:
        assert outcomes == [
            "CheckpointInUseError",
            "CheckpointInUseError",
            "OlderStepError",
            "saved 4",
            "saved 5",
        ], outcomes
    _no_step_saved_twice(jobs)
    assert _only_committed(tmp_path) == ["step_00000004", "step_00000005"]
    fresh = make_model(9)
    ckpt.load({"model": fresh}, tmp_path / "step_00000005")
    assert_same(params(fresh), params(make_model(0 if second == "a" else 1)))


def _no_step_saved_twice(jobs: dict[str, list[list[str]]]) -> None:
    saved = {
        job: {o for rank in ranks for o in rank if o.startswith("saved")}
        for job, ranks in jobs.items()
    }
    assert not saved["a"] & saved["b"], saved


def _rank_two_jobs_at_once(root: str) -> list[str]:
    """Both jobs save steps 1-5 as fast as they can (no order between them), then wait
    for each other before their managers let go."""
    group, job = _jobs()
    manager = ckpt.CheckpointManager(root, keep_last=2, process_group=group)
    model = make_model(0 if job == "a" else 1)
    out: list[str] = []
    dist.barrier()  # start together
    for step in range(1, 6):
        _attempt(out, step, lambda step=step: manager.save(step, {"model": model}))
    dist.barrier()  # both done: only now may the holder let go
    return out


def test_two_jobs_at_once(tmp_path: Path) -> None:
    out = run_ranks(_rank_two_jobs_at_once, 3, str(tmp_path), timeout=120)
    jobs = {"a": [out[0]], "b": [out[1], out[2]]}
    assert out[1] == out[2], out  # a job's ranks share every outcome
    saved = [job for job, ranks in jobs.items() if ranks[0][0] == "saved 1"]
    assert len(saved) == 1, out  # one job took the folder at its first save
    winner, loser = saved[0], "b" if saved[0] == "a" else "a"
    assert jobs[winner][0] == [f"saved {s}" for s in range(1, 6)], out
    assert jobs[loser][0] == ["CheckpointInUseError"] * 5, out
    _no_step_saved_twice(jobs)
    assert _only_committed(tmp_path) == ["step_00000004", "step_00000005"]
