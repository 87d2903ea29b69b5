"""Model and optimizer state dicts of an fsdp model, per type and config, on 1/2/4 ranks.

Each sub-case takes a state dict (model and optimizer) after 3 steps, loads it into a
fresh model with other weights, trains one more step and compares the loss and the
weights with the uninterrupted run: they must be identical. One spawn per world size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import ckpt
from ckpt import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from tests.ckpt._wrappers import full_weights, same, step, train, wrap
from tests.fsdp._common import make_net
from tests.ranks import run_ranks

FULL, SHARDED, LOCAL = (
    StateDictType.FULL_STATE_DICT,
    StateDictType.SHARDED_STATE_DICT,
    StateDictType.LOCAL_STATE_DICT,
)

# (name, type, model config, optimizer config)
CASES: list[tuple[str, StateDictType, Any, Any]] = [
    ("full", FULL, FullStateDictConfig(), FullOptimStateDictConfig()),
    ("full-offload", FULL, FullStateDictConfig(offload_to_cpu=True), FullOptimStateDictConfig()),
    (
        "full-rank0-offload",
        FULL,
        FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True),
    ),
    ("sharded", SHARDED, ShardedStateDictConfig(), ShardedOptimStateDictConfig(False)),
    (
        "sharded-offload",
        SHARDED,
        ShardedStateDictConfig(offload_to_cpu=True),
        ShardedOptimStateDictConfig(),
    ),
    ("local", LOCAL, LocalStateDictConfig(), LocalOptimStateDictConfig()),
    (
        "local-offload",
        LOCAL,
        LocalStateDictConfig(offload_to_cpu=True),
        LocalOptimStateDictConfig(offload_to_cpu=True),
    ),
]


def _check_form(name: str, sd_type: StateDictType, sd: dict[str, Any], rank0_only: bool) -> None:
    """The documented form of each type."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from ckpt._wrappers.sharded_chunks import chunk_bounds

    reference = make_net().state_dict()
    rank, world = dist.get_rank(), dist.get_world_size()
    if sd_type is FULL:
        if rank0_only and rank != 0:
            assert sd == {}, (name, sorted(sd))
            return
        assert list(sd) == list(reference) or sorted(sd) == sorted(reference), name
        for key, value in reference.items():
            assert type(sd[key]) is Tensor and sd[key].shape == value.shape, (name, key)
    elif sd_type is SHARDED:
        assert sorted(sd) == sorted(reference), name
        for key, value in reference.items():
            got = sd[key]
            if key == "scale":  # a buffer stays a plain tensor
                assert type(got) is Tensor
                continue
            assert isinstance(got, DTensor), (name, key)
            assert got.shape == value.shape, (name, key)
            if value.dim() == 0:
                assert got.placements == (Replicate(),)
            else:
                assert got.placements == (Shard(0),)
                lo, hi = chunk_bounds(value.shape[0], world, rank)
                assert got.to_local().shape[0] == hi - lo, (name, key)
    else:
        flats = sorted(k for k in sd if k.endswith("_flat_param"))
        assert flats == [
            "_flat_param",
            "blocks.0._flat_param",
            "blocks.1._flat_param",
            "blocks.2._flat_param",
        ], flats
        for key in flats:
            assert isinstance(sd[key], DTensor if world > 1 else Tensor), key


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _rank_types() -> dict[str, Any]:
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    rank = dist.get_rank()
    model, optim = wrap("fsdp")
    train(model, optim, 0, 3)
    snapshots = {}
    for name, sd_type, config, optim_config in CASES:
        with FSDP.state_dict_type(model, sd_type, config, optim_config):
            assert FSDP.get_state_dict_type(model).state_dict_type is sd_type
            sd = model.state_dict()
            osd = FSDP.optim_state_dict(model, optim)
        rank0_only = bool(getattr(config, "rank0_only", False))
        _check_form(name, sd_type, sd, rank0_only)
        if rank0_only:
            assert (osd == {}) == (rank != 0), name
        snapshots[name] = (sd, osd)
    # Settings are restored after the context.
    assert FSDP.get_state_dict_type(model).state_dict_type is FULL
    # The uninterrupted run.
    expected_loss = step(model, optim, 3)
    expected = full_weights(model)
    results = {}
    for name, sd_type, config, optim_config in CASES:
        sd, osd = snapshots[name]
        if getattr(config, "rank0_only", False):
            sd, osd = _broadcast(sd), _broadcast(osd)  # loading needs it on every rank
        fresh, fresh_optim = wrap("fsdp", seed=9)
        with ckpt.state_dict_type(fresh, sd_type, config, optim_config):
            result = fresh.load_state_dict(sd)
            assert not result.missing_keys and not result.unexpected_keys, (name, result)
            to_load = FSDP.optim_state_dict_to_load(fresh, fresh_optim, osd)
        fresh_optim.load_state_dict(to_load)
        loss = step(fresh, fresh_optim, 3)
        results[name] = loss == expected_loss and same(full_weights(fresh), expected)
    return results


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_type_resumes_identically(world_size: int) -> None:
    for results in run_ranks(_rank_types, world_size, timeout=180):
        assert results == {name: True for name, *_ in CASES}


