"""State dicts of units with a frozen part and of parameters tied across units.

Every state-dict type (FULL, SHARDED, LOCAL, with their optimizer state
dicts) saved from a trained model whose units mix frozen and trainable
parameters (``use_orig_params=True``, see fsdp's [Note: frozen part]) or
whose tied embedding/head lie in different policy units (fsdp's [Note: tied
parameters]) loads into a freshly wrapped model (other initial weights) that
then continues exactly as the uninterrupted run. FULL and SHARDED keys are
the unwrapped model's, as for any other model.

A tied parameter's optimizer state is named as torch names it, by the first name
``named_parameters()`` yields (``emb.weight``); ckpt named it by its last one
(``head.weight``) before, and such state dicts and checkpoints still load, under
every wrapper, as the nested or the flattened form, through ``set_state_dict``,
FSDP1's ``optim_state_dict_to_load`` (also after ``rekey_optim_state_dict``) and
``ckpt.load``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckpt
from tests.ckpt._wrappers import full_weights, same, step, train, wrap
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


def _last_names(osd: dict[str, Any]) -> dict[str, Any]:
    """``osd`` with the tied parameter under its last name, as ckpt named it before."""

    def last(name: str) -> str:
        return "head.weight" if name == "emb.weight" else name

    if "state" not in osd:  # flattened: "state.emb.weight.exp_avg", "param_groups.emb.weight.lr"
        return {k.replace(".emb.weight.", ".head.weight."): v for k, v in osd.items()}
    return {
        "state": {last(n): v for n, v in osd["state"].items()},
        "param_groups": [
            {**g, "params": [last(n) for n in g["params"]]} for g in osd["param_groups"]
        ],
    }


def _tied(kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    if kind.startswith("across units"):  # FSDP1 only: the embedding is a unit of its own
        return _model("tied", kind.endswith("orig"), seed)
    return wrap(kind, seed, tied=True)


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cloned(v) for v in value]
    return value


def _load_last_names(
    how: str, model: nn.Module, optim: torch.optim.Optimizer, saved: dict[str, Any]
) -> None:
    """Load ``saved`` (the model's state dict and old-style optimizer state) by ``how``."""
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
    from fsdp.api import OptimStateKeyType

    # Copies: a loaded optimizer may keep the given tensors (torch's does), and torch's
    # set_model_state_dict drops a tied parameter's other keys from the dict it gets.
    saved = _cloned(saved)
    msd = saved["model"]
    if how == "nested":
        ckpt.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=saved["optim"])
    elif how == "flattened":
        flat = ckpt.StateDictOptions(flatten_optimizer_state_dict=True)
        ckpt.set_state_dict(
            model, optim, model_state_dict=msd, optim_state_dict=saved["flat"], options=flat
        )
    elif how == "ckpt.load":
        ckpt.load({"model": model, "optim": optim}, saved["path"], verify=False)
    else:
        named = saved["optim"]
        if how == "rekey":  # to ids and back: to ours
            by_id = FSDP.rekey_optim_state_dict(
                named, OptimStateKeyType.PARAM_ID, model, optim=optim
            )
            named = FSDP.rekey_optim_state_dict(
                by_id, OptimStateKeyType.PARAM_NAME, model, optim=optim
            )
        else:
            assert how == "optim_state_dict_to_load", how
        ckpt.set_model_state_dict(model, msd)
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, named))


_TIED_KINDS = (
    "fully_shard",
    "fsdp",
    "fsdp-orig",
    "ddp-zero",
    "ddp",
    "across units",
    "across units orig",
)


def _rank_last_names(root: str) -> dict[str, bool]:
    import torch.distributed.checkpoint as dcp

    flat = ckpt.StateDictOptions(flatten_optimizer_state_dict=True)
    out: dict[str, bool] = {}
    for kind in _TIED_KINDS:
        model, optim = _tied(kind, 0)
        train(model, optim, 0, 3)
        msd, osd = ckpt.get_state_dict(model, optim)
        saved = {
            "model": msd,
            "optim": _last_names(osd),
            "flat": _last_names(ckpt.get_optimizer_state_dict(model, optim, options=flat)),
            "path": f"{root}/{kind}",
        }
        # ZeRO's sharded state is the rank's own parameters': the tie's on one rank only.
        out[f"{kind}: torch's name"] = ("emb.weight" in osd["state"]) or kind == "ddp-zero"
        out[f"{kind}: not the last"] = "head.weight" not in osd["state"]
        dcp.save({"model": msd, "optim": saved["optim"]}, checkpoint_id=saved["path"])
        hows = ["nested", "flattened", "ckpt.load"]
        if kind.startswith(("fsdp", "across")):
            hows += ["optim_state_dict_to_load", "rekey"]
        # Loaded before the model trains on: the state dicts hold its live tensors.
        resumed = {how: _tied(kind, 9) for how in hows}
        for how, (fresh, fresh_optim) in resumed.items():
            _load_last_names(how, fresh, fresh_optim, saved)
        losses, weights = train(model, optim, 3, 5), full_weights(model)
        for how, (fresh, fresh_optim) in resumed.items():
            out[f"{kind}: {how}"] = train(fresh, fresh_optim, 3, 5) == losses and same(
                full_weights(fresh), weights
            )
        if kind == "fully_shard":
            both = {**osd, "state": {**osd["state"], "head.weight": osd["state"]["emb.weight"]}}
            try:
                ckpt.set_optimizer_state_dict(model, optim, both)
                out["both names: an error"] = False
            except ValueError as e:
                out["both names: an error"] = "'emb.weight' and 'head.weight'" in str(e)
    return out


def test_state_under_the_last_name_of_a_tied_parameter_still_loads(tmp_path: Path) -> None:
    for rank, results in enumerate(run_ranks(_rank_last_names, 2, str(tmp_path), timeout=240)):
        assert results and all(results.values()), (
            rank,
            {k: v for k, v in results.items() if not v},
        )
