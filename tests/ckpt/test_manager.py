"""CheckpointManager in one process: step layout, keep-last-K, latest, leftovers; the
folder held by one job, steps saved forward."""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckpt
from ckpt._format.job_lease import EXPIRES_AFTER_S, job_lease_file, renew_held
from ckpt._format.lease import LeaseOwner
from ckpt._format.processes import ProcessId
from tests.ckpt._common import assert_same, linear, make_model, make_optimizer, params, train_step


def test_keep_last_prunes_only_after_a_commit(tmp_path: Path) -> None:
    model = make_model(0)
    optim = make_optimizer(model)
    manager = ckpt.CheckpointManager(tmp_path / "run", keep_last=2)
    assert manager.steps() == [] and manager.latest() is None
    assert manager.load_latest({"model": model}) is None  # fresh start

    snapshots = {}
    for step in range(1, 5):
        train_step(model, optim, step)
        manager.save(step, {"model": model, "optim": optim, "step": step})
        snapshots[step] = params(model)
        assert manager.steps() == list(range(max(1, step - 1), step + 1))
    assert sorted(os.listdir(tmp_path / "run")) == [
        ".ckpt-job.lease",  # held by this job until close()
        "step_00000003",
        "step_00000004",
    ]
    manager.close()
    assert sorted(os.listdir(tmp_path / "run")) == ["step_00000003", "step_00000004"]
    assert manager.latest() == 4 and manager.path(4) == tmp_path / "run" / "step_00000004"

    fresh = make_model(5)
    state: dict[str, Any] = {"model": fresh, "optim": make_optimizer(fresh), "step": 0}
    assert manager.load_latest(state) == 4 and state["step"] == 4
    assert_same(params(fresh), snapshots[4])
    assert manager.load(state, step=3) == 3 and state["step"] == 3
    assert_same(params(fresh), snapshots[3])
    with pytest.raises(ckpt.NotACheckpointError, match="step_00000001"):
        manager.load(state, step=1)  # pruned


def test_async_saves_prune_after_commit(tmp_path: Path) -> None:
    model = make_model(0)
    manager = ckpt.CheckpointManager(tmp_path, keep_last=1)
    handles = []
    for step in (10, 20, 30):
        with torch.no_grad():
            linear(model, 0).bias.fill_(float(step))
        handles.append(manager.async_save(step, {"model": model}))
    assert all(h.done() for h in handles[:-1])  # each save waited for the one before
    info = manager.wait()
    assert info is not None and info.path == manager.path(30)
    assert manager.steps() == [30]
    fresh = make_model(1)
    assert manager.load_latest({"model": fresh}) == 30
    assert torch.equal(linear(fresh, 0).bias, torch.full((12,), 30.0))


def test_leftovers_are_reported_ignored_and_cleaned(tmp_path: Path) -> None:
    model = make_model(0)
    manager = ckpt.CheckpointManager(tmp_path, keep_last=3)
    manager.save(1, {"model": model})
    # What an interrupted save of step 2 leaves: an uncommitted directory.
    leftover = tmp_path / ".step_00000002.partial"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"half")
    # A directory under a step name without a manifest is not a checkpoint either.
    (tmp_path / "step_00000005").mkdir()

    assert manager.steps() == [1] and manager.partial() == [leftover]
    with pytest.warns(UserWarning, match=r"ignoring .*\.step_00000002\.partial"):
        assert manager.load_latest({"model": make_model(1)}) == 1
    with pytest.raises(ckpt.PartialCheckpointError, match="interrupted before its commit"):
        ckpt.load({"model": model}, manager.path(2))

    with pytest.warns(UserWarning, match="removing .*step_00000002.partial"):
        manager.save(3, {"model": model})
    assert manager.partial() == [] and manager.steps() == [1, 3]


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last must be None"):
        ckpt.CheckpointManager(tmp_path, keep_last=0)
    manager = ckpt.CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        manager.path(-1)
    with pytest.raises(ckpt.NotACheckpointError, match="no committed step_<N> checkpoint"):
        manager.load({"model": make_model(0)})
    manager.save(0, {"model": make_model(0)})
    with pytest.raises(ckpt.CheckpointExistsError, match="pass overwrite=True"):
        manager.save(0, {"model": make_model(0)})
    manager.save(0, {"model": make_model(0)}, overwrite=True)
    assert manager.steps() == [0] and "keep_last=None" in repr(manager)


