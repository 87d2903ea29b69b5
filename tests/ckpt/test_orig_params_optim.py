"""Optimizer state of fsdp ``use_orig_params=True`` models: saved, resharded, resumed.

Under ``use_orig_params=True`` the optimizer steps each rank's 1-D piece of every
original parameter (empty on ranks that hold none of it). Its state must turn into
the same FQN-keyed state as ``use_orig_params=False`` and DDP + zero_optim, and back,
at any world size. Two setups are trained for 3 steps on one world size, saved, and
resumed on another (and on the same), under every wrapper that can hold them:

* ``plain``: one AdamW group over all parameters (wrappers: fsdp ``orig``, fsdp ``flat``
  = ``use_orig_params=False``, ``ddp-zero``);
* ``groups``: two groups (no weight decay and another lr for norms and biases) and some
  parameters frozen, so one unit mixes frozen and trainable parameters (``orig`` and
  ``ddp-zero``; ``use_orig_params=False`` cannot hold a frozen+trainable unit, nor
  groups finer than a unit);
* ``frozen``: the same frozen parameters, but in the optimizer (one group): they get no
  state, and the FULL dict has none for them.

Each resume trains 2 more steps; its losses and final weights must equal the
uninterrupted run's bit for bit. Exact equality holds because every rank trains on
the same batch (tests/ckpt/_wrappers), so averaged gradients are exact at world sizes
1, 2, 4 and all wrappers do the same elementwise AdamW arithmetic. Paths: ``ckpt.save``
/``ckpt.load`` on disk (sharded DTensor state, DCP reshards), and the full FQN-keyed
dicts (``rank0_only``, ``torch.save``d by rank 0) loaded with ``load_optim_state_dict``.
The save spawn also checks, at its own world size, FSDP's static methods (SHARDED and
FULL ``optim_state_dict``/``optim_state_dict_to_load``, ``scatter_full_optim_state_dict``,
``flatten_sharded_optim_state_dict``, ``rekey_optim_state_dict``): the loaded
optimizer's own ``state_dict()`` equals the saved one exactly (no state appears for
parameters whose piece is empty on a rank), and the full dict equals the one
``use_orig_params=False`` gives for the same training.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import ckpt
from ckpt import FullStateDictConfig, StateDictType
from tests.ckpt._wrappers import LR, full_weights, same, train
from tests.fsdp._common import Block, make_net
from tests.ranks import run_ranks

SOURCES = {
    "plain": ("orig", "flat", "ddp-zero"),
    "groups": ("orig", "ddp-zero"),
    "frozen": ("orig", "ddp-zero"),
}
# (setup, source, target) resumed on the other world size (and orig/zero on the same)
PAIRS = (
    ("plain", "orig", "orig"),
    ("plain", "orig", "flat"),
    ("plain", "orig", "ddp-zero"),
    ("plain", "flat", "orig"),
    ("plain", "ddp-zero", "orig"),
    ("groups", "orig", "orig"),
    ("groups", "orig", "ddp-zero"),
    ("groups", "ddp-zero", "orig"),
    ("frozen", "orig", "orig"),
    ("frozen", "orig", "ddp-zero"),
)


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").removeprefix("module.")


def _no_decay(name: str) -> bool:
    name = _clean(name)
    return name.endswith("bias") or ".ln." in name or name.startswith("ln")


def _freeze(net: nn.Module) -> None:
    """Frozen parameters inside units with trainable ones (blocks 0, 1) and alone (emb)."""
    m: Any = net
    m.blocks[0].fc1.weight.requires_grad_(False)
    m.blocks[1].ln.weight.requires_grad_(False)
    m.emb.weight.requires_grad_(False)


def _groups(model: nn.Module, setup: str) -> list[dict[str, Any]]:
    if setup in ("plain", "frozen"):
        return [{"params": list(model.parameters()), "weight_decay": 0.1}]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if not _no_decay(n)], "weight_decay": 0.1},
        {"params": [p for n, p in named if _no_decay(n)], "weight_decay": 0.0, "lr": LR / 2},
    ]


def wrap(
    kind: str, setup: str, seed: int = 0, strategy: str = "FULL_SHARD"
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (same initial weights for a seed) and its optimizer under ``kind``."""
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
    from fsdp import ShardingStrategy
    from fsdp.wrap import ModuleWrapPolicy
    from zero_optim import ZeroRedundancyOptimizer

    net = make_net(seed)
    if setup in ("groups", "frozen"):
        _freeze(net)
    if kind in ("orig", "flat"):
        model: nn.Module = FSDP(
            net,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=kind == "orig",
            sharding_strategy=ShardingStrategy[strategy],
        )
        return model, torch.optim.AdamW(_groups(model, setup), lr=LR)
    model = DDP(net)
    assert kind == "ddp-zero", kind
    return model, ZeroRedundancyOptimizer(_groups(model, setup), torch.optim.AdamW, lr=LR)


