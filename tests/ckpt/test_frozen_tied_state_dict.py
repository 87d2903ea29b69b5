"""State dicts of units with a frozen part and of parameters tied across units.

Every state-dict type (FULL, SHARDED, LOCAL, with their optimizer state
dicts) saved from a trained model whose units mix frozen and trainable
parameters (``use_orig_params=True``, see fsdp's [Note: frozen part]) or
whose tied embedding/head lie in different policy units (fsdp's [Note: tied
parameters]) loads into a freshly wrapped model (other initial weights) that
then continues exactly as the uninterrupted run. FULL and SHARDED keys are
the unwrapped model's, as for any other model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ckpt
from tests.ckpt._wrappers import full_weights, same, step, train
from tests.ckpt.test_fsdp_state_dict import CASES
from tests.fsdp._common import Block, make_net
from tests.ranks import run_ranks


def _model(kind: str, orig: bool, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    import fsdp
    from fsdp.wrap import ModuleWrapPolicy

    net = make_net(seed)
    if kind == "frozen":
        net.emb.requires_grad_(False)
        for b in net.blocks:
            b.fc1.requires_grad_(False)
        classes: set[type[nn.Module]] = {Block}
    else:
        net.head.weight = net.emb.weight
        classes = {Block, nn.Embedding}
    model = fsdp.FullyShardedDataParallel(
        net, auto_wrap_policy=ModuleWrapPolicy(classes), use_orig_params=orig
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _rank_roundtrip(kind: str, orig: bool) -> dict[str, Any]:
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    model, optim = _model(kind, orig, 0)
    train(model, optim, 0, 3)
    names = sorted(n for n, _ in make_net().named_parameters())
    snapshots = {}
    for name, sd_type, config, optim_config in CASES:
        with FSDP.state_dict_type(model, sd_type, config, optim_config):
            snapshots[name] = (model.state_dict(), FSDP.optim_state_dict(model, optim))
    expected_loss = step(model, optim, 3)
    expected = full_weights(model)
    out: dict[str, Any] = {}
    for name, sd_type, config, optim_config in CASES:
        if getattr(config, "rank0_only", False):
            continue
        sd, osd = snapshots[name]
        fresh, fresh_optim = _model(kind, orig, 9)
        with ckpt.state_dict_type(fresh, sd_type, config, optim_config):
            result = fresh.load_state_dict(sd)
            to_load = FSDP.optim_state_dict_to_load(fresh, fresh_optim, osd)
        fresh_optim.load_state_dict(to_load)
        param_keys = sorted(k for k in sd if k != "scale")
        out[name] = {
            "clean": not result.missing_keys and not result.unexpected_keys,
            "resumes": step(fresh, fresh_optim, 3) == expected_loss
            and same(full_weights(fresh), expected),
            # FULL/SHARDED: the unwrapped model's names (the tied head under both).
            "keys_ok": sd_type.name == "LOCAL_STATE_DICT"
            or param_keys == sorted({*names, "head.weight"}),
        }
    return out


@pytest.mark.parametrize(
    ("kind", "orig"), [("frozen", True), ("frozen", False), ("tied", False), ("tied", True)]
)
def test_frozen_part_and_tied_units_resume_from_every_type(kind: str, orig: bool) -> None:
    for rank, results in enumerate(run_ranks(_rank_roundtrip, 2, kind, orig, timeout=240)):
        for name, r in results.items():
            assert all(r.values()), (rank, kind, orig, name, r)
