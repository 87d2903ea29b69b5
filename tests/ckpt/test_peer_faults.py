"""A peer stopped (SIGSTOP) or killed (SIGKILL) inside a save, an async save or a load.

Issue 33: such a peer ended rank 0 with gloo's bare "Timed out waiting ... for send
operation" from DCP's ``gather_object``. Now rank 0 raises a
``ckpt.CheckpointCollectiveError`` (a ``CheckpointError``) naming the step (writing,
reading), rank 1 as the rank that did not arrive (stopped or dead), and the fix; the
checkpoint committed before stays whole and loadable and the failed save's partial
directory and lease are gone.

Rank 1 stops or kills itself at a point chosen without timing: when DCP asks ckpt's
writer to write its files (save, async save) or ckpt's reader to read (load). The
checkpoint's group has a short timeout (:data:`PG_TIMEOUT_S`), so a stopped peer
costs that long; rank 0 then kills it (the harness reports rank 1 as killed) and
leaves its findings in a file, as ``tests/test_rank_failures.py`` does.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import ckpt
from ckpt._commit import save_load
from ckpt._format import layout
from tests.fsdp._common import Block, make_net
from tests.ranks import RankFailure, run_ranks

PG_TIMEOUT_S = 4.0
HARNESS_TIMEOUT_S = 60.0


def _build(front: str, group: Any) -> torch.nn.Module:
    net = make_net(0)
    if front == "fully_shard":
        from fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, "cpu")
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
    from fsdp.wrap import ModuleWrapPolicy

    return FSDP(net, process_group=group, auto_wrap_policy=ModuleWrapPolicy({Block}))


def _fault(how: str) -> None:
    os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)


def _rank_fault(front: str, op: str, how: str, root: str, result_file: str) -> None:
    group = dist.new_group(timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    rank = dist.get_rank()
    model = _build(front, group)
    manager = ckpt.CheckpointManager(root, keep_last=1, process_group=group)
    manager.save(1, {"model": model})
    pids: list[Any] = [None, None]
    dist.all_gather_object(pids, os.getpid(), group=group)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # a damaged step 1 would show
    if rank == 1:
        if op == "load":
            read = save_load.read_chunks
            save_load.read_chunks = lambda *a: (_fault(how), read(*a))[1]  # type: ignore[assignment]
        else:
            write = save_load.write_data_file
            save_load.write_data_file = lambda *a: (_fault(how), write(*a))[1]  # type: ignore[assignment]
    state = {"model": model}
    start = time.monotonic()
    error: BaseException | None = None
    try:
        if op == "save":
            manager.save(2, state)
        elif op == "async_save":
            manager.async_save(2, state)  # returns: the fault comes in the background
            manager.save(3, state)  # the next save surfaces it
        else:
            manager.load(state, step=1)
    except Exception as e:
        error = e
    seconds = time.monotonic() - start
    if how == "stop":
        os.kill(pids[1], signal.SIGKILL)  # end the stopped peer: the test is over
    found = {
        "type": type(error).__name__,
        "is_checkpoint_error": isinstance(error, ckpt.CheckpointError),
        "is_collective_error": isinstance(error, ckpt.CollectiveError),
        "message": str(error),
        "step": getattr(error, "step", None),
        "missing": list(getattr(error, "missing_ranks", ())),
        "seconds": seconds,
        "left": sorted(p.name for p in Path(root).iterdir()),
    }
    Path(result_file).write_text(json.dumps(found))


@pytest.mark.parametrize("front", ["fsdp", "fully_shard"])
@pytest.mark.parametrize("op", ["save", "async_save", "load"])
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_peer_fault_is_named_and_the_previous_checkpoint_stays(
    tmp_path: Path, front: str, op: str, how: str
) -> None:
    root, result = tmp_path / "run", tmp_path / "rank0.json"
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank_fault, 2, front, op, how, str(root), str(result), timeout=HARNESS_TIMEOUT_S)
    assert set(info.value.failures) == {1}, info.value  # rank 1 was killed, rank 0 returned
    assert "killed by signal SIGKILL" in info.value.failures[1]
    found = json.loads(result.read_text())
    message = found["message"]
    assert found["type"] == "CheckpointCollectiveError", message
    assert found["is_checkpoint_error"] and found["is_collective_error"]
    step = "reading" if op == "load" else "writing"
    assert found["step"] == step, message
    assert found["missing"] == [1], message
    call = {"save": "save", "async_save": "async save", "load": "load"}[op]
    assert message.startswith("rank 0: "), message
    assert f"failed during {call} ({step}): rank 1 " in message, message
    if how == "stop":
        assert "rank 1 is stopped" in message and "kill -CONT" in message, message
        assert found["seconds"] < PG_TIMEOUT_S + 10, found["seconds"]
    else:
        assert "rank 1 died" in message and "rank 1's output" in message, message
        assert found["seconds"] < PG_TIMEOUT_S, found["seconds"]  # at once, not at the timeout
    assert "Fix: " in message and "Backend error: " in message
    if op == "load":
        assert "load it again before training" in message
    else:
        assert "Nothing of this save was committed" in message
        assert "partial directory was removed" in message
    # Only step 1 is left: no partial directory, no save's lease, no step 2 (and the
    # job's own hold on the folder, as its manager is alive).
    assert found["left"] == [".ckpt-job.lease", "step_00000001"], found["left"]

    manifest = ckpt.verify(root / "step_00000001")
    assert manifest.world_size == 2
    fresh = make_net(5)
    ckpt.load({"model": fresh}, root / "step_00000001")
    expected = make_net(0).state_dict()
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[name]), name


def _rank_coordinator_dies_in_commit(root: str, result_file: str) -> None:
    group = dist.new_group(timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    model = _build("fsdp", group)
    manager = ckpt.CheckpointManager(root, keep_last=1, process_group=group)
    manager.save(1, {"model": model})
    if dist.get_rank() == 0:
        layout.commit = lambda *a: _fault("kill")  # type: ignore[assignment]
    try:
        manager.save(2, {"model": model})
    except ckpt.CheckpointError as e:
        found = {"type": type(e).__name__, "message": str(e), "step": getattr(e, "step", None)}
        found["missing"] = list(getattr(e, "missing_ranks", ()))
        Path(result_file).write_text(json.dumps(found))


def test_coordinator_killed_in_commit(tmp_path: Path) -> None:
    """Rank 1 waits for rank 0's commit, which never comes: named as the commit step;
    the dead save's lease and partial directory go at the next save."""
    root, result = tmp_path / "run", tmp_path / "rank1.json"
    with pytest.raises(RankFailure) as info:
        run_ranks(
            _rank_coordinator_dies_in_commit, 2, str(root), str(result), timeout=HARNESS_TIMEOUT_S
        )
    assert set(info.value.failures) == {0}, info.value
    found = json.loads(result.read_text())
    message = found["message"]
    assert found["type"] == "CheckpointCollectiveError", message
    assert found["step"] == "commit" and found["missing"] == [0], message
    assert "failed during save (the commit): rank 0 died" in message, message
    assert "rank 0 removes the partial directory (or the next save does)" in message
    manager = ckpt.CheckpointManager(root, keep_last=1)
    assert manager.steps() == [1] and len(manager.partial()) == 1
    with pytest.warns(UserWarning) as warned:
        manager.save(2, {"model": make_net(0)})
    said = "\n".join(str(w.message) for w in warned)
    assert "recovered the lease" in said and ".step_00000002." in said, said
    assert "took over" in said, said  # the dead rank 0's hold on the folder
    manager.close()
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]
