"""Ranks that disagree, peers that die: every rank gets a named error within the timeout.

The ten scenarios of issue 15, each on real ranks over gloo. Each scenario runs
its collectives on a group with a short timeout (:data:`PG_TIMEOUT_S`) and
returns, per rank, the error's type, its first line and the seconds from the
start of the part that goes wrong to the error; the tests assert the message and
that every rank is out within the group's timeout (plus :data:`SLACK_S`). Three
scenarios wait for that timeout (a rank is in a collective its peer never
joins), so this module costs about 3 x PG_TIMEOUT_S plus a few seconds.
A last test runs two plain interpreters (no harness ``os._exit``) to check the
exit code after such a failure: 1 from the traceback, never 134 (SIGABRT).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ckpt
from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
from fsdp import ShardingStrategy
from fsdp.wrap import ModuleWrapPolicy
from tests.fsdp._common import SEQ, VOCAB, Block, Net
from tests.ranks import RankFailure, run_ranks

PG_TIMEOUT_S = 10.0
SLACK_S = 3.0
HARNESS_TIMEOUT_S = 60.0

Outcome = tuple[str, str, float]  # (exception type or "ok", first line, seconds)


def _group() -> Any:
    return dist.new_group(timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))


def _model(group: Any, *, dim: int = 6, n_blocks: int = 3, policy: Any = None, **kw: Any) -> FSDP:
    torch.manual_seed(0)
    policy = policy if policy is not None else ModuleWrapPolicy({Block})
    return FSDP(Net(n_blocks, dim), process_group=group, auto_wrap_policy=policy, **kw)


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _outcome(fn: Any) -> Outcome:
    start = time.monotonic()
    try:
        fn()
    except Exception as e:
        return (type(e).__name__, str(e).splitlines()[0], time.monotonic() - start)
    return ("ok", "", time.monotonic() - start)


def _train(model: FSDP, steps: int) -> None:
    for _ in range(steps):
        model(_batch()).sum().backward()


# --------------------------------------------------------------- disagreements


def _rank_disagree(case: str) -> Outcome:
    group = _group()
    odd = dist.get_rank() == dist.get_world_size() - 1  # the last rank differs
    kw: dict[str, Any] = {}
    if case == "width" and odd:
        kw["dim"] = 8
    if case == "depth" and odd:
        kw["n_blocks"] = 4
    if case == "policy" and odd:
        kw["policy"] = ModuleWrapPolicy({nn.Linear})
    if case in ("SHARD_GRAD_OP", "NO_SHARD") and odd:
        kw["sharding_strategy"] = ShardingStrategy[case]
    if case == "width, sync_module_states":
        kw["sync_module_states"] = True
        kw["dim"] = 8 if odd else 6
    return _outcome(lambda: _train(_model(group, **kw), 2))


@pytest.mark.parametrize(
    ("case", "world_size", "field", "values"),
    [
        ("width", 2, "unit 0 ('<root>')", ("emb.weight (13, 6)", "emb.weight (13, 8)")),
        ("width", 4, "unit 0 ('<root>')", ("emb.weight (13, 6)", "emb.weight (13, 8)")),
        ("depth", 2, "number of FSDP units", ("rank 0: 4", "rank 1: 5")),
        ("policy", 2, "number of FSDP units", ("rank 0: 4", "rank 1: 8")),
        ("SHARD_GRAD_OP", 2, "sharding_strategy", ("FULL_SHARD", "SHARD_GRAD_OP")),
        ("NO_SHARD", 2, "sharding_strategy", ("FULL_SHARD", "NO_SHARD")),
        ("width, sync_module_states", 2, "parameter/buffer 0", ("rank 0: (6,)", "rank 1: (8,)")),
    ],
)
def test_disagreeing_ranks_all_raise_the_same_named_error(
    case: str, world_size: int, field: str, values: tuple[str, str]
) -> None:
    outcomes = run_ranks(_rank_disagree, world_size, case, timeout=HARNESS_TIMEOUT_S)
    kinds = {o[0] for o in outcomes}
    assert kinds == {"RankDisagreementError"}, outcomes
    first = outcomes[0][1]
    assert all(o[1] == first for o in outcomes), "every rank raises the same message"
    prefix = "FullyShardedDataParallel (first forward, lazy initialisation)"
    if "sync" in case:  # the broadcast at construction is checked first
        prefix = "FullyShardedDataParallel(sync_module_states=True) (construction)"
    assert first.startswith(prefix)
    assert f"disagree on {field}" in first
    for value in values:
        assert value in first
    assert f"rank {world_size - 1}:" in first
    assert all(o[2] < 2.0 for o in outcomes), outcomes  # no timeout waited for


# ------------------------------------------------ a rank one step ahead / alone


def _rank_out_of_step(case: str, root: str) -> Outcome:
    group = _group()
    rank = dist.get_rank()
    model = _model(group)
    _train(model, 2)
    path = Path(root) / "ckpt"

    def run() -> None:
        if case == "extra step, then barrier":
            _train(model, 1 if rank == 1 else 0)
            dist.barrier(group=group)
        elif case == "extra step, then save":
            _train(model, 1 if rank == 1 else 0)
            ckpt.save({"model": model}, path, process_group=group)
        elif case == "only rank 0 loads":
            if rank == 0:
                ckpt.load({"model": model}, path, process_group=group)
            else:
                dist.barrier(group=group)

    if case == "only rank 0 loads":
        ckpt.save({"model": model}, path, process_group=group)
    return _outcome(run)


@pytest.mark.slow  # waits for the group's timeout: about PG_TIMEOUT_S
def test_extra_step_then_barrier(tmp_path: Path) -> None:
    out = run_ranks(
        _rank_out_of_step, 2, "extra step, then barrier", str(tmp_path), timeout=HARNESS_TIMEOUT_S
    )
    # rank 0 is in its own barrier: torch's timeout error, raised, not a signal
    assert out[0][0] in ("RuntimeError", "DistBackendError") and "Timed out" in out[0][1]
    assert out[1][0] == "CollectiveError"
    assert out[1][1].startswith("rank 1: all_gather of ")
    assert "for FSDP unit '<root>' failed during forward: " in out[1][1]
    # Rank 1's gather began one step later than rank 0's barrier, so rank 0 times out
    # first; whether rank 1 then times out too or sees rank 0's exit close the
    # connection is a race, and either reason is true.
    why = out[1][1].split("failed during forward: ", 1)[1]
    assert why.startswith(("the other ranks did not join", "a peer rank died or closed")), why
    assert all(o[2] < PG_TIMEOUT_S + SLACK_S for o in out), out


@pytest.mark.slow  # waits for the group's timeout: about PG_TIMEOUT_S
def test_extra_step_then_save(tmp_path: Path) -> None:
    out = run_ranks(
        _rank_out_of_step, 2, "extra step, then save", str(tmp_path), timeout=HARNESS_TIMEOUT_S
    )
    assert out[0][0] == "CheckpointCollectiveError"  # a ckpt.CollectiveError too
    assert out[0][1].startswith("rank 0: all_to_all of the ckpt.save agreement step")
    assert "failed during save" in out[0][1]
    assert out[1][0] == "CollectiveError"
    assert out[1][1].startswith("rank 1: all_gather of ")
    assert "failed during forward" in out[1][1]
    assert all(o[2] < PG_TIMEOUT_S + SLACK_S for o in out), out


@pytest.mark.slow  # waits for the group's timeout: about PG_TIMEOUT_S
def test_only_rank0_loads(tmp_path: Path) -> None:
    out = run_ranks(
        _rank_out_of_step, 2, "only rank 0 loads", str(tmp_path), timeout=HARNESS_TIMEOUT_S
    )
    assert out[0][0] == "CheckpointCollectiveError"  # a ckpt.CollectiveError too
    assert out[0][1].startswith(
        "rank 0: all_to_all of the ckpt.load agreement step (did every rank call it?)"
    )
    assert "failed during load" in out[0][1]
    # rank 1 is in its own barrier: torch's error, raised, not a signal. Whether its timeout
    # fires first or rank 0's exit closes the connection first is a race; both are true.
    assert out[1][0] in ("RuntimeError", "DistBackendError"), out[1]
    assert any(why in out[1][1] for why in ("Timed out", "closed by peer", "reset by peer"))
    assert all(o[2] < PG_TIMEOUT_S + SLACK_S for o in out), out


# ------------------------------------------------------------------- dead peer


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _die_in_backward(module: nn.Module, args: Any, out: torch.Tensor) -> None:
    out.register_hook(lambda grad: _die())


def _rank_dies(where: str, result_file: str) -> Outcome:
    group = _group()
    model = _model(group)
    _train(model, 1)
    if dist.get_rank() == 1:
        block = model.module.blocks[1]  # type: ignore[index, union-attr]
        if where == "forward":
            block.register_forward_pre_hook(lambda *_: _die())
        else:  # when the gradient reaches block 1's output in the backward
            block.register_forward_hook(_die_in_backward)
    out = _outcome(lambda: _train(model, 1))
    Path(result_file).write_text(json.dumps(out))  # rank 0's; RankFailure carries no results
    return out


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_peer_killed(where: str, tmp_path: Path) -> None:
    result = tmp_path / "rank0.txt"
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank_dies, 2, where, str(result), timeout=HARNESS_TIMEOUT_S)
    assert set(info.value.failures) == {1}  # rank 1 died, rank 0 returned its outcome
    assert "killed by signal SIGKILL" in info.value.failures[1]
    kind, first, seconds = json.loads(result.read_text())
    assert kind == "CollectiveError", first
    assert first.startswith("rank 0: ")
    phases = ("forward",) if where == "forward" else ("backward", "post-backward")
    assert any(f"failed during {p}: a peer rank died" in first for p in phases), first
    assert seconds < PG_TIMEOUT_S, seconds  # at once, not at the timeout


# ----------------------------------------------------------- process exit code

_CHILD = textwrap.dedent(
    """
    import datetime, os, sys
    import torch, torch.distributed as dist
    from tests.test_rank_failures import _model, _train
    rank = int(sys.argv[1])
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=3))
    torch.set_num_threads(1)
    model = _model(None)
    _train(model, 1 + rank)  # rank 1 runs one step more
    dist.barrier()
    """
)


@pytest.mark.slow  # two fresh interpreters and a 3 s timeout: about 8 s
def test_exit_code_after_a_failure_is_not_sigabrt(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    rendezvous = str(tmp_path / "rdv")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(r), rendezvous],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [1, 1], (codes, outputs)
    assert "terminate called" not in outputs[0] + outputs[1]
    assert "CollectiveError: rank 1: all_gather of " in outputs[1], outputs[1]
