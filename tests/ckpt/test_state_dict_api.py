"""torch's state-dict API (``get_state_dict`` / ``set_state_dict`` and family) on our wrappers.

Each test trains, takes the state dicts with the API under test, writes them with
``dcp.save``, loads them into a differently seeded model with ``dcp.load`` and the
``set_*`` functions, and trains on: the losses and the final weights must equal an
uninterrupted run's exactly (every rank trains on the same batch, so the runs are
bit-identical, see ``_wrappers.py``). The API is torch's own functions after
``fsdp.torch_compat.install()`` / ``zero_optim.torch_compat.install()`` ("torch"),
or ckpt's imported directly ("ckpt"), for every ``StateDictOptions`` combination
that torch supports for FSDP1, on our FSDP1 (both ``use_orig_params``) and on DDP +
our ``ZeroRedundancyOptimizer``. Each wrapper runs every combination, half of them
one way and half the other, alternating between the wrappers so that on FSDP1 every
combination goes both ways (after ``install()`` the two are the same functions; the
install test checks that). The model has a frozen LayerNorm (``ln_f``, in the
root unit beside trainable parameters), so ``ignore_frozen_params`` leaves something
out.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
from tests.ckpt._wrappers import LR, full_weights, same, train
from tests.fsdp._common import Block, make_net
from tests.ranks import run_ranks

KINDS = ("fsdp", "fsdp-orig", "ddp-zero", "fully_shard")
OPTION_NAMES = (
    "full_state_dict",
    "cpu_offload",
    "broadcast_from_rank0",
    "strict",
    "flatten_optimizer_state_dict",
    "ignore_frozen_params",
)


def combos() -> list[dict[str, bool]]:
    """Every combination of the options torch's FSDP1 path supports (48):
    ``broadcast_from_rank0`` needs ``full_state_dict``."""
    out = []
    for values in itertools.product((False, True), repeat=len(OPTION_NAMES)):
        opts = dict(zip(OPTION_NAMES, values, strict=True))
        if opts["broadcast_from_rank0"] and not opts["full_state_dict"]:
            continue
        out.append(opts)
    return out


def build(kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The test model under ``kind``, ``ln_f`` frozen (LayerNorm's initial ones and
    zeros, the same for every seed), AdamW over all its parameters."""
    from fsdp.wrap import ModuleWrapPolicy
    from zero_optim import ZeroRedundancyOptimizer

    net = make_net(seed, n_blocks=1)  # DCP's cost grows with the entries: keep them few
    net.ln_f.requires_grad_(False)
    if kind == "fully_shard":
        from fsdp import fully_shard

        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
        return net, torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
    if kind == "ddp-zero":
        ddp = nn.parallel.DistributedDataParallel(net)
        return ddp, ZeroRedundancyOptimizer(
            ddp.parameters(), torch.optim.AdamW, lr=LR, weight_decay=0.1
        )
    model = FSDP(
        net, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=kind == "fsdp-orig"
    )
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def api(via: str) -> Any:
    """The module whose six functions and StateDictOptions the test calls."""
    if via == "torch":
        import fsdp.torch_compat
        import zero_optim.torch_compat

        fsdp.torch_compat.install()
        zero_optim.torch_compat.install()
        import torch.distributed.checkpoint.state_dict as torch_api

        return torch_api
    import ckpt

    return ckpt


def _rank0_holds(opts: dict[str, bool]) -> bool:
    """Full state dicts that only rank 0 holds (cpu_offload) or that rank 0 broadcasts
    back: rank 0 alone saves them and reads them back."""
    return opts["full_state_dict"] and (opts["cpu_offload"] or opts["broadcast_from_rank0"])


def _load_options(api_: Any, opts: dict[str, bool]) -> Any:
    """The options a resume loads with: the saving ones, except that a state dict only
    rank 0 holds is loaded by broadcast (the other ranks have nothing to load)."""
    options = api_.StateDictOptions(**opts)
    if _rank0_holds(opts):
        options = dataclasses.replace(options, broadcast_from_rank0=True)
    return options


def _set(api_: Any, opts: dict[str, bool], model: Any, given: dict[str, Any]) -> None:
    options = _load_options(api_, opts)
    if opts["ignore_frozen_params"] and opts["strict"]:
        # The frozen parameters are not in the checkpoint: a strict load says so.
        with pytest.raises(RuntimeError, match=r"Missing key.*ln_f\.weight"):
            api_.set_state_dict(
                *model,
                model_state_dict=given["model"],
                optim_state_dict=given["optim"],
                options=options,
            )
        options = dataclasses.replace(options, strict=False)
    result = api_.set_state_dict(
        *model, model_state_dict=given["model"], optim_state_dict=given["optim"], options=options
    )
    if given["model"] and isinstance(model[0], FSDP):
        # (DDP's model goes to torch's own function, which reports other keys.)
        missing = ["ln_f.bias", "ln_f.weight"] if opts["ignore_frozen_params"] else []
        assert sorted(result.missing_keys) == missing, result


