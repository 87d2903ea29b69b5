"""Checkpoints move between our fsdp and torch's FSDP1 / ``fully_shard`` through DCP.

Our ``ckpt.save`` of an fsdp model and its optimizer is a DCP checkpoint whose keys
and per-parameter dimension-0 chunks are what torch's own state-dict helpers
(``torch.distributed.checkpoint.state_dict``) read and write for torch's FSDP, so:

* a checkpoint saved by our fsdp on 2 ranks loads into torch's FSDP1 and into
  ``fully_shard`` (FSDP2) on 4 ranks with ``dcp.load`` and resumes identically;
* a checkpoint saved by torch's FSDP1 with ``dcp.save`` on 2 ranks loads into our
  fsdp on 4 ranks with ``ckpt.load(verify=False)`` (a plain DCP directory has no
  manifest) and resumes identically;
* the same both ways between our ``fully_shard`` and torch's, from 2 ranks to 4 and
  to 1: ``ckpt.save`` of ours into torch's with ``dcp.load``, torch's ``dcp.save``
  into ours with ``ckpt.load``;
* a GPT2-style model whose output head is tied to its embedding: our state dicts have
  torch's keys (the tied optimizer state under ``emb.weight``, the first name
  ``named_parameters()`` yields) for ``fully_shard``, FSDP1 (both ``use_orig_params``)
  and DDP + zero_optim, and checkpoints move both ways, through ``get_state_dict`` +
  DCP and through ``ckpt.save``/``ckpt.load``, resuming exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import ckpt
from tests.ckpt._wrappers import LR, full_weights, same, tied_net, train, wrap
from tests.fsdp._common import Block, make_net
from tests.ranks import run_ranks


def _torch_fsdp1(seed: int, tied: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = TorchFSDP(
        tied_net(seed) if tied else make_net(seed),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=torch.device("cpu"),  # torch's FSDP1 on CPU (gloo) needs it spelled out
    )
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _torch_fsdp2(seed: int, tied: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = tied_net(seed) if tied else make_net(seed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _fsdp2_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _dcp_load(model: nn.Module, optim: torch.optim.Optimizer, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    # torch's FSDP1 gives a rank whose flat shards are all padding (4 ranks, tiny units)
    # an optimizer state dict without param groups, which a strict load reports missing.
    planner = dcp.DefaultLoadPlanner(allow_partial_load=True)
    dcp.load(state, checkpoint_id=str(path), planner=planner)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _rank_save(root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ours, ours_optim = wrap("fsdp")
    train(ours, ours_optim, 0, 3)
    ckpt.save({"model": ours, "optim": ours_optim}, Path(root) / "ours")
    theirs, theirs_optim = _torch_fsdp1(0)
    train(theirs, theirs_optim, 0, 3)
    msd, osd = get_state_dict(theirs, theirs_optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(Path(root) / "torch"))
    fs, fs_optim = wrap("fully_shard")
    train(fs, fs_optim, 0, 3)
    ckpt.save({"model": fs, "optim": fs_optim}, Path(root) / "ours_fully_shard")
    tfs, tfs_optim = _torch_fsdp2(0)
    train(tfs, tfs_optim, 0, 3)
    msd, osd = get_state_dict(tfs, tfs_optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(Path(root) / "torch_fully_shard"))
    return {
        "ours": (train(ours, ours_optim, 3, 5), full_weights(ours)),
        "torch": (train(theirs, theirs_optim, 3, 5), full_weights(theirs)),
        "ours_fully_shard": (train(fs, fs_optim, 3, 5), full_weights(fs)),
        "torch_fully_shard": (train(tfs, tfs_optim, 3, 5), _fsdp2_weights(tfs)),
    }


def _rank_load(root: str, expected: dict[str, Any]) -> dict[str, bool]:
    results = {}
    losses, weights = expected["ours_fully_shard"]
    model, optim = _torch_fsdp2(9)
    _dcp_load(model, optim, Path(root) / "ours_fully_shard")
    results["ours fully_shard -> torch fully_shard"] = train(model, optim, 3, 5) == losses and same(
        _fsdp2_weights(model), weights
    )
    losses, weights = expected["torch_fully_shard"]
    ours, ours_optim = wrap("fully_shard", seed=9)
    ckpt.load({"model": ours, "optim": ours_optim}, Path(root) / "torch_fully_shard", verify=False)
    results["torch fully_shard -> ours fully_shard"] = train(
        ours, ours_optim, 3, 5
    ) == losses and same(full_weights(ours), weights)
    if torch.distributed.get_world_size() == 1:
        return results  # torch's FSDP1 cases below need the 4-rank layout
    losses, weights = expected["ours"]
    model, optim = _torch_fsdp1(9)
    _dcp_load(model, optim, Path(root) / "ours")
    results["ours -> torch FSDP1"] = train(model, optim, 3, 5) == losses and same(
        full_weights(model), weights
    )
    model, optim = _torch_fsdp2(9)
    _dcp_load(model, optim, Path(root) / "ours")
    results["ours -> fully_shard"] = train(model, optim, 3, 5) == losses and same(
        _fsdp2_weights(model), weights
    )
    losses, weights = expected["torch"]
    ours, ours_optim = wrap("fsdp", seed=9)
    ckpt.load({"model": ours, "optim": ours_optim}, Path(root) / "torch", verify=False)
    results["torch FSDP1 -> ours"] = train(ours, ours_optim, 3, 5) == losses and same(
        full_weights(ours), weights
    )
    return results


def test_checkpoints_move_between_our_fsdp_and_torchs(tmp_path: Path) -> None:
    expected = run_ranks(_rank_save, 2, str(tmp_path), timeout=120)[0]
    # Ours and torch's train identically: the comparisons below are exact.
    assert expected["ours"][0] == expected["torch"][0]
    assert expected["ours_fully_shard"][0] == expected["torch_fully_shard"][0]
    for world_size in (4, 1):
        for results in run_ranks(_rank_load, world_size, str(tmp_path), expected, timeout=180):
            assert results and all(results.values()), (world_size, results)


# Our wrapper -> torch's, whose checkpoints it exchanges with ours in the tied test.
_TIED_PAIRS = {
    "fully_shard": "fully_shard",
    "fsdp": "FSDP1",
    "fsdp-orig": "FSDP1",
    "ddp-zero": "DDP",
}


def _torch_tied(kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    if kind == "fully_shard":
        return _torch_fsdp2(seed, tied=True)
    if kind == "FSDP1":
        return _torch_fsdp1(seed, tied=True)
    model = nn.parallel.DistributedDataParallel(tied_net(seed))
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _keys(msd: dict[str, Any], osd: dict[str, Any]) -> tuple[list[str], ...]:
    return (
        sorted(msd),
        sorted(osd["state"]),
        *(sorted(g["params"]) for g in osd["param_groups"]),
    )


def _ckpt_dcp_load(model: nn.Module, optim: torch.optim.Optimizer, path: Path) -> None:
    """``_dcp_load`` with our state-dict functions (a strict load)."""
    import torch.distributed.checkpoint as dcp

    msd, osd = ckpt.get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path))
    ckpt.set_state_dict(
        model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def _rank_tied(root: str) -> dict[str, bool]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as torch_sd

    full = ckpt.StateDictOptions(full_state_dict=True)
    results: dict[str, bool] = {}
    for kind, theirs_kind in _TIED_PAIRS.items():
        where = Path(root) / kind
        ours, ours_optim = wrap(kind, tied=True)
        theirs, theirs_optim = _torch_tied(theirs_kind, 0)
        train(ours, ours_optim, 0, 3)
        train(theirs, theirs_optim, 0, 3)
        ours_keys = _keys(*ckpt.get_state_dict(ours, ours_optim, options=full))
        theirs_keys = _keys(*torch_sd.get_state_dict(theirs, theirs_optim, options=full))
        results[f"{kind}: torch's keys"] = ours_keys == theirs_keys and "emb.weight" in ours_keys[1]
        msd, osd = ckpt.get_state_dict(ours, ours_optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(where / "ours_dcp"))
        ckpt.save({"model": ours, "optim": ours_optim}, where / "ours_ckpt")
        msd, osd = torch_sd.get_state_dict(theirs, theirs_optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(where / "torch"))
        losses, weights = train(ours, ours_optim, 3, 5), full_weights(ours)
        results[f"{kind}: trains as torch's {theirs_kind}"] = train(
            theirs, theirs_optim, 3, 5
        ) == losses and same(full_weights(theirs), weights)
        for source in ("ours_dcp", "ours_ckpt"):
            model, optim = _torch_tied(theirs_kind, 9)
            _dcp_load(model, optim, where / source)
            results[f"{kind} {source} -> torch {theirs_kind}"] = train(
                model, optim, 3, 5
            ) == losses and same(full_weights(model), weights)
        for load in ("set_state_dict", "ckpt.load"):
            model, optim = wrap(kind, seed=9, tied=True)
            if load == "set_state_dict":
                _ckpt_dcp_load(model, optim, where / "torch")
            else:
                ckpt.load({"model": model, "optim": optim}, where / "torch", verify=False)
            results[f"torch {theirs_kind} -> {kind} by {load}"] = train(
                model, optim, 3, 5
            ) == losses and same(full_weights(model), weights)
    return results


def test_tied_parameters_keep_torchs_names_and_checkpoints_move_both_ways(
    tmp_path: Path,
) -> None:
    for results in run_ranks(_rank_tied, 2, str(tmp_path), timeout=240):
        assert results and all(results.values()), {k: v for k, v in results.items() if not v}