# ----------------------------------------------------------- FULL rank0_only memory


def _rank_full_rank0_bytes() -> dict[str, Any]:
    """What a FULL rank0_only + offload_to_cpu state_dict allocates to communicate: on
    rank 0 one receive buffer of one shard per peer and unit, nothing elsewhere, and no
    unit all-gathered anywhere (the bench measures the resident memory this saves)."""
    import ckpt._wrappers.fsdp1_model as model_state
    import ckpt._wrappers.fsdp1_unit_exchange as exchange
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    model, _ = wrap("fsdp")
    units = [s.unit for s in (m._fsdp_state for m in FSDP.fsdp_modules(model)) if s.unit]
    largest = max(u.layout.full_numel * 4 for u in units)
    total = sum(u.layout.full_numel * 4 for u in units)
    shards = [u.layout.shard_numel * 4 for u in units]
    live: dict[str, Any] = {"buffers": [], "calls": 0, "all_gathers": 0}
    gather_on_rank0, recv_buffer = model_state.gather_params_on_rank0, exchange._recv_buffer
    all_gather = model_state.gather_flat

    def counting_calls(*args: Any) -> Any:
        live["calls"] += 1
        return gather_on_rank0(*args)

    def counting_buffer(numel: int, like: Tensor) -> Tensor:
        buf = recv_buffer(numel, like)
        live["buffers"].append(buf.numel() * buf.element_size())
        return buf

    def counting_all_gathers(unit: Any, shard: Tensor) -> Tensor:
        live["all_gathers"] += 1
        return all_gather(unit, shard)

    model_state.gather_params_on_rank0 = counting_calls  # type: ignore[assignment]
    exchange._recv_buffer = counting_buffer  # type: ignore[assignment]
    model_state.gather_flat = counting_all_gathers  # type: ignore[assignment]
    try:
        config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with ckpt.state_dict_type(model, FULL, config):
            sd = model.state_dict()
    finally:
        model_state.gather_params_on_rank0 = gather_on_rank0  # type: ignore[assignment]
        exchange._recv_buffer = recv_buffer  # type: ignore[assignment]
        model_state.gather_flat = all_gather  # type: ignore[assignment]
    assert live["calls"] == len(units) and live["all_gathers"] == 0, live
    reference = None
    if dist.get_rank() == 0:  # the values: those of a state dict gathered everywhere
        with ckpt.state_dict_type(model, FULL, FullStateDictConfig(offload_to_cpu=True)):
            reference = model.state_dict()
    else:
        with ckpt.state_dict_type(model, FULL, FullStateDictConfig(offload_to_cpu=True)):
            model.state_dict()
    if reference is not None:
        assert sd.keys() == reference.keys()
        for key, value in reference.items():
            assert torch.equal(sd[key], value), key
    result_bytes = sum(v.numel() * v.element_size() for v in sd.values())
    expected = [n for n in shards for _ in range(dist.get_world_size() - 1)]
    return {
        "buffers": live["buffers"],
        "expected": expected if dist.get_rank() == 0 else [],
        "largest": largest,
        "total": total,
        "result": result_bytes,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_full_rank0_only_holds_one_unit_at_a_time(world_size: int) -> None:
    results = run_ranks(_rank_full_rank0_bytes, world_size)
    for r in results:
        # Rank 0 receives each peer's shard of each unit into a buffer of one shard (far
        # below the largest unit), then copies it into the result; the others only send.
        assert sorted(r["buffers"]) == sorted(r["expected"]), r
        assert max(r["buffers"], default=0) < r["largest"], r
    assert results[0]["result"] >= results[0]["total"]
    assert all(r["result"] == 0 for r in results[1:]), results


# ----------------------------------------------------------- SHARDED without gathers


class _Awkward(nn.Module):
    """Parameters that cut across flat shards: a scalar, fewer rows than ranks, odd rows."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.odd = nn.Parameter(torch.randn(5, 3))
        self.row = nn.Parameter(torch.randn(1, 7))
        self.vec = nn.Parameter(torch.randn(11))
        self.lin = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        rest = self.odd.sum() + self.row.sum() + self.vec.sum()
        return self.lin(x).sum() * self.scale + rest


def _rank_sharded_exchange() -> bool:
    """SHARDED state_dict and load_state_dict move chunks by all-to-all: no unit is
    all-gathered and no parameter rebuilt in full, and the values are those of FULL."""
    import ckpt._wrappers.fsdp1_model as model_state
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    torch.manual_seed(0)
    model = FSDP(_Awkward())
    with ckpt.state_dict_type(model, FULL):
        full = model.state_dict()
    calls = {"gather": 0, "full": 0}
    gather_flat, full_value = model_state.gather_flat, model_state.full_value

    def no_gather(*args: Any) -> Any:
        calls["gather"] += 1
        return gather_flat(*args)

    def no_full(*args: Any) -> Any:
        calls["full"] += 1
        return full_value(*args)

    model_state.gather_flat, model_state.full_value = no_gather, no_full  # type: ignore[assignment]
    try:
        with ckpt.state_dict_type(model, SHARDED):
            sd = model.state_dict()
        for key, value in full.items():
            assert isinstance(sd[key], DTensor), key
            assert torch.equal(sd[key].full_tensor(), value), key
            assert sd[key].to_local().untyped_storage().nbytes() == (
                sd[key].to_local().numel() * 4
            ), f"{key}: a chunk shares storage"
        torch.manual_seed(1)
        fresh = FSDP(_Awkward())
        with ckpt.state_dict_type(fresh, SHARDED):
            fresh.load_state_dict(sd)
    finally:
        model_state.gather_flat, model_state.full_value = gather_flat, full_value  # type: ignore[assignment]
    assert calls == {"gather": 0, "full": 0}, calls
    with ckpt.state_dict_type(fresh, FULL):
        loaded = fresh.state_dict()
    assert same(loaded, full)
    # The padding of the rebuilt shard is zero, as fsdp's own sharding leaves it.
    assert torch.equal(fresh._fsdp_state.unit.flat_param, model._fsdp_state.unit.flat_param)
    return True


def _rank_sharded_optim_exchange() -> bool:
    """A sharded optimizer state dict (flat and use_orig_params) moves chunks by
    all-to-all, gathering no unit, with the values of the full one."""
    import ckpt._wrappers.fsdp1_optim as flat_optim
    import ckpt._wrappers.fsdp1_orig_params_optim as orig_optim
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    calls = {"gather": 0}
    originals = flat_optim.gather_flat, orig_optim.gather_flat
    assert originals[0] is originals[1]

    def counting(*args: Any) -> Any:
        calls["gather"] += 1
        return originals[0](*args)

    for use_orig_params in (False, True):
        torch.manual_seed(0)
        model = FSDP(_Awkward(), use_orig_params=use_orig_params)
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.randn(4, 3)).backward()
        optim.step()
        full = ckpt.optim_state_dict(model, optim, full=True)
        calls["gather"] = 0
        flat_optim.gather_flat = orig_optim.gather_flat = counting  # type: ignore[assignment]
        try:
            sharded = ckpt.optim_state_dict(model, optim, full=False)
        finally:
            flat_optim.gather_flat, orig_optim.gather_flat = originals  # type: ignore[assignment]
        assert calls["gather"] == 0, (use_orig_params, calls)
        if not use_orig_params:  # loads back by the reverse all-to-all, no DTensor gathered
            fresh = FSDP(_Awkward(), use_orig_params=False)
            fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.1)
            full_value = flat_optim.full_value

            def no_full(*args: Any, _full: Any = full_value) -> Any:
                calls["gather"] += 1
                return _full(*args)

            flat_optim.full_value = no_full  # type: ignore[assignment]
            try:
                ckpt.load_optim_state_dict(fresh, fresh_optim, sharded)
            finally:
                flat_optim.full_value = full_value  # type: ignore[assignment]
            assert calls["gather"] == 0, calls
            reloaded = ckpt.optim_state_dict(fresh, fresh_optim, full=True)["state"]
            assert reloaded.keys() == full["state"].keys()
            for fqn, state in full["state"].items():
                for key, value in state.items():
                    assert torch.equal(reloaded[fqn][key], value), (fqn, key)
        assert sharded["state"].keys() == full["state"].keys() and full["state"]
        for fqn, state in full["state"].items():
            for key, value in state.items():
                got = sharded["state"][fqn][key]
                if isinstance(got, DTensor):
                    got = got.full_tensor()
                assert torch.equal(got, value), (use_orig_params, fqn, key)
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_moves_chunks_without_gathering_units(world_size: int) -> None:
    assert run_ranks(_rank_sharded_exchange, world_size) == [True] * world_size


# ----------------------------------------------------------- errors


def _expect(kind: type[BaseException], pattern: str, fn: Any, *args: Any) -> str:
    import re

    try:
        fn(*args)
    except kind as e:
        assert re.search(pattern, str(e), re.DOTALL), (pattern, str(e))
        return str(e)
    raise AssertionError(f"no {kind.__name__} matching {pattern!r}")


def _rank_errors(root: str) -> None:
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
    from fsdp.wrap import ModuleWrapPolicy
    from tests.fsdp._common import Block

    model, optim = wrap("fsdp")
    train(model, optim, 0, 1)
    with ckpt.state_dict_type(model, SHARDED):
        sd = model.state_dict()
    # Missing and unexpected keys are listed by load_state_dict(strict=True).
    fresh, _ = wrap("fsdp", seed=3)
    partial = {k: v for k, v in sd.items() if k != "head.bias"}
    partial["head.extra"] = torch.zeros(1)
    with ckpt.state_dict_type(fresh, SHARDED):
        _expect(
            RuntimeError,
            r'Missing key.*"head.bias".*Unexpected key.*"head.extra"',
            fresh.load_state_dict,
            partial,
        )
    # A shape mismatch names the key and both shapes.
    other = FSDP(make_net(0, n_blocks=3), auto_wrap_policy=ModuleWrapPolicy({Block}))
    wide = nn.Linear(6, 14)
    with ckpt.state_dict_type(other, FULL):
        full = other.state_dict()
    full["head.weight"] = wide.weight.detach()
    with ckpt.state_dict_type(other, FULL, FullStateDictConfig(offload_to_cpu=True)):
        _expect(
            RuntimeError,
            r"size mismatch for head.weight.*\(14, 6\).*\(13, 6\)",
            other.load_state_dict,
            full,
        )
    # A configuration of the wrong class is refused, not ignored.
    _expect(
        TypeError,
        "SHARDED_STATE_DICT takes a ShardedStateDictConfig",
        ckpt.set_state_dict_type,
        model,
        SHARDED,
        FullStateDictConfig(rank0_only=True),
    )
    # A LOCAL state dict of another model: the flat sizes differ.
    small = FSDP(make_net(0, n_blocks=3), auto_wrap_policy=ModuleWrapPolicy({Block}))
    big = FSDP(nn.ModuleDict({"a": nn.Linear(6, 7)}))
    with ckpt.state_dict_type(big, LOCAL):
        local = big.state_dict()
    local = {"_flat_param": local["_flat_param"]}
    with ckpt.state_dict_type(small, LOCAL):
        _expect(
            ckpt.LocalShardMismatchError,
            "saved from another model|another world size",
            small.load_state_dict,
            local,
        )
    # ckpt.load of another model's checkpoint: refused on every rank, nothing loaded.
    ckpt.save({"model": big}, Path(root) / "big")
    before = full_weights(small)
    err = _expect(
        ckpt.StateDictMismatchError,
        "another model",
        ckpt.load,
        {"model": small},
        Path(root) / "big",
    )
    assert "Missing from the checkpoint" in err
    assert same(full_weights(small), before)
    # An optimizer state dict of another model.
    osd = ckpt.optim_state_dict(model, optim)
    osd["state"]["nope.weight"] = osd["state"]["head.weight"]
    fresh, fresh_optim = wrap("fsdp", seed=3)
    _expect(
        ValueError,
        "does not have.*nope.weight",
        FSDP.optim_state_dict_to_load,
        fresh,
        fresh_optim,
        osd,
    )


def test_errors(tmp_path: Path) -> None:
    run_ranks(_rank_errors, 2, str(tmp_path))


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_optim_state_moves_chunks_without_gathering_units(world_size: int) -> None:
    assert run_ranks(_rank_sharded_optim_exchange, world_size) == [True] * world_size