def _resume_cases(
    api_: Any, kind: str, cases: list[dict[str, bool]], path: str, trained: Any
) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
    """Save ``trained`` under each combination, load each into a fresh model.

    All the combinations' state dicts go through one ``dcp.save`` and one ``dcp.load``,
    a key per combination (they are tiny, and DCP's cost is per entry either way).
    """
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    saved: dict[str, Any] = {}
    for i, opts in enumerate(cases):
        msd, osd = api_.get_state_dict(*trained, options=api_.StateDictOptions(**opts))
        # As torch's: values apart from the autograd graph (a save's capture keeps the
        # parameters themselves; what the API hands out never does).
        attached = [k for k, v in msd.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        assert not attached, f"{kind} {opts}: {attached[:3]} require grad"
        if rank == 0 or not _rank0_holds(opts):
            saved[f"case{i}"] = {"model": msd, "optim": osd}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(path, sync_files=False))
    fresh = [build(kind, seed=9) for _ in cases]
    loaded: dict[str, Any] = {}
    for i, (opts, model) in enumerate(zip(cases, fresh, strict=True)):
        msd, osd = api_.get_state_dict(*model, options=_load_options(api_, opts))
        if rank == 0 or not _rank0_holds(opts):
            loaded[f"case{i}"] = {"model": msd, "optim": osd}
    dcp.load(loaded, checkpoint_id=path)
    for i, (opts, model) in enumerate(zip(cases, fresh, strict=True)):
        _set(api_, opts, model, loaded.get(f"case{i}", {"model": {}, "optim": {}}))
    return fresh


def _rank_resume_every_combination(root: str, kind: str) -> dict[str, int | list[str]]:
    """Every combination on ``kind``, half through ckpt's functions (before install()),
    half through torch's names (after it), alternating so that across fsdp's two
    ``use_orig_params`` settings each combination goes both ways."""
    reference = build(kind, seed=0)
    expected = train(*reference, 0, 5)[3:]
    weights = full_weights(reference[0])
    trained = build(kind, seed=0)
    train(*trained, 0, 3)
    offset = KINDS.index(kind)
    failures: list[str] = []
    counts = {}
    for via in ("ckpt", "torch"):
        api_ = api(via)  # "torch" installs: from then on torch's names hold ckpt's functions
        mine = [c for i, c in enumerate(combos()) if (i + offset) % 2 == (via == "torch")]
        resumed = _resume_cases(api_, kind, mine, f"{root}/{via}", trained)
        for opts, model in zip(mine, resumed, strict=True):
            losses = train(*model, 3, 5)
            if losses != expected or not same(full_weights(model[0]), weights):
                failures.append(f"{via} {opts}: losses {losses} != {expected} or weights differ")
        counts[via] = len(mine)
    return {**counts, "failures": failures}


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_exact_resume_for_every_option_combination(tmp_path: Path, kind: str) -> None:
    assert len(combos()) == 48
    for result in run_ranks(_rank_resume_every_combination, 2, str(tmp_path), kind, timeout=240):
        assert result == {"ckpt": 24, "torch": 24, "failures": []}, result


# --- checkpoints that move between ours and torch's, 2 -> 1 and 2 -> 4 ranks ---------------


