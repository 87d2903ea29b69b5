"""Snapshots in host memory, replicated on another machine, resumed after a loss.

Machines are simulated inside one host: each "machine" has a folder of its own that
stands for its ``/dev/shm`` (``root=``) and a name (``machine=``); losing a machine
removes its folder. The ranks of a later ``run_ranks`` call are the restarted job:
they share the launcher (the test's forkserver) with the earlier ranks, as workers
restarted by torchrun share its agent, so they find the snapshots.

Every rank trains on the same batch at each step (``tests/ckpt/_wrappers``), so runs
at different world sizes are bit-identical, and a resumed run can be compared with
``==``: to the same step's disk checkpoint loaded at the same new world size, and to
the uninterrupted run.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ckpt
from ckpt._memory.placement import Held, Holding, choose, partners
from tests.ckpt._wrappers import full_weights, same, train, wrap
from tests.ranks import RankFailure, run_ranks

KINDS = ("fsdp", "fully_shard", "ddp-zero")
SNAPSHOTS = 3  # steps 1..3 snapshotted (and step 3 on disk); 4..5 trained after resuming


def _tier(tmp: str, kind: str, machines: list[str], run_id: str = "job") -> ckpt.MemorySnapshots:
    machine = machines[dist.get_rank()]
    disk = ckpt.CheckpointManager(f"{tmp}/{kind}/disk")
    return ckpt.MemorySnapshots(
        disk, root=f"{tmp}/{kind}/{machine}", machine=machine, run_id=run_id
    )


def _make_roots(tmp: Path, machines: list[str]) -> None:
    for kind in KINDS:
        for m in set(machines):
            (tmp / kind / m).mkdir(parents=True, exist_ok=True)


def _first_run(
    tmp: str,
    machines: list[str],
    die: dict[int, int] | None = None,
    kinds: tuple[str, ...] = KINDS,
) -> dict[str, Any]:
    """Train SNAPSHOTS steps with a snapshot after each (and step 3 on disk); the
    uninterrupted run's losses and weights of steps 4..5 too. ``die``: rank -> step at
    whose replication that rank's process exits (its machine lost mid-snapshot)."""
    out: dict[str, Any] = {}
    for kind in kinds:
        model, optim = wrap(kind)
        state = {"model": model, "optim": optim}
        memory = _tier(tmp, kind, machines)
        for i in range(SNAPSHOTS):
            train(model, optim, i, i + 1)
            if die is not None and die.get(dist.get_rank()) == i + 1:
                _exit_in_replication()
            memory.save(i + 1, state)
            if i + 1 == SNAPSHOTS - 1 and die is not None:
                torch.save(full_weights(model), f"{tmp}/{kind}/weights_{i + 1}.pt")
        memory.wait()
        memory.disk.save(SNAPSHOTS, state)
        losses = train(model, optim, SNAPSHOTS, SNAPSHOTS + 2)
        out[kind] = {"losses": losses, "weights": full_weights(model), "partner": memory.partner}
        memory.close()
    return out


def _exit_in_replication() -> None:
    """This process ends as its machine would, once its own copy of the next snapshot is
    committed and before any replica of it is sent or received."""
    from ckpt._memory.replication import Replication

    def exit_now(self: Replication) -> None:
        os._exit(17)

    Replication._exchange = exit_now  # type: ignore[method-assign]


