"""``async_save`` blocks training only for a copy: training runs while the save is still
working, and the checkpoint holds the state of the step it was taken at, bit for bit.

For each wrapper (our FSDP1 with either ``use_orig_params``, ``fully_shard``, DDP +
zero_optim, a plain module), on 2 gloo ranks: train 3 steps, take a reference copy of
the full parameters and optimizer state, ``async_save``, then train 3 more steps while
the background part of the save is held inside DCP's write step by an event the test
controls (so the order is forced, not timed). Rank 0 releases its save before it trains,
so its background thread goes on into DCP's next collective (the gather of the write
results) and waits there for rank 1, whose save is still held while rank 1 trains: the
training collectives on the training group and the save's on the checkpoint group run
at the same time and must not meet. Then rank 1 releases, the save commits, and the
checkpoint, loaded into a freshly built model and optimizer, must equal the reference
exactly (and the live state must by then differ from it, or the test would prove
nothing). A second save of the same model must copy into the same host buffers as the
first, and a save whose state cannot be captured fails on every rank at ``wait()``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import ckpt
from tests.ckpt._wrappers import LR, full_weights, train
from tests.ckpt._wrappers import wrap as wrap_kind
from tests.fsdp._common import make_net
from tests.ranks import run_ranks

KINDS = ("fsdp", "fsdp-orig", "fully_shard", "ddp-zero", "plain")
GATE_S = 120.0  # how long a held save waits for the test before it gives up (never, if ok)


def _wrap(kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    if kind == "plain":  # the same module on every rank, trained on the same batches
        net = make_net(seed)
        return net, torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
    return wrap_kind(kind, seed)


def _copy_of(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Full parameters and full FQN-keyed optimizer state (collectives), copied."""
    # Not offloaded: torch's full offloaded state (fully_shard) is on rank 0 only.
    state = ckpt.optim_state_dict(model, optim, full=True, offload_to_cpu=False)
    return {
        "params": full_weights(model),
        "optim": {
            name: {k: v.clone() if isinstance(v, Tensor) else v for k, v in entry.items()}
            for name, entry in state["state"].items()
        },
    }


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["params"].keys() != b["params"].keys() or a["optim"].keys() != b["optim"].keys():
        return False
    if not all(torch.equal(v, b["params"][k]) for k, v in a["params"].items()):
        return False
    for name, entry in a["optim"].items():
        other = b["optim"][name]
        if entry.keys() != other.keys():
            return False
        for key, value in entry.items():
            same = (
                torch.equal(value, other[key]) if isinstance(value, Tensor) else value == other[key]
            )
            if not same:
                return False
    return True


class _Hold:
    """Holds every background save inside its write until ``release()``."""

    def __init__(self) -> None:
        from ckpt._commit import save_load

        self._module = save_load
        self._original = save_load.write_data_file
        self.reached = threading.Event()
        self._gate = threading.Event()
        original, reached, gate = self._original, self.reached, self._gate

        def held(*args: Any) -> Any:
            reached.set()
            if not gate.wait(GATE_S):
                raise RuntimeError("the test never released the held save")
            return original(*args)

        save_load.write_data_file = held  # type: ignore[assignment]

    def release(self) -> None:
        self._gate.set()

    def undo(self) -> None:
        self._gate.set()
        self._module.write_data_file = self._original  # type: ignore[assignment]


def _staged_pointers() -> tuple[list[set[int]], Any]:
    """Record the data pointers of every tensor each ``stage`` call returns."""
    from ckpt._commit import save_load

    seen: list[set[int]] = []
    original = save_load.stage

    def recording(state_dict: dict[str, Any]) -> Any:
        staged = original(state_dict)
        pointers: set[int] = set()

        def visit(value: Any) -> None:
            if isinstance(value, dict):
                for v in value.values():
                    visit(v)
            elif hasattr(value, "to_local"):
                pointers.add(value.to_local().data_ptr())
            elif isinstance(value, Tensor):
                pointers.add(value.data_ptr())
            elif hasattr(value, "local"):  # FlatPieces
                pointers.add(value.local.data_ptr())

        visit(staged.state_dict())
        seen.append(pointers)
        return staged

    save_load.stage = recording  # type: ignore[assignment]
    return seen, lambda: setattr(save_load, "stage", original)