def _full_model_state(model: nn.Module) -> dict[str, Any]:
    if isinstance(model, DDP):
        sd = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        return sd if dist.get_rank() == 0 else {}
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with ckpt.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        return model.state_dict()


def _load_full_model_state(model: nn.Module, sd: dict[str, Any]) -> None:
    if isinstance(model, DDP):
        model.module.load_state_dict(sd)
    else:
        model.load_state_dict(sd)


def _equal(a: Any, b: Any) -> bool:
    """Deep equality; tensors bit-equal (DTensors by their local chunks), same dtypes."""
    if isinstance(a, DTensor) or isinstance(b, DTensor):
        return (
            isinstance(a, DTensor)
            and isinstance(b, DTensor)
            and a.shape == b.shape
            and _equal(a.to_local(), b.to_local())
        )
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _sorted_groups(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` with each group's parameter names sorted: optimizers order them differently."""
    if not sd:
        return sd
    groups = [{**g, "params": sorted(g["params"])} for g in sd["param_groups"]]
    return {"state": sd["state"], "param_groups": groups}


def _static_methods(
    setup: str, sharded_sd: Any, full_sd: Any, local_sd: Any, want: Any
) -> dict[str, bool]:
    """FSDP's static methods, at the saving world size: resume and compare (see module doc)."""
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
    from fsdp import OptimStateKeyType

    want_losses, want_weights, model_sd = want
    out: dict[str, bool] = {}
    for how in ("sharded", "full", "scatter", "flatten"):
        model, optim = wrap("orig", setup, seed=9)
        _load_full_model_state(model, model_sd)
        if how == "sharded":
            with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                flat = FSDP.optim_state_dict_to_load(model, optim, sharded_sd)
        elif how == "full":
            with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                flat = FSDP.optim_state_dict_to_load(model, optim, full_sd)
        elif how == "scatter":
            rank0_sd = full_sd if dist.get_rank() == 0 else None
            flat = FSDP.scatter_full_optim_state_dict(rank0_sd, model, optim=optim)
        else:
            flat = FSDP.flatten_sharded_optim_state_dict(sharded_sd, model, optim)
        optim.load_state_dict(flat)
        out[f"static {how}: optimizer state as saved"] = _equal(optim.state_dict(), local_sd)
        ok = train(model, optim, 3, 5) == want_losses
        out[f"static {how}: resumes"] = ok and same(full_weights(model), want_weights)
    # rekey: FQNs -> ids of this optimizer and back (original parameters map one to one).
    model, optim = wrap("orig", setup, seed=9)
    if dist.get_rank() == 0:
        by_id = FSDP.rekey_optim_state_dict(full_sd, OptimStateKeyType.PARAM_ID, model, optim=optim)
        back = FSDP.rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, model, optim=optim)
        out["rekey round trip"] = all(isinstance(k, int) for k in by_id["state"]) and _equal(
            _sorted_groups(back), _sorted_groups(full_sd)
        )
    return out


def _rank_save(root: str) -> tuple[dict[str, Any], dict[str, bool]]:
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    expected: dict[str, Any] = {}
    checks: dict[str, bool] = {}
    full_by_kind: dict[str, Any] = {}
    for setup, kinds in SOURCES.items():
        for kind in kinds:
            model, optim = wrap(kind, setup)
            train(model, optim, 0, 3)
            where = Path(root) / f"{setup}-{kind}"
            ckpt.save({"model": model, "optim": optim, "step": 3}, where)
            full = {
                "model": _full_model_state(model),
                "optim": ckpt.optim_state_dict(model, optim, full=True, rank0_only=True),
            }
            if dist.get_rank() == 0:
                torch.save(full, f"{where}.pt")
            full_by_kind[f"{setup}-{kind}"] = full["optim"]
            if dist.get_rank() == 0:
                net = make_net()
                if setup != "plain":
                    _freeze(net)
                trainable = {n for n, p in net.named_parameters() if p.requires_grad}
                checks[f"{setup}-{kind}: state for the trainable parameters only"] = (
                    set(full["optim"]["state"]) == trainable
                )
            statics: tuple[Any, ...] = ()
            if kind == "orig":
                with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                    sharded_sd = FSDP.optim_state_dict(model, optim)
                model_sd = _full_model_state(model)
                full_sd = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
                if dist.get_rank() == 0:
                    checks[f"{setup}: full_optim_state_dict == ckpt's"] = _equal(
                        full_sd, full["optim"]
                    )
                local_sd = optim.state_dict()
                local_sd = {
                    "state": {
                        i: {k: v.clone() for k, v in s.items()}
                        for i, s in local_sd["state"].items()
                    },
                    "param_groups": local_sd["param_groups"],
                }
                # The seed's rank0_only FULL: every rank's model needs the full model state.
                box = [model_sd]
                dist.broadcast_object_list(box)
                statics = (sharded_sd, full_sd, local_sd, box[0])
            losses = train(model, optim, 3, 5)
            weights = full_weights(model)
            expected[f"{setup}-{kind}"] = (losses, weights)
            if statics:
                sharded_sd, full_sd, local_sd, model_sd = statics
                results = _static_methods(
                    setup, sharded_sd, full_sd, local_sd, (losses, weights, model_sd)
                )
                checks.update({f"{setup}: {k}": v for k, v in results.items()})
    if dist.get_rank() == 0:
        checks["plain: FULL of use_orig_params=True == of use_orig_params=False"] = _equal(
            _sorted_groups(full_by_kind["plain-orig"]), _sorted_groups(full_by_kind["plain-flat"])
        )
    return expected, checks


def _rank_resume(root: str, expected: dict[str, Any], same_size: bool) -> dict[str, bool]:
    results: dict[str, bool] = {}
    for setup, source, target in PAIRS:
        if same_size and "flat" in (source, target):
            continue  # at the same world size only orig <-> orig and orig <-> zero
        want_losses, want_weights = expected[f"{setup}-{source}"]
        where = Path(root) / f"{setup}-{source}"
        name = f"{setup}: {source}->{target}"
        model, optim = wrap(target, setup, seed=9)
        state: dict[str, Any] = {"model": model, "optim": optim, "step": 0}
        ckpt.load(state, where)
        ok = state["step"] == 3 and train(model, optim, 3, 5) == want_losses
        results[f"{name} disk"] = ok and same(full_weights(model), want_weights)
        full = torch.load(f"{where}.pt", weights_only=False)
        model, optim = wrap(target, setup, seed=9)
        _load_full_model_state(model, full["model"])
        ckpt.load_optim_state_dict(model, optim, full["optim"])
        ok = train(model, optim, 3, 5) == want_losses
        results[f"{name} full"] = ok and same(full_weights(model), want_weights)
    return results


@pytest.mark.parametrize(("saved_on", "loaded_on"), [(2, (4, 2)), (4, (2,))])
def test_orig_params_optim_resume(
    tmp_path: Path, saved_on: int, loaded_on: tuple[int, ...]
) -> None:
    saved = run_ranks(_rank_save, saved_on, str(tmp_path), timeout=240)
    expected, checks = saved[0]
    for rank, (_, rank_checks) in enumerate(saved):
        assert rank_checks, "no check ran"
        assert all(rank_checks.values()), (rank, {k: v for k, v in rank_checks.items() if not v})
    assert "plain: FULL of use_orig_params=True == of use_orig_params=False" in checks
    for world_size in loaded_on:
        same_size = world_size == saved_on
        for results in run_ranks(
            _rank_resume, world_size, str(tmp_path), expected, same_size, timeout=240
        ):
            assert results, "no sub-case ran"
            assert all(results.values()), {k: v for k, v in results.items() if not v}


# --- error paths -------------------------------------------------------------------------------


def _raises(fn: Any, pattern: str) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return "ok" if re.search(pattern, str(e)) else f"wrong message: {e}"
    return "did not raise"


def _rank_errors() -> dict[str, str]:
    model, optim = wrap("orig", "groups")
    train(model, optim, 0, 1)
    full = ckpt.optim_state_dict(model, optim, full=True)
    out: dict[str, str] = {}

    def bad_shape() -> None:
        sd = {"state": dict(full["state"]), "param_groups": full["param_groups"]}
        name = "blocks.0.fc2.weight"
        sd["state"][name] = {**sd["state"][name], "exp_avg": torch.zeros(3, 3)}
        ckpt.load_optim_state_dict(model, optim, sd)

    out["shape"] = _raises(bad_shape, r"exp_avg.*blocks\.0\.fc2\.weight.*shape \(3, 3\)")

    def other_groups() -> None:
        one_group = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        ckpt.load_optim_state_dict(model, one_group, full)

    out["groups"] = _raises(other_groups, r"has 2 parameter groups, this optimizer has 1")

    def frozen_in_state() -> None:
        sd = {"state": dict(full["state"]), "param_groups": full["param_groups"]}
        sd["state"]["emb.weight"] = sd["state"]["head.weight"]
        ckpt.load_optim_state_dict(model, optim, sd)

    out["unexpected"] = _raises(frozen_in_state, r"does not have.*emb\.weight")

    def not_a_state_dict() -> None:
        ckpt.load_optim_state_dict(model, optim, {"exp_avg": 1})

    out["not a state dict"] = _raises(not_a_state_dict, r"'state' and 'param_groups'")

    def odd_state_on_one_rank() -> None:
        # A factored moment on rank 1 only: every rank must raise, none may wait.
        p = next(p for p in optim.param_groups[0]["params"] if p.numel() > 2)
        if dist.get_rank() == 1:
            optim.state[p]["row"] = torch.zeros(p.numel() + 1)
        try:
            ckpt.optim_state_dict(model, optim, full=False)
        finally:
            optim.state[p].pop("row", None)

    out["odd state"] = _raises(odd_state_on_one_rank, r"'row'.*not other shapes")
    # After the errors the optimizer still saves and loads.
    ckpt.load_optim_state_dict(model, optim, ckpt.optim_state_dict(model, optim, full=False))
    out["still works"] = "ok"
    return out


def test_orig_params_optim_errors() -> None:
    for result in run_ranks(_rank_errors, 2, timeout=120):
        assert result == dict.fromkeys(result, "ok"), result
        assert len(result) == 6


# --- NO_SHARD: the optimizer sees whole, full-shaped original parameters ---------------------


def _rank_no_shard() -> dict[str, bool]:
    from fsdp import FullStateDictConfig as FullConfig

    runs: dict[str, Any] = {}
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        model, optim = wrap("orig", "groups", strategy=strategy)
        train(model, optim, 0, 3)
        config = FullConfig(offload_to_cpu=True, rank0_only=False)
        with ckpt.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            model_sd = model.state_dict()
        osd = ckpt.optim_state_dict(model, optim, full=True)
        sharded = ckpt.optim_state_dict(model, optim, full=False)
        losses = train(model, optim, 3, 5)
        runs[strategy] = (model_sd, osd, sharded, losses, full_weights(model))
    out = {"FULL equal": _equal(runs["FULL_SHARD"][1], runs["NO_SHARD"][1])}
    for source, target in (("FULL_SHARD", "NO_SHARD"), ("NO_SHARD", "FULL_SHARD")):
        model_sd, osd, sharded, losses, weights = runs[source]
        for form, saved in (("full", osd), ("sharded", sharded)):
            model, optim = wrap("orig", "groups", seed=9, strategy=target)
            model.load_state_dict(model_sd)
            ckpt.load_optim_state_dict(model, optim, saved)
            ok = train(model, optim, 3, 5) == losses
            out[f"{source}->{target} {form}"] = ok and same(full_weights(model), weights)
    return out


def test_orig_params_optim_no_shard() -> None:
    """NO_SHARD's full-shaped state equals FULL_SHARD's pieces gathered, and loads both ways."""
    for result in run_ranks(_rank_no_shard, 2, timeout=120):
        assert len(result) == 5, result
        assert all(result.values()), {k: v for k, v in result.items() if not v}