def _torch_fsdp1(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = TorchFSDP(
        make_net(seed),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        device_id=torch.device("cpu"),  # torch's FSDP1 on CPU (gloo) needs it spelled out
    )
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _torch_fsdp2(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = make_net(seed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):  # fully_shard
        return {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()
        }
    return full_weights(model)


def _dcp_save(api_: Any, model: Any, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    msd, osd = api_.get_state_dict(*model)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))


def _dcp_load(api_: Any, model: Any, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    msd, osd = api_.get_state_dict(*model)
    state = {"model": msd, "optim": osd}
    # torch's FSDP1 gives a rank whose flat shards are all padding (4 ranks, tiny units)
    # an optimizer state dict without param groups, which a strict load reports missing.
    dcp.load(
        state, checkpoint_id=str(path), planner=dcp.DefaultLoadPlanner(allow_partial_load=True)
    )
    api_.set_state_dict(*model, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _rank_write(root: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """At 2 ranks: the same training written by ours and by torch's, 3 steps each."""
    import torch.distributed.checkpoint.state_dict as torch_api

    import ckpt
    from tests.ckpt._wrappers import wrap

    out = Path(root)
    for name, make in (("torch-fsdp1", _torch_fsdp1), ("torch-fsdp2", _torch_fsdp2)):
        model = make(0)
        train(*model, 0, 3)
        _dcp_save(torch_api, model, out / name)
    model = wrap("fsdp")
    train(*model, 0, 3)
    _dcp_save(ckpt, model, out / "ours-fsdp")
    ckpt.save({"model": model[0], "optim": model[1]}, out / "ckpt-save")
    model = wrap("ddp-zero")
    train(*model, 0, 3)
    _dcp_save(ckpt, model, out / "ours-zero")
    model = wrap("fsdp-orig")
    train(*model, 0, 3)
    _dcp_save(api("torch"), model, out / "ours-orig")  # torch's function, installed
    reference = wrap("fsdp")
    losses = train(*reference, 0, 5)[3:]
    return losses, full_weights(reference[0])


def _rank_read(root: str, expected: tuple[list[float], dict[str, torch.Tensor]]) -> list[str]:
    """Each checkpoint into each reader of the other side, then 2 more steps."""
    import torch.distributed.checkpoint.state_dict as torch_api

    import ckpt
    from tests.ckpt._wrappers import wrap

    losses, weights = expected
    out = Path(root)
    results: dict[str, bool] = {}

    def check(name: str, model: Any) -> None:
        results[name] = train(*model, 3, 5) == losses and same(_weights(model[0]), weights)

    for source in ("ours-fsdp", "ours-orig", "ours-zero"):
        for reader, make in (("torch FSDP1", _torch_fsdp1), ("fully_shard", _torch_fsdp2)):
            model = make(9)
            _dcp_load(torch_api, model, out / source)
            check(f"{source} -> {reader}", model)
        model = wrap("fsdp", seed=9)
        ckpt.load({"model": model[0], "optim": model[1]}, out / source, verify=False)
        check(f"{source} -> ckpt.load", model)
    for source in ("torch-fsdp1", "torch-fsdp2", "ckpt-save"):
        for kind in ("fsdp", "ddp-zero"):
            model = wrap(kind, seed=9)
            _dcp_load(ckpt, model, out / source)
            check(f"{source} -> ours {kind} (ckpt.set_state_dict)", model)
    # Last: install() puts our FSDP1 under torch's name in this process.
    installed_api = api("torch")
    for source in ("torch-fsdp1", "torch-fsdp2", "ckpt-save"):
        model = wrap("fsdp-orig", seed=9)
        _dcp_load(installed_api, model, out / source)
        check(f"{source} -> ours fsdp-orig (torch's set_state_dict, installed)", model)
    return [name for name, ok in results.items() if not ok] + [f"{len(results)} loads"]


@pytest.mark.slow
def test_checkpoints_move_between_ours_and_torchs_at_other_world_sizes(tmp_path: Path) -> None:
    expected = run_ranks(_rank_write, 2, str(tmp_path), timeout=120)[0]
    for world_size in (1, 4):
        for failures in run_ranks(_rank_read, world_size, str(tmp_path), expected, timeout=240):
            assert failures == ["18 loads"], (world_size, failures)


# --- mistakes: the same error on every rank, never a hang ------------------------------------


def _raises(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # the case under test
        return type(e).__name__, str(e)
    return "no error", ""


def _rank_mistakes(root: str) -> dict[str, tuple[str, str]]:
    import torch.distributed.checkpoint as dcp

    import ckpt
    from tests.ckpt._wrappers import wrap

    rank = dist.get_rank()
    out: dict[str, tuple[str, str]] = {}
    model, optim = wrap("fsdp")
    train(model, optim, 0, 1)
    options = ckpt.StateDictOptions
    out["broadcast without full"] = _raises(
        lambda: ckpt.get_state_dict(model, optim, options=options(broadcast_from_rank0=True))
    )
    out["options of another type"] = _raises(
        lambda: ckpt.get_model_state_dict(model, options={"full_state_dict": True})  # type: ignore[arg-type]
    )
    msd, osd = ckpt.get_state_dict(model, optim)
    out["rank 1 passes nothing"] = _raises(
        lambda: ckpt.set_model_state_dict(model, msd if rank == 0 else {})
    )
    full = options(full_state_dict=True, cpu_offload=True)
    fmsd, fosd = ckpt.get_state_dict(model, optim, options=full)
    out["rank0-only state loaded without broadcast"] = _raises(
        lambda: ckpt.set_state_dict(
            model, optim, model_state_dict=fmsd, optim_state_dict=fosd, options=full
        )
    )
    out["optimizer state keyed by ids"] = _raises(
        lambda: ckpt.set_optimizer_state_dict(model, optim, optim.state_dict())
    )
    lacking = {"state": dict(osd["state"]), "param_groups": osd["param_groups"]}
    del lacking["state"]["head.weight"]
    out["strict with a parameter's state missing"] = _raises(
        lambda: ckpt.set_optimizer_state_dict(model, optim, lacking)
    )
    flat = ckpt.get_optimizer_state_dict(
        model, optim, options=options(flatten_optimizer_state_dict=True)
    )
    out["flattened with a foreign key"] = _raises(
        lambda: ckpt.set_optimizer_state_dict(model, optim, {**flat, "bogus.key": 1})
    )
    # Only rank 0 holds (and nests) a broadcast dict: its error reaches every rank.
    full_flat = options(
        full_state_dict=True, broadcast_from_rank0=True, flatten_optimizer_state_dict=True
    )
    bad = {**flat, "bogus.key": 1} if rank == 0 else {}
    out["broadcast flattened with a foreign key"] = _raises(
        lambda: ckpt.set_optimizer_state_dict(model, optim, bad, options=full_flat)
    )
    # Nothing above changed the model: a load that does not raise still resumes.
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root)
    ckpt.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    out["still trains"] = ("no error", str(train(model, optim, 1, 2)))
    # torch's deprecated optim_input: a warning in torch's words, the same result.
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    with pytest.warns(UserWarning, match="The `optim_input` argument is deprecated"):
        with_input = FSDP.full_optim_state_dict(
            model, optim, optim_input=list(model.parameters()), rank0_only=False
        )
    plain = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    out["optim_input"] = ("no error", str(with_input["state"].keys() == plain["state"].keys()))
    return out


def test_mistakes_raise_the_same_error_on_every_rank(tmp_path: Path) -> None:
    expected = {
        "broadcast without full": (
            "ValueError",
            "full_state_dict must be True when broadcast_from_rank0 is True",
        ),
        "options of another type": ("TypeError", "options must be a StateDictOptions"),
        "rank 1 passes nothing": (
            "ValueError",
            "rank 1 passed an empty model state dict and the other ranks did not.*every rank "
            "loads or none does",
        ),
        "rank0-only state loaded without broadcast": (
            "ValueError",
            "ranks? 1 passed an empty .* state dict.*broadcast_from_rank0=True",
        ),
        "optimizer state keyed by ids": ("ValueError", "keyed by parameter ids.*rekey"),
        "strict with a parameter's state missing": (
            "RuntimeError",
            r"Missing optimizer state for parameter 'head\.weight' in checkpoint.*"
            r"StateDictOptions\(strict=False\)",
        ),
        "flattened with a foreign key": ("ValueError", "'bogus.key' is neither"),
        "broadcast flattened with a foreign key": ("ValueError", "'bogus.key' is neither"),
        "optim_input": ("no error", "True"),
    }
    for rank, out in enumerate(run_ranks(_rank_mistakes, 2, str(tmp_path), timeout=120)):
        for name, (etype, pattern) in expected.items():
            assert out[name][0] == etype and re.search(pattern, out[name][1], re.S), (
                rank,
                name,
                out[name],
            )
        assert out["still trains"][0] == "no error"


# --- install(): torch's names hold ckpt's functions, and uninstall() puts torch's back --------


def test_install_rebinds_torchs_names_and_uninstall_restores_them() -> None:
    import sys
    import types

    import torch.distributed.checkpoint.state_dict as torch_api

    import ckpt
    import ckpt.torch_compat
    import fsdp.torch_compat
    import zero_optim.torch_compat

    torch_get = torch_api.get_state_dict
    client = types.ModuleType("_client_that_imported_early")
    client.gsd = (
        torch_get  # from torch.distributed.checkpoint.state_dict import get_state_dict as gsd
    )
    sys.modules[client.__name__] = client
    assert not ckpt.torch_compat.installed()
    try:
        fsdp.torch_compat.install()
        zero_optim.torch_compat.install()
        assert torch_api.get_state_dict is ckpt.get_state_dict
        assert torch_api.set_optimizer_state_dict is ckpt.set_optimizer_state_dict
        assert client.gsd is ckpt.get_state_dict
        assert torch_api.StateDictOptions is ckpt.StateDictOptions
        # One holder leaving keeps them: zero_optim's install still needs them.
        fsdp.torch_compat.uninstall()
        assert torch_api.get_state_dict is ckpt.get_state_dict
        zero_optim.torch_compat.uninstall()
        assert torch_api.get_state_dict is torch_get and client.gsd is torch_get
        assert not ckpt.torch_compat.installed()
    finally:
        fsdp.torch_compat.uninstall()
        zero_optim.torch_compat.uninstall()
        del sys.modules[client.__name__]
