"""``fsdp.shards``: the public view of what each rank's shards hold.

Over all ranks the listed slices cover every element of every original parameter
exactly once and hold the model's values; writing into ``local`` changes the model;
tied names are reported as aliases; a unit whose parameters are gathered is refused.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp
from fsdp.wrap import ModuleWrapPolicy
from tests.fsdp._common import Block, full_params, make_net
from tests.ranks import run_ranks


def _rank_shards(orig: bool) -> dict[str, object]:
    net = make_net(0)
    net.head.weight = net.emb.weight  # tied, as in language models
    reference = {n: p.detach().clone() for n, p in net.named_parameters()}
    model = fsdp.FullyShardedDataParallel(
        net, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=orig
    )
    shards = fsdp.local_shards(model)
    pieces = [(s.name, s.start, s.end, s.local.clone(), s.aliases, tuple(s.shape)) for s in shards]
    # write rank-and-position dependent values through the views
    for s in shards:
        flat = torch.arange(s.start, s.end, dtype=s.dtype)
        s.local.copy_(flat)
    written = full_params(model)
    refused = ""
    with fsdp.FullyShardedDataParallel.summon_full_params(model):
        try:
            fsdp.local_shards(model)
        except RuntimeError as e:
            refused = str(e)
    names = [fsdp.unwrapped_name(n) for n, _ in model.named_parameters()]
    flat_params = [fsdp.is_flat_parameter(p) for _, p in model.named_parameters()]
    return {
        "pieces": pieces,
        "reference": reference,
        "written": written,
        "refused": refused,
        "names": names,
        "flat": flat_params,
        "rank": dist.get_rank(),
    }


@pytest.mark.parametrize("orig", [False, True])
def test_local_shards_cover_each_parameter_once(orig: bool) -> None:
    results = run_ranks(_rank_shards, 2, orig)
    reference = results[0]["reference"]
    assert isinstance(reference, dict)
    covered: dict[str, list[tuple[int, int]]] = {}
    for r in results:
        for name, start, end, values, aliases, shape in r["pieces"]:  # type: ignore[attr-defined]
            covered.setdefault(name, []).append((start, end))
            assert tuple(reference[name].shape) == shape
            assert torch.equal(values, reference[name].reshape(-1)[start:end]), name
            if name == "emb.weight":
                assert aliases == ("head.weight",)
        assert "not IDLE and SHARDED" in str(r["refused"])
        assert any(r["flat"]) != orig  # flat storage is listed only without orig params
    assert covered.keys() == reference.keys()
    for name, ranges in covered.items():
        cells = sorted(x for a, b in ranges for x in range(a, b))
        assert cells == list(range(reference[name].numel())), name
    written = results[0]["written"]
    assert isinstance(written, dict)
    for name, value in written.items():
        expected = torch.arange(value.numel(), dtype=value.dtype).reshape(value.shape)
        assert torch.equal(value, expected), name


def test_unwrapped_name() -> None:
    assert fsdp.unwrapped_name("blocks.0._fsdp_wrapped_module.fc1.weight") == "blocks.0.fc1.weight"
    assert not fsdp.is_flat_parameter(nn.Parameter(torch.ones(1)))