def _resume(tmp: str, machines: list[str]) -> dict[str, Any]:
    """The restarted job: from memory (load_latest), and again from the disk
    checkpoint of the same step; each trains the next two steps."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        model, optim = wrap(kind, seed=1)  # other initial weights: the load must replace them
        memory = _tier(tmp, kind, machines)
        step = memory.load_latest({"model": model, "optim": optim})
        assert memory.resumed is not None
        loaded = full_weights(model)
        losses = train(model, optim, SNAPSHOTS, SNAPSHOTS + 2)
        disk_model, disk_optim = wrap(kind, seed=2)
        memory.disk.load({"model": disk_model, "optim": disk_optim}, SNAPSHOTS)
        disk_losses = train(disk_model, disk_optim, SNAPSHOTS, SNAPSHOTS + 2)
        out[kind] = {
            "step": step,
            "resumed": memory.resumed,
            "loaded": loaded,
            "losses": losses,
            "weights": full_weights(model),
            "disk_losses": disk_losses,
            "disk_weights": full_weights(disk_model),
        }
        memory.close()
    return out


@pytest.mark.parametrize(
    ("before", "after", "line"),
    [
        # a worker restarted on the same machines: nothing lost, every shard at home
        (["A", "B"], ["A", "B"], "resumed step 3 from memory (2 ranks)"),
        # machine B lost: its rank's shard comes from the replica on A
        (["A", "B"], ["A"], "resumed step 3 from memory (2 ranks -> 1, 1 shard from a replica)"),
        (
            ["A", "A", "B", "B"],
            ["A", "A"],
            "resumed step 3 from memory (4 ranks -> 2, 2 shards from a replica)",
        ),
    ],
    ids=["2-restart", "2-to-1", "4-to-2"],
)
def test_memory_resume_equals_the_disk_resume_of_the_same_step(
    tmp_path: Path, before: list[str], after: list[str], line: str
) -> None:
    _make_roots(tmp_path, before)
    first = run_ranks(_first_run, len(before), str(tmp_path), before, timeout=120)
    for lost in set(before) - set(after):
        for kind in KINDS:
            shutil.rmtree(tmp_path / kind / lost)
    resumed = run_ranks(_resume, len(after), str(tmp_path), after, timeout=120)
    for kind in KINDS:
        want = first[0][kind]
        for rank, per_kind in enumerate(resumed):
            r = per_kind[kind]
            assert r["step"] == SNAPSHOTS and r["resumed"].source == "memory", (kind, r)
            assert r["resumed"].line == line, (kind, rank, r["resumed"].line)
            assert r["losses"] == r["disk_losses"] == want["losses"], (kind, rank, r, want)
            assert same(r["weights"], r["disk_weights"]), (kind, rank)
            assert same(r["weights"], want["weights"]), (kind, rank)
            assert not same(r["loaded"], r["weights"])  # the steps after it trained


@pytest.mark.parametrize("kind", KINDS)
def test_a_machine_lost_mid_snapshot_resumes_the_previous_step(tmp_path: Path, kind: str) -> None:
    machines = ["A", "A", "B", "B"]
    _make_roots(tmp_path, machines)
    # Machine B's ranks commit their own copy of step 3 and die before replicating it.
    die = {2: SNAPSHOTS, 3: SNAPSHOTS}
    with pytest.raises(RankFailure, match="exit"):
        run_ranks(_first_run, 4, str(tmp_path), machines, die, (kind,), timeout=60)
    shutil.rmtree(tmp_path / kind / "B")
    resumed = run_ranks(_resume_previous, 2, str(tmp_path), ["A", "A"], (kind,), timeout=120)
    want = torch.load(tmp_path / kind / f"weights_{SNAPSHOTS - 1}.pt")
    for r in resumed:
        assert r[kind]["step"] == SNAPSHOTS - 1, r[kind]
        assert r[kind]["line"] == (
            "resumed step 2 from memory (4 ranks -> 2, 2 shards from a replica)"
        )
        assert same(r[kind]["loaded"], want)


def _resume_previous(tmp: str, machines: list[str], kinds: tuple[str, ...]) -> dict[str, Any]:
    out = {}
    for kind in kinds:
        model, optim = wrap(kind, seed=1)
        memory = _tier(tmp, kind, machines)
        step = memory.load_latest({"model": model, "optim": optim})
        assert memory.resumed is not None
        out[kind] = {"step": step, "line": memory.resumed.line, "loaded": full_weights(model)}
    return out


def _three_machines(tmp: str, machines: list[str]) -> dict[str, Any]:
    kind = KINDS[0]
    model, optim = wrap(kind)
    state = {"model": model, "optim": optim}
    memory = _tier(tmp, kind, machines)
    for i in range(SNAPSHOTS):
        train(model, optim, i, i + 1)
        memory.save(i + 1, state)
        if i + 1 == SNAPSHOTS - 1:
            memory.disk.save(i + 1, state)
            weights = full_weights(model)
    memory.close()
    return {"weights": weights, "partner": memory.partner}


def test_two_machines_lost_with_both_copies_falls_back_to_disk(tmp_path: Path) -> None:
    machines = ["A", "B", "C"]
    (tmp_path / KINDS[0]).mkdir()
    for m in machines:
        (tmp_path / KINDS[0] / m).mkdir()
    first = run_ranks(_three_machines, 3, str(tmp_path), machines, timeout=120)
    assert [r["partner"] for r in first] == [1, 2, 0]  # each on the next machine
    for lost in ("B", "C"):  # rank 1's own copy (B) and its replica (C)
        shutil.rmtree(tmp_path / KINDS[0] / lost)
    (r,) = run_ranks(_resume_previous, 1, str(tmp_path), ["A"], KINDS[:1], timeout=120)
    assert r[KINDS[0]]["step"] == SNAPSHOTS - 1
    assert r[KINDS[0]]["line"] == (
        "resumed step 2 from disk: memory lost the snapshot of step 3 (no copy of rank 1 of "
        "3 survives: their machine and the one holding their replica are gone)"
    )
    assert same(r[KINDS[0]]["loaded"], first[0]["weights"])


def _stale(tmp: str, machines: list[str], run_id: str) -> dict[str, Any]:
    kind = KINDS[0]
    model, optim = wrap(kind, seed=1)
    memory = _tier(tmp, kind, machines, run_id=run_id)
    step = memory.load_latest({"model": model, "optim": optim})
    assert memory.resumed is not None
    return {"step": step, "source": memory.resumed.source, "line": memory.resumed.line}


def test_snapshots_of_an_earlier_job_are_never_taken_for_this_ones(tmp_path: Path) -> None:
    machines = ["A", "B"]
    (tmp_path / KINDS[0]).mkdir()
    for m in machines:
        (tmp_path / KINDS[0] / m).mkdir()
    run_ranks(_three_machines, 2, str(tmp_path), machines, timeout=120)  # steps 1..3, disk 2
    # Another job (run id) with the same checkpoint folder sees none of them.
    for r in run_ranks(_stale, 2, str(tmp_path), machines, "another-job", timeout=120):
        assert r == {"step": 2, "source": "disk", "line": "resumed step 2 from disk (memory "
                     "holds no snapshot)"}  # fmt: skip
    # The same run id under an earlier launcher of this host whose process is gone (on
    # machine A), or under a launcher of another host (B: a shared folder, where
    # liveness cannot be known): never read; A's is removed.
    dead = {"A": f"{socket.gethostname()}-999999999-1", "B": "otherhost-1-1"}
    for m in machines:
        job = next((tmp_path / KINDS[0] / m / "ckpt-snapshots").iterdir())
        agent = next(p for p in job.iterdir() if p.is_dir())
        agent.rename(job / dead[m])
    for r in run_ranks(_stale, 2, str(tmp_path), machines, "job", timeout=120):
        assert r["source"] == "disk" and r["step"] == 2, r
    for m in machines:
        job = next((tmp_path / KINDS[0] / m / "ckpt-snapshots").iterdir())
        assert (job / dead[m]).exists() == (m == "B")


# ---- the placement, alone


def test_partners_are_on_the_next_machine() -> None:
    assert partners(["a", "a"]) == [None, None]
    assert partners(["a", "b"]) == [1, 0]
    assert partners(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert partners(["a", "b", "a", "b"]) == [1, 0, 3, 2]
    assert partners(["a", "a", "a", "b"]) == [3, 3, 3, 0]  # an uneven cluster
    assert partners(["a", "b", "c"]) == [1, 2, 0]


def _held(step: int, rank: int, world: int = 2, replica: bool = False, gen: str = "g") -> Held:
    return Held(gen, step, rank, world, float(step), replica)


def test_choose_takes_the_newest_step_of_which_every_shard_survives() -> None:
    a = Holding("a", (_held(4, 0), _held(5, 0), _held(4, 1, replica=True)))
    choice, missing = choose([a])
    assert choice is not None and (choice.step, choice.server, choice.from_replica) == (
        4, (0, 0), 1,
    )  # fmt: skip
    assert missing is not None and (missing.step, missing.lost) == (5, (1,))
    # Two survivors holding the same shard share the serving.
    b = Holding("a", a.held)
    choice, _ = choose([a, b])
    assert choice is not None and choice.server == (0, 1)
    assert choose([Holding("a", ())]) == (None, None)
    # The same step in two incarnations: the later one.
    old, new = _held(4, 0, world=1, gen="old"), Held("new", 4, 0, 1, 99.0, False)
    choice, _ = choose([Holding("a", (old, new))])
    assert choice is not None and choice.generation == "new"
