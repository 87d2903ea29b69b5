"""``fsdp.units``: the public layout of a wrapped model, checked against the real shards.

Each rank reports its units; the test puts every rank's chunk where the reported layout
says it lies, cuts the reported parameter ranges out of the result and compares them
with the unwrapped model's ``state_dict()``: every parameter (tied names as aliases,
frozen parts included) is covered exactly once and holds the model's values, with and
without ``use_orig_params``, at 1, 2 and 4 ranks and unsharded. ``gather_flat`` must
give the same full tensors, and the names the keys that ckpt's hooks find.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import ckpt
import fsdp
from flatparam import ShardLayout
from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
from fsdp import MixedPrecision, ShardingStrategy, StateDictType, TrainingStateError
from fsdp.units import (
    assert_idle,
    buffer_orig_dtypes,
    gather_flat,
    instance_flat_units,
    wrapped_prefix,
)
from fsdp.wrap import ModuleWrapPolicy
from tests.fsdp._common import Block, make_net
from tests.ranks import run_ranks

FROZEN = ("blocks.1.fc1.weight", "blocks.1.ln.bias", "ln_f.weight")  # mixed units


def _net() -> nn.Module:
    net = make_net(0)
    net.head.weight = net.emb.weight  # tied, as in language models
    for name, p in net.named_parameters():
        p.requires_grad_(name not in FROZEN)
    return net


def _rank_units(orig: bool, strategy: str) -> dict[str, Any]:
    net = _net()
    reference = {k: v.clone() for k, v in net.state_dict().items()}
    model = FSDP(
        net,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=orig,
        sharding_strategy=ShardingStrategy[strategy],
    )
    units = fsdp.flat_units(model)
    out: list[dict[str, Any]] = []
    for unit in units:
        pieces = unit.local_pieces()
        if unit.orig_params is not None:  # each original is its piece of this rank's chunk
            by_index = {p.param_index: p for p in pieces}
            for i, p in enumerate(unit.orig_params):
                piece = by_index.get(i)
                if unit.sharded:
                    want = (
                        unit.flat_param[piece.shard_offset : piece.shard_offset + piece.numel]
                        if piece
                        else unit.flat_param[:0]
                    )
                    assert torch.equal(p.detach().reshape(-1), want), unit.params[i].fqn
                else:
                    assert tuple(p.shape) == tuple(unit.params[i].shape)
        out.append(
            {
                "prefix": unit.prefix,
                "key": unit.key,
                "trainable": unit.trainable,
                "params": [(p.fqn, p.aliases, tuple(p.shape), p.start, p.end) for p in unit.params],
                "layout": (unit.layout.numels, unit.layout.world_size, unit.layout.align_numel),
                "sharded": unit.sharded,
                "shard_index": unit.shard_index,
                "sharding": (
                    unit.sharding.rank,
                    unit.sharding.world_size,
                    unit.sharding.strategy,
                    unit.sharding.device.type,
                    dist.get_process_group_ranks(unit.sharding.group),
                ),
                "chunk": unit.flat_param.detach().clone(),
                "pieces": [
                    (p.param_index, p.param_start, p.param_end, p.shard_offset) for p in pieces
                ],
                "gathered": gather_flat(unit, unit.flat_param).clone(),
                "requires_grad": unit.flat_param.requires_grad,
                "is_flat": fsdp.is_flat_parameter(unit.flat_param),
            }
        )
    with ckpt.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        local_keys = sorted(model.state_dict())
    return {"units": out, "reference": reference, "local_keys": local_keys}


def _reassemble(results: list[dict[str, Any]]) -> dict[str, Tensor]:
    """The unwrapped parameters, from every rank's chunk placed where the layout says."""
    params: dict[str, Tensor] = {}
    units_per_rank = [r["units"] for r in results]
    for same_unit in zip(*units_per_rank, strict=True):
        layout = ShardLayout(*same_unit[0]["layout"])
        full_numel, shard_numel = layout.full_numel, layout.shard_numel
        padded = torch.full((layout.padded_numel,), float("nan"))
        for u in same_unit:
            assert u["layout"] == same_unit[0]["layout"] and u["params"] == same_unit[0]["params"]
            assert len(u["chunk"]) == shard_numel
            start, end = layout.bounds(u["shard_index"])  # which rank holds which range
            padded[start:end] = u["chunk"]
        flat = padded[:full_numel]
        assert not flat.isnan().any(), f"{same_unit[0]['key']}: a range no rank holds"
        for u in same_unit:
            assert torch.equal(u["gathered"], flat), u["key"]
        for fqn, aliases, shape, start, end in same_unit[0]["params"]:
            assert end - start == torch.Size(shape).numel()
            for name in (fqn, *aliases):
                assert name not in params, f"{name} listed twice"
                params[name] = flat[start:end].view(shape)
    return params