def _rank_snapshot(root: str) -> dict[str, str]:
    rank = dist.get_rank()
    out: dict[str, str] = {}
    for kind in KINDS:
        model, optim = _wrap(kind, seed=0)
        train(model, optim, 0, 3)
        reference = _copy_of(model, optim)
        path = Path(root) / kind
        hold = _Hold()
        try:
            handle = ckpt.async_save({"model": model, "optim": optim, "step": 3}, path)
            # The save returned; its background part is now inside DCP's write step.
            assert hold.reached.wait(GATE_S), "the background save never reached its write"
            if rank == 0:
                hold.release()  # rank 0's save goes on and waits for rank 1 in a collective
            train(model, optim, 3, 6)  # training collectives meanwhile
            assert not handle.done(), "the save finished while rank 1's was still held"
            changed = not _equal(_copy_of(model, optim), reference)
            hold.release()
            info = handle.wait()
        finally:
            hold.undo()
        fresh, fresh_optim = _wrap(kind, seed=9)
        state: dict[str, Any] = {"model": fresh, "optim": fresh_optim, "step": 0}
        ckpt.load(state, info.path)
        exact = state["step"] == 3 and _equal(_copy_of(fresh, fresh_optim), reference)
        out[kind] = "ok" if exact and changed else f"exact={exact} changed={changed}"
    # The buffers are reused: a second save of the same model copies into the first's.
    model, optim = _wrap("fsdp", seed=0)
    train(model, optim, 0, 2)
    seen, undo = _staged_pointers()
    try:
        for name in ("reuse-a", "reuse-b"):
            ckpt.async_save({"model": model, "optim": optim}, Path(root) / name).wait()
            train(model, optim, 2, 3)
    finally:
        undo()
    out["reuse"] = "ok" if seen[0] and seen[0] == seen[1] else f"{len(seen[0])} vs {seen}"
    return out


def test_async_save_blocks_only_for_a_copy_and_holds_its_step(tmp_path: Path) -> None:
    for result in run_ranks(_rank_snapshot, 2, str(tmp_path), timeout=300):
        assert result == dict.fromkeys([*KINDS, "reuse"], "ok"), result


def _rank_odd_state(root: str, how: str) -> str:
    """A state one rank cannot capture fails the save on every rank (async: at wait())."""
    model, optim = wrap_kind("fsdp-orig", 0)
    train(model, optim, 0, 1)
    p = next(p for p in optim.param_groups[0]["params"] if p.numel() > 2)
    if dist.get_rank() == 1:
        optim.state[p]["row"] = torch.zeros(p.numel() + 1)  # a factored moment, say
    state = {"model": model, "optim": optim}
    try:
        if how == "async":
            ckpt.async_save(state, Path(root) / "odd").wait()
        else:
            ckpt.save(state, Path(root) / "odd")
    except ckpt.CheckpointError as e:
        message = str(e)
        named = "rank 1" in message and "'row'" in message and "not other shapes" in message
        return "ok" if named else message
    finally:
        optim.state[p].pop("row", None)
    return "did not raise"


@pytest.mark.parametrize("how", ["sync", "async"])
def test_uncapturable_state_fails_on_every_rank(tmp_path: Path, how: str) -> None:
    assert run_ranks(_rank_odd_state, 2, str(tmp_path), how, timeout=120) == ["ok", "ok"]
    assert not (tmp_path / "odd").exists()
    assert not list(tmp_path.glob(".odd*"))  # no partial directory, no lease
