"""Parameters tied across units go to the innermost unit that contains all their uses.

Each case ties a parameter between modules that the auto-wrap policy puts in
different units, which torch's FSDP1 trains wrongly or refuses: an embedding
tied to the head with the embedding its own unit (owner: the root), one
weight tied across two blocks, one Linear module shared by two blocks, and
GPT-2 from a config (``transformers``, tied ``wte``/``lm_head``) wrapped per
block with the embeddings and the head in units of their own. With
``use_orig_params`` False and True on 2 ranks, losses and final parameters
equal DDP's, the tie survives (``summon_full_params``), the full state dict
has DDP's keys and values, and one INFO line names the parameter and its
unit. See [Note: tied parameters] in ``fsdp/_init.py``.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from tests.fsdp._common import Block, batches, full_params, make_net, max_diff, train
from tests.ranks import run_ranks


def _emb_head() -> nn.Module:
    net = make_net()
    net.head.weight = net.emb.weight
    return net


def _weight_across_blocks() -> nn.Module:
    net = make_net()
    net.blocks[1].fc1.weight = net.blocks[0].fc1.weight
    return net


def _linear_shared_by_blocks() -> nn.Module:
    net = make_net()
    net.blocks[2].fc2 = net.blocks[0].fc2
    return net


CASES: dict[str, tuple[Any, set[type[nn.Module]], list[str]]] = {
    # name -> (model, unit classes, the parameters the INFO lines name, one line each)
    "emb_head": (_emb_head, {Block, nn.Embedding}, ["'emb.weight' (also 'head.weight')"]),
    "weight_across_blocks": (
        _weight_across_blocks,
        {Block},
        ["'blocks.0.fc1.weight' (also 'blocks.1.fc1.weight')"],
    ),
    "linear_shared_by_blocks": (
        _linear_shared_by_blocks,
        {Block},
        [f"'blocks.0.fc2.{n}' (also 'blocks.2.fc2.{n}')" for n in ("weight", "bias")],
    ),
}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _wrap_logged(make: Any, classes: set[type[nn.Module]], orig: bool) -> tuple[Any, list[str]]:
    import fsdp
    from fsdp.wrap import ModuleWrapPolicy

    logger = logging.getLogger("fsdp")
    handler = _Records()
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        model = fsdp.FullyShardedDataParallel(
            make(), auto_wrap_policy=ModuleWrapPolicy(classes), use_orig_params=orig
        )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    return model, handler.lines


def _rank_nets() -> dict[str, Any]:
    import fsdp

    data = batches(4)
    out: dict[str, Any] = {}
    for name, (make, classes, _) in CASES.items():
        ddp = DDP(make())
        ref_losses = train(ddp, data)[0]
        ref = full_params(ddp)
        ref_sd = {k.removeprefix("module."): v for k, v in ddp.state_dict().items()}
        for orig in (False, True):
            model, lines = _wrap_logged(make, classes, orig)
            losses = train(model, data)[0]
            with fsdp.FullyShardedDataParallel.summon_full_params(model):
                m = model.module
                tied = {
                    "emb_head": lambda m: m.head.weight is m.emb.weight,
                    "weight_across_blocks": lambda m: (
                        m.blocks[1].fc1.weight is m.blocks[0].fc1.weight
                    ),
                    "linear_shared_by_blocks": lambda m: m.blocks[2].fc2 is m.blocks[0].fc2,
                }[name](m)
            sd = model.state_dict()
            out[f"{name}/orig={orig}"] = {
                "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
                "param_diff": max_diff(full_params(model), ref),
                "still_tied": tied,
                "sd_keys_equal": sorted(sd) == sorted(ref_sd),
                "sd_diff": max((sd[k] - ref_sd[k]).abs().max().item() for k in ref_sd)
                if sorted(sd) == sorted(ref_sd)
                else None,
                "log": lines,
            }
    return out


def test_tied_across_units_train_like_ddp() -> None:
    for rank, results in enumerate(run_ranks(_rank_nets, 2, timeout=300)):
        for key, r in results.items():
            where = f"rank {rank}, {key}: {r}"
            assert r["loss_diff"] <= 1e-6, where
            assert r["param_diff"] <= 1e-6, where
            assert r["still_tied"] is True, where
            assert r["sd_keys_equal"] is True, where
            assert r["sd_diff"] <= 1e-6, where
            names = CASES[key.split("/")[0]][2]
            tied_lines = [line for line in r["log"] if "used in several FSDP units" in line]
            assert len(tied_lines) == len(names), where
            for line, name in zip(tied_lines, names, strict=True):
                assert f"parameter {name}" in line and "unit '<root>' (Net)" in line, where


def _rank_gpt2(orig: bool) -> dict[str, Any]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    import fsdp
    from fsdp.wrap import ModuleWrapPolicy
    from tests.fsdp.test_transformers import VOCAB, _model, _train, _unwrapped

    g = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
    data = [torch.randint(0, VOCAB, (2, 12), generator=g) for _ in range(4)]
    ref_model, _ = _model("gpt2")
    assert ref_model.lm_head.weight is ref_model.transformer.wte.weight
    ddp = DDP(ref_model)
    ref_losses = _train(ddp, data)
    # The embeddings and the head are units of their own: the tie crosses units.
    model = fsdp.FullyShardedDataParallel(
        _model("gpt2")[0],
        auto_wrap_policy=ModuleWrapPolicy({GPT2Block, nn.Embedding, nn.Linear}),
        use_orig_params=orig,
    )
    units = [
        n.replace("_fsdp_wrapped_module.", "")
        for n, m in model.named_modules()
        if isinstance(m, fsdp.FullyShardedDataParallel)
    ]
    losses = _train(model, data)
    return {
        "units": units,
        "losses": losses,
        "ref_losses": ref_losses,
        "param_diff": max_diff(full_params(model), _unwrapped(full_params(ddp))),
    }


@pytest.mark.parametrize("orig", [False, True])
def test_gpt2_tied_embeddings_in_different_units_train_like_ddp(orig: bool) -> None:
    for r in run_ranks(_rank_gpt2, 2, orig, timeout=300):
        assert "transformer.wte" in r["units"] and "lm_head" in r["units"], r["units"]
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"], strict=True)) <= 1e-6
        assert r["param_diff"] <= 1e-6, r


def _seq(device: str) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        net = nn.Sequential(nn.Embedding(13, 6), Block(), nn.Linear(6, 13))
    net[2].weight = net[0].weight
    return net


def _rank_meta() -> dict[str, Any]:
    import fsdp
    from fsdp.wrap import ModuleWrapPolicy

    policy = ModuleWrapPolicy({Block, nn.Embedding})
    # Built on the meta device, each unit materialised in turn: the embedding's unit
    # materialises the tied weight, the root keeps it for the head.
    meta = fsdp.FullyShardedDataParallel(_seq("meta"), auto_wrap_policy=policy)
    ref = _seq("cpu")
    with fsdp.FullyShardedDataParallel.summon_full_params(meta):
        tied = meta.module[2].weight is meta.module[0].module.weight
    return {"tied": tied, "diff": max_diff(full_params(meta), full_params(ref))}


def test_tied_across_units_on_the_meta_device_stay_tied() -> None:
    for r in run_ranks(_rank_meta, 2, timeout=60):
        assert r == {"tied": True, "diff": 0.0}, r