@pytest.mark.parametrize(
    ("world_size", "orig", "strategy"),
    [
        (1, False, "FULL_SHARD"),
        (2, False, "FULL_SHARD"),
        (4, False, "FULL_SHARD"),
        (2, True, "FULL_SHARD"),
        (4, True, "SHARD_GRAD_OP"),
        (2, False, "NO_SHARD"),
    ],
)
def test_reported_layout_rebuilds_the_unwrapped_model(
    world_size: int, orig: bool, strategy: str
) -> None:
    results = run_ranks(_rank_units, world_size, orig, strategy)
    reference = results[0]["reference"]
    params = _reassemble(results)
    assert sorted(params) == sorted(k for k in reference if k != "scale")  # buffers: no unit
    for name, value in params.items():
        assert torch.equal(value, reference[name]), name
    units = results[0]["units"]
    sharded = world_size > 1 and strategy != "NO_SHARD"
    frozen = {fqn for u in units if not u["trainable"] for fqn, *_ in u["params"]}
    assert frozen == set(FROZEN)
    for rank, result in enumerate(results):
        for u in result["units"]:
            assert u["sharded"] is sharded
            assert u["layout"][1] == (world_size if sharded else 1)
            assert u["shard_index"] == (rank if sharded else 0)
            assert u["sharding"] == (
                rank,
                world_size,
                ShardingStrategy[strategy] if world_size > 1 else ShardingStrategy.NO_SHARD,
                "cpu",
                list(range(world_size)),
            )
            assert u["requires_grad"] is u["trainable"] and u["is_flat"]
            assert u["key"] == u["prefix"] + (
                "_flat_param" if u["trainable"] else "_flat_param_frozen"
            )
            for fqn, *_ in u["params"]:
                assert fqn.startswith(u["prefix"])
            # the local pieces are exactly the parts of the parameters inside this chunk
            shard_numel = len(u["chunk"])
            lo = u["shard_index"] * shard_numel
            for index, start, end, offset in u["pieces"]:
                p_start = u["params"][index][3]
                assert lo + offset == p_start + start and end - start > 0
        # ckpt's LOCAL state dict shows each unit under its key (the hand-over contract)
        keys = {u["key"] for u in result["units"]}
        assert keys <= set(result["local_keys"]), (keys, result["local_keys"])
    tied = [u for u in units for fqn, aliases, *_ in u["params"] if fqn == "emb.weight"]
    assert [a for fqn, a, *_ in tied[0]["params"] if fqn == "emb.weight"] == [("head.weight",)]


def _rank_helpers() -> dict[str, Any]:
    torch.manual_seed(0)
    model = FSDP(
        make_net(0),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16),
    )
    model(torch.zeros(2, 3, dtype=torch.long))  # lazy init casts the buffers
    out: dict[str, Any] = {
        "dtypes": buffer_orig_dtypes(model),
        "prefixed": buffer_orig_dtypes(model, "m."),
        "wrapped": wrapped_prefix("blocks.0."),
        "inner": [u.key for u in instance_flat_units(model.blocks[0], "x.")],
        "inner_fqns": instance_flat_units(model.blocks[0], "x.")[0].fqns(),
    }
    assert_idle(model, "a tool")  # idle between steps: no error
    with FSDP.summon_full_params(model):
        try:
            assert_idle(model, "a tool")
        except TrainingStateError as e:
            out["busy"] = str(e)
    try:
        instance_flat_units(model.blocks[0].fc1)
    except TypeError as e:
        out["not_fsdp"] = str(e)
    unit = fsdp.flat_units(model)[0]
    try:
        gather_flat(unit, torch.zeros(unit.layout.shard_numel + 1))
    except ValueError as e:
        out["bad_gather"] = str(e)
    return out


def test_hook_helpers_and_refusals() -> None:
    for out in run_ranks(_rank_helpers, 2):
        assert out["dtypes"] == {"scale": torch.float32}
        assert out["prefixed"] == {"m.scale": torch.float32}
        assert out["wrapped"] == "blocks.0._fsdp_wrapped_module."
        assert out["inner"] == ["x._flat_param"]
        assert out["inner_fqns"] == [
            "x.ln.weight",
            "x.ln.bias",
            "x.fc1.weight",
            "x.fc1.bias",
            "x.fc2.weight",
            "x.fc2.bias",
        ]
        assert "a tool needs the FSDP instance in state IDLE" in out["busy"]
        assert "expected an FSDP instance" in out["not_fsdp"] and "Linear" in out["not_fsdp"]
        assert "laid out like unit.flat_param" in out["bad_gather"]


def _rank_local_shards_frozen() -> list[str]:
    model = FSDP(_net(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    return sorted(s.name for s in fsdp.local_shards(model))


def test_local_shards_list_frozen_parts() -> None:
    names = run_ranks(_rank_local_shards_frozen, 2)[0]
    assert set(FROZEN) <= set(names)
    assert sorted(n for n, _ in _net().named_parameters()) == names
