"""save/load on 1, 2 and 4 gloo ranks with DDP: resume identically, fail identically.

One spawn per world size; every sub-case runs inside it (see tests/ranks.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import ckpt
from tests.ckpt._common import assert_same, make_model, make_optimizer, params, train_step
from tests.ranks import run_ranks


def _expect_error(kind: type[BaseException], fn: Any, *args: Any, **kwargs: Any) -> BaseException:
    try:
        fn(*args, **kwargs)
    except kind as e:
        return e
    raise AssertionError(f"{fn.__name__} did not raise {kind.__name__}")


def _rank_round_trip(root_s: str) -> dict[str, Any]:
    root = Path(root_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(make_model(0))
    optim = make_optimizer(model)
    for step in range(3):
        train_step(model, optim, step, rank)
    mine = f"rank{rank}"  # a rank-unique entry, e.g. a data-loader position
    state = {"model": model, "optim": optim, "step": 3, mine: torch.tensor(float(rank))}

    info = ckpt.save(state, root / "sync")
    handle = ckpt.async_save(state, root / "async")
    # The uninterrupted run, overlapping the async save. [Note: DDP buckets] A fresh DDP
    # wrapper reduces its first step's gradients in one bucket in parameter order, later
    # steps in gradient-ready order; with 4 ranks gloo's ring then sums some elements in
    # another order. The wrapper holds no training state, so the reference re-wraps the
    # same module to reduce exactly as the resumed (freshly wrapped) model will.
    train_step(DDP(model.module), optim, 3, rank)
    expected = params(model)
    assert handle.wait().path == root / "async"

    # 1. Resume from either checkpoint: one more step gives bit-identical weights.
    for name in ("sync", "async"):
        fresh = DDP(make_model(1))
        fresh_optim = make_optimizer(fresh)
        loaded: dict[str, Any] = {
            "model": fresh,
            "optim": fresh_optim,
            "step": 0,
            mine: torch.zeros(()),
        }
        ckpt.load(loaded, root / name)
        assert loaded["step"] == 3 and loaded[mine].item() == rank
        train_step(fresh, fresh_optim, 3, rank)
        assert_same(params(fresh), expected)

    # 2. A plain single-process checkpoint loads into DDP (keys have no "module.").
    plain_model = DDP(make_model(2))
    plain_optim = make_optimizer(plain_model)
    ckpt.load({"model": plain_model, "optim": plain_optim}, root.parent / "plain")
    reference = make_model(42)
    reference_optim = make_optimizer(reference)
    train_step(reference, reference_optim, 0)
    assert_same(params(plain_model), params(reference))
    for got, want in zip(plain_optim.state.values(), reference_optim.state.values(), strict=True):
        assert_same(got, want)

    # 3. A damaged file is reported on every rank, whichever rank hashed it.
    victim = root / "sync" / f"__{world - 1}_0.distcp"
    if rank == 0:
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 3] ^= 0x10
        victim.write_bytes(bytes(raw))
    dist.barrier()
    before = params(fresh)
    err = _expect_error(ckpt.CorruptCheckpointError, ckpt.load, {"model": fresh}, root / "sync")
    assert [p.name for p in err.problems] == [victim.name]  # type: ignore[attr-defined]
    assert_same(params(fresh), before)
    _expect_error(ckpt.CorruptCheckpointError, ckpt.verify, root / "sync")
    ckpt.verify(root / "async")

    # 4. A checkpoint of another model is refused on every rank, nothing loaded.
    other = DDP(torch.nn.Sequential(torch.nn.Linear(6, 5)))
    err = _expect_error(ckpt.StateDictMismatchError, ckpt.load, {"model": other}, root / "async")
    assert err.other_model  # type: ignore[attr-defined]

    # 5. The manager on the dedicated async group, pruning after commit.
    manager = ckpt.CheckpointManager(root / "run", keep_last=2)
    for step in range(1, 4):
        manager.async_save(step, state)
    manager.wait()
    assert manager.steps() == [2, 3]
    assert manager.load_latest({"model": fresh}) == 3

    assert info.manifest is not None
    return {
        "files": sorted(f.name for f in info.manifest.files),
        "world_size": info.manifest.world_size,
        "expected": expected if rank == 0 else None,
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ddp_round_trip(tmp_path: Path, world_size: int) -> None:
    plain = make_model(42)
    plain_optim = make_optimizer(plain)
    train_step(plain, plain_optim, 0)
    ckpt.save({"model": plain, "optim": plain_optim}, tmp_path / "plain")

    results = run_ranks(_rank_round_trip, world_size, str(tmp_path / "ranks"), timeout=120)

    first = results[0]
    assert all(r["files"] == first["files"] for r in results)
    assert first["world_size"] == world_size
    # Every rank wrote a data file of its own (the plan spreads replicated tensors).
    ranks_files = [f"__{r}_0.distcp" for r in range(world_size)]
    assert first["files"] == [".metadata", *ranks_files, "ckpt-index.bin"]

    # The DDP checkpoint loads into a plain model in this process, and on resumes.
    model = make_model(7)
    optim = make_optimizer(model)
    ckpt.load({"model": model, "optim": optim}, tmp_path / "ranks" / "async", verify=True)
    if world_size == 1:
        train_step(model, optim, 3)
        assert_same(params(model), first["expected"])


# ------------------------------------------------- the adapter protocol, resharded
# What fsdp (DTensor shards) and zero_optim (each rank holds the state of the
# parameters it owns, under rank-unique keys) will hand to ckpt, saved on 2 ranks
# and loaded on 4.

_FULL = torch.arange(48.0).reshape(12, 4)


def _sharded_state(fill: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    full = _FULL if fill else torch.zeros_like(_FULL)
    owned = {f"p{i}": torch.full((3,), float(i) if fill else -1.0) for i in range(8)}
    return {
        "model": {"w": distribute_tensor(full, mesh, [Shard(0)])},
        "optim": {k: v for i, (k, v) in enumerate(owned.items()) if i % world == rank},
    }


def _rank_save_sharded(path: str) -> list[str]:
    info = ckpt.save(_sharded_state(fill=True), path)
    assert info.manifest is not None
    return [f.name for f in info.manifest.files]


def _rank_load_sharded(path: str) -> None:
    state = _sharded_state(fill=False)
    ckpt.load(state, path)
    assert torch.equal(state["model"]["w"].full_tensor(), _FULL)
    for key, value in state["optim"].items():
        assert torch.equal(value, torch.full((3,), float(key[1:]))), key

    # Keys no rank asks for are unexpected; those some rank asks for are not.
    state = _sharded_state(fill=False)
    state["optim"].pop("p7", None)  # on 4 ranks, rank 3 owns p3 and p7: now no one has p7
    err = _expect_error(ckpt.StateDictMismatchError, ckpt.load, state, path)
    assert err.unexpected == ("optim.p7",) and err.missing == ()  # type: ignore[attr-defined]


def test_sharded_and_rank_unique_state_reshards_from_2_to_4_ranks(tmp_path: Path) -> None:
    files = run_ranks(_rank_save_sharded, 2, str(tmp_path / "c"))[0]
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "ckpt-index.bin"]
    run_ranks(_rank_load_sharded, 4, str(tmp_path / "c"))