def test_interrupted_overwrite_keeps_the_only_copy(tmp_path: Path) -> None:
    model = make_model(0)
    manager = ckpt.CheckpointManager(tmp_path, keep_last=5)
    manager.save(5, {"model": model})
    # A kill between the two renames of an overwrite leaves the old copy aside.
    old = tmp_path / ".step_00000005.old"
    manager.path(5).rename(old)
    with pytest.raises(ckpt.NotACheckpointError, match="interrupted between its two renames"):
        ckpt.load({"model": model}, manager.path(5))
    manager.save(6, {"model": model})
    assert manager.partial() == [old]  # reported, not deleted: it is step 5's only copy
    old.rename(manager.path(5))
    fresh = make_model(1)
    assert manager.load({"model": fresh}, step=5) == 5
    assert_same(params(fresh), params(model))


# ------------------------------------------------------- one job per folder (issue 39)


def _plant_job_lease(root: Path, host: str, pid: int, renewed: float) -> Path:
    """A job lease as another process left it, last renewed at ``renewed``."""
    root.mkdir(parents=True, exist_ok=True)
    file = job_lease_file(root)
    owner = LeaseOwner(ProcessId(host, pid, "1"), "feedfeedfeedfeed", renewed, renewed - 5)
    file.write_text(owner.to_json())
    os.utime(file, (renewed, renewed))
    return file


def test_a_manager_holds_its_folder_until_close(tmp_path: Path) -> None:
    model = make_model(0)
    first = ckpt.CheckpointManager(tmp_path)
    file = job_lease_file(tmp_path)
    assert not file.exists()  # taken at the first save or load, not at construction
    first.save(1, {"model": model})
    assert file.is_file()
    # Managers of one process are one job: they share the lease, and it stays until
    # the last one lets go.
    with ckpt.CheckpointManager(tmp_path) as second:
        second.save(2, {"model": model})
    assert file.is_file()
    first.close()
    assert not file.exists()
    first.close()  # idempotent
    # Renewed while held: its mtime moves forward at each renewal.
    first.save(3, {"model": model})
    os.utime(file, (1.0, 1.0))
    renew_held()
    assert file.stat().st_mtime > 1.0
    del first
    gc.collect()
    assert not file.exists()  # collected: let go


def test_a_second_job_is_refused_and_a_gone_one_taken_over(tmp_path: Path) -> None:
    model = make_model(0)
    here = socket.gethostname()
    # A live job on another host, renewed just now: refused at the first save and load.
    file = _plant_job_lease(tmp_path, "elsewhere.example", 4242, time.time())
    manager = ckpt.CheckpointManager(tmp_path)
    for call in (lambda: manager.save(1, {"model": model}), lambda: manager.load_latest({})):
        with pytest.raises(ckpt.CheckpointInUseError) as info:
            call()
        said = str(info.value)
        assert f"cannot use the checkpoint folder {tmp_path}" in said, said
        assert "pid 4242 on host elsewhere.example (started " in said, said
        assert "stop that job or let it finish" in said and str(file) in said, said
        assert info.value.lease == file
    assert manager.steps() == []  # nothing was written
    # The same lease not renewed for longer than the expiry: abandoned, taken over.
    _plant_job_lease(tmp_path, "elsewhere.example", 4242, time.time() - EXPIRES_AFTER_S - 5)
    with pytest.warns(UserWarning, match="took over .* from a job that is gone: pid 4242"):
        manager.save(1, {"model": model})
    manager.close()
    # A job that died on this host: taken over at once.
    _plant_job_lease(tmp_path, here, _dead_pid(), time.time())
    with pytest.warns(UserWarning, match="took over"):
        assert manager.load_latest({"model": make_model(1)}) == 1
    assert LeaseOwner.read(file) is not None and LeaseOwner.read(file).process.pid == os.getpid()  # type: ignore[union-attr]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_steps_go_forward_unless_asked(tmp_path: Path) -> None:
    model = make_model(0)
    manager = ckpt.CheckpointManager(tmp_path, keep_last=2)
    for step in (4, 5):
        manager.save(step, {"model": model})
    with pytest.raises(ckpt.OlderStepError) as info:
        manager.save(3, {"model": model})
    assert (info.value.step, info.value.newest) == (3, 5)
    assert "allow_older=True" in str(info.value) and "step 5" in str(info.value)
    with pytest.raises(ckpt.CheckpointExistsError, match="pass overwrite=True"):
        manager.save(5, {"model": model})
    with pytest.raises(ckpt.OlderStepError):
        manager.async_save(2, {"model": model})
    assert manager.steps() == [4, 5]
    # Asked for: saved, and the rotation never deletes what this call committed (step 3
    # is older than both kept steps).
    manager.save(3, {"model": model}, allow_older=True)
    assert manager.steps() == [3, 4, 5]
    manager.save(5, {"model": model}, overwrite=True)  # the newest, asked for
    assert manager.steps() == [4, 5]
