"""``use_orig_params=True``: the original parameters as views of the shard, vs DDP and FSDP1.

One spawn per world size trains every configuration for 8 AdamW steps with
two parameter groups (weight decay off for norms and biases, chosen by the
original names) and compares losses and final full parameters with DDP and
with torch's FSDP1 (``use_orig_params=True``, same settings). The same
tolerances as ``test_parity.py`` apply: bit equality where the arithmetic is
the same, 1e-5 where the reduction order legitimately differs (world size 4,
accumulation outside ``no_sync``, clipping). Against FSDP1 everything is
bit-equal except clipping and world size 4: FSDP1 pads each original parameter to a 16-byte
boundary under ``use_orig_params``, so its shards (and so the partial sums of
the gradient norm, and the order in which gloo sums four ranks' gradients)
are cut elsewhere than ours.

A second spawn checks the surface: names, identity and shapes of the
original parameters in each state, gradient views, ``zero_grad``, writes to
parameters and gradients, ``summon_full_params`` with and without
``with_grads``, the state dict, bf16 mixed precision against FSDP1 (bit-equal),
an optimizer built before wrapping, and size-based auto-wrapping. Further
spawns: the error paths; ckpt's state-dict types (SHARDED, LOCAL, FULL with
offload) round-tripping, also into ``use_orig_params=False``; and at world
size 4 the composition with hybrid sharding 2x2 (vs DDP and FSDP1), meta-device
init, ``sync_module_states`` (equal to ``use_orig_params=False``) and
``ignored_modules`` (vs FSDP1).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from tests.fsdp._common import Block, batches, full_params, loss_fn, make_net, max_diff, train
from tests.ranks import run_ranks

STEPS = 8

# name -> (FSDP settings, train settings)
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "full": ({"sharding_strategy": "FULL_SHARD"}, {}),
    "full_wrap": ({"sharding_strategy": "FULL_SHARD", "wrap": True}, {}),
    "sgo_wrap": ({"sharding_strategy": "SHARD_GRAD_OP", "wrap": True}, {}),
    "noshard_wrap": ({"sharding_strategy": "NO_SHARD", "wrap": True}, {}),
    "full_wrap_frozen": ({"sharding_strategy": "FULL_SHARD", "wrap": True, "frozen": True}, {}),
    "noshard_frozen": ({"sharding_strategy": "NO_SHARD", "frozen": True}, {}),
    "full_wrap_post_fwdprefetch": (
        {
            "sharding_strategy": "FULL_SHARD",
            "wrap": True,
            "backward_prefetch": "BACKWARD_POST",
            "forward_prefetch": True,
        },
        {},
    ),
    "full_wrap_offload": ({"sharding_strategy": "FULL_SHARD", "wrap": True, "offload": True}, {}),
    "full_wrap_nosync": (
        {"sharding_strategy": "FULL_SHARD", "wrap": True},
        {"accumulate": 2, "no_sync": True},
    ),
    "sgo_wrap_nosync": (
        {"sharding_strategy": "SHARD_GRAD_OP", "wrap": True},
        {"accumulate": 2, "no_sync": True},
    ),
    "noshard_nosync": ({"sharding_strategy": "NO_SHARD"}, {"accumulate": 2, "no_sync": True}),
    "full_wrap_accumulate": ({"sharding_strategy": "FULL_SHARD", "wrap": True}, {"accumulate": 2}),
    "full_wrap_clip": ({"sharding_strategy": "FULL_SHARD", "wrap": True}, {"clip": 0.05}),
    "noshard_clip": ({"sharding_strategy": "NO_SHARD"}, {"clip": 0.05}),
    "full_wrap_frozen_clip": (
        {"sharding_strategy": "FULL_SHARD", "wrap": True, "frozen": True},
        {"clip": 0.05},
    ),
    "full_wrap_zero_to_zeros": (  # zero_grad(set_to_none=False): views zeroed in place
        {"sharding_strategy": "FULL_SHARD", "wrap": True},
        {"set_to_none": False},
    ),
}


def no_decay(name: str) -> bool:
    """Norms and biases train without weight decay (chosen by the original name)."""
    return name.endswith("bias") or ".ln" in name or name.startswith("ln")


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups with different hyperparameters; frozen parameters left out."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and not no_decay(n)]
    other = [p for n, p in model.named_parameters() if p.requires_grad and no_decay(n)]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": other, "weight_decay": 0.0, "lr": 5e-3},
    ]


def freeze(model: nn.Module) -> nn.Module:
    """Freeze some parameters so that units mix frozen and trainable ones."""
    net: Any = model
    net.blocks[0].fc1.weight.requires_grad_(False)
    net.blocks[1].ln.weight.requires_grad_(False)
    net.blocks[1].ln.bias.requires_grad_(False)
    net.emb.weight.requires_grad_(False)
    return model


def train_groups(
    model: nn.Module,
    data: list[tuple[Tensor, Tensor]],
    *,
    accumulate: int = 1,
    no_sync: bool = False,
    clip: float | None = None,
    clip_fn: Callable[[float], Any] | None = None,
    set_to_none: bool = True,
) -> tuple[list[float], list[float]]:
    """AdamW with two parameter groups; returns losses and clip norms."""
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    losses: list[float] = []
    norms: list[float] = []
    it = iter(data)
    for _ in range(len(data) // accumulate):
        for micro in range(accumulate):
            x, y = next(it)
            last = micro == accumulate - 1
            ctx: AbstractContextManager[Any] = (
                model.no_sync() if (no_sync and not last) else nullcontext()  # type: ignore[operator]
            )
            with ctx:
                loss = loss_fn(model(x), y)
                loss.backward()
            losses.append(loss.item())
        if clip is not None:
            assert clip_fn is not None
            norms.append(float(clip_fn(clip)))
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return losses, norms


def fsdp_kwargs(spec: dict[str, Any], api: Any, wrap_mod: Any) -> dict[str, Any]:
    """Constructor arguments for ours (``api=fsdp``) or torch's FSDP1."""
    kw: dict[str, Any] = {
        "sharding_strategy": api.ShardingStrategy[spec["sharding_strategy"]],
        "device_id": torch.device("cuda" if torch.cuda.is_available() else "cpu"),
        "use_orig_params": True,
    }
    if spec.get("wrap"):
        kw["auto_wrap_policy"] = wrap_mod.ModuleWrapPolicy({Block})
    if "backward_prefetch" in spec:
        kw["backward_prefetch"] = api.BackwardPrefetch[spec["backward_prefetch"]]
    if "forward_prefetch" in spec:
        kw["forward_prefetch"] = spec["forward_prefetch"]
    if spec.get("offload"):
        kw["cpu_offload"] = api.CPUOffload(offload_params=True)
    return kw


def _net(spec: dict[str, Any]) -> nn.Module:
    net = make_net()
    return freeze(net) if spec.get("frozen") else net


def _run_config(name: str) -> dict[str, Any]:
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.wrap as torch_wrap

    import fsdp
    import fsdp.wrap

    spec, train_kw = CONFIGS[name]
    data = batches(STEPS)
    out: dict[str, Any] = {}

    ddp = DDP(_net(spec))
    clip_ddp = lambda c: torch.nn.utils.clip_grad_norm_(ddp.parameters(), c)  # noqa: E731
    out["ddp"] = train_groups(ddp, data, clip_fn=clip_ddp, **train_kw), full_params(ddp)

    ours = fsdp.FullyShardedDataParallel(_net(spec), **fsdp_kwargs(spec, fsdp, fsdp.wrap))
    out["ours"] = (
        train_groups(ours, data, clip_fn=ours.clip_grad_norm_, **train_kw),
        full_params(ours),
    )
    if spec.get("offload") and not torch.cuda.is_available():
        return out  # torch's FSDP1 pins memory for CPU offload, which needs CUDA
    theirs = torch_fsdp.FullyShardedDataParallel(
        _net(spec), **fsdp_kwargs(spec, torch_fsdp, torch_wrap)
    )
    out["torch"] = (
        train_groups(theirs, data, clip_fn=theirs.clip_grad_norm_, **train_kw),
        full_params(theirs),
    )
    return out


def _rank_parity() -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for name in CONFIGS:
        out = _run_config(name)
        (ddp_losses, ddp_norms), ddp_params = out["ddp"]
        (losses, norms), params = out["ours"]
        r: dict[str, Any] = {
            "loss_vs_ddp": max(abs(a - b) for a, b in zip(losses, ddp_losses, strict=True)),
            "norm_vs_ddp": max(
                (abs(a - b) for a, b in zip(norms, ddp_norms, strict=True)), default=0
            ),
            "param_vs_ddp": max_diff(params, ddp_params),
            "ddp_changed": max_diff(params, full_params(make_net())),
            "frozen_changed": max_diff(
                {k: v for k, v in params.items() if k in ("emb.weight", "blocks.0.fc1.weight")},
                {
                    k: v
                    for k, v in full_params(make_net()).items()
                    if k in ("emb.weight", "blocks.0.fc1.weight")
                },
            ),
        }
        if "torch" in out:
            (t_losses, t_norms), t_params = out["torch"]
            r["loss_vs_torch"] = max(abs(a - b) for a, b in zip(losses, t_losses, strict=True))
            r["norm_vs_torch"] = max(
                (abs(a - b) for a, b in zip(norms, t_norms, strict=True)), default=0
            )
            r["param_vs_torch"] = max_diff(params, t_params)
        results[name] = r
    dist.barrier()
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_orig_params_parity_with_ddp_and_torch_fsdp(world_size: int) -> None:
    results = run_ranks(_rank_parity, world_size, timeout=300)
    for rank, per_config in enumerate(results):
        for name, r in per_config.items():
            where = f"rank {rank}, config {name}: {r}"
            spec, train_kw = CONFIGS[name]
            assert r["ddp_changed"] > 1e-3, where  # training did move the parameters
            if spec.get("frozen"):
                assert r["frozen_changed"] == 0.0, where
            reordered = (
                world_size == 4
                or "clip" in train_kw
                or (train_kw.get("accumulate", 1) > 1 and not train_kw.get("no_sync"))
            )
            tol = 1e-5 if reordered else 0.0
            assert r["loss_vs_ddp"] <= tol, where
            assert r["param_vs_ddp"] <= tol, where
            assert r["norm_vs_ddp"] <= 1e-5, where
            if "loss_vs_torch" in r:
                # FSDP1 pads each original parameter to 16 bytes under use_orig_params,
                # so its shards split the norm's sum (and gloo's 4-way sums) differently.
                torch_tol = 1e-5 if ("clip" in train_kw or world_size == 4) else 0.0
                assert r["loss_vs_torch"] <= torch_tol, where
                assert r["param_vs_torch"] <= torch_tol, where
                assert r["norm_vs_torch"] <= torch_tol, where


# ------------------------------------------------------------------ the surface, one spawn


def _wrap_ours(net: nn.Module, strategy: str = "FULL_SHARD", **kw: Any) -> Any:
    import fsdp
    import fsdp.wrap

    return fsdp.FullyShardedDataParallel(
        net,
        sharding_strategy=fsdp.ShardingStrategy[strategy],
        auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({Block}),
        use_orig_params=True,
        **kw,
    )


def _surface_names_and_views() -> dict[str, Any]:
    net = freeze(make_net())
    before = [(n, p) for n, p in net.named_parameters()]
    model = _wrap_ours(net)
    after = list(model.named_parameters())
    model.check_is_root()  # lazy init: the shared context exists from here
    flat_storages = {  # a unit's frozen part has a FlatParameter of its own
        part.flat_param.untyped_storage().data_ptr()
        for s in model._fsdp_state.ctx.states
        if s.unit is not None
        for part in s.unit.parts()
    }
    numels = torch.tensor([p.numel() for _, p in after])
    dist.all_reduce(numels)
    seen: dict[str, Any] = {}

    def hook(m: nn.Module, args: Any, output: Any) -> None:
        seen["fc1_weight_in_forward"] = tuple(m.weight.shape)
        seen["fc1_weight_is_param"] = isinstance(m.weight, nn.Parameter)

    model.module.blocks[0].module.fc1.register_forward_hook(hook)
    x, y = batches(1)[0]
    loss_fn(model(x), y).backward()
    return {
        "names_equal": [n for n, _ in before] == [n for n, _ in after],
        "same_objects": all(a is b for (_, a), (_, b) in zip(before, after, strict=True)),
        "all_1d": all(p.dim() == 1 for _, p in after),
        "numels_sum_to_original": numels.tolist()
        == [p.numel() for _, p in make_net().named_parameters()],
        "some_empty": any(p.numel() == 0 for _, p in after),
        "views_of_flat": all(
            p.untyped_storage().data_ptr() in flat_storages for _, p in after if p.numel() > 0
        ),
        "no_flat_param_listed": not any("_flat_param" in n for n in dict(model.named_parameters())),
        "getattr_is_orig": model.module.head.weight is dict(after)["head.weight"],
        "grad_shapes_match": all(p.grad is None or p.grad.shape == p.shape for _, p in after),
        "frozen_grad_none": all(p.grad is None for _, p in after if not p.requires_grad),
        "trainable_local_have_grads": all(
            p.grad is not None for _, p in after if p.requires_grad and p.numel() > 0
        ),
        **seen,
    }


def _surface_grads_vs_ddp() -> dict[str, Any]:
    import fsdp

    data = batches(2)
    ddp = DDP(make_net())
    model = _wrap_ours(make_net())
    out: dict[str, Any] = {}
    for x, y in data[:1]:
        loss_fn(ddp(x), y).backward()
        loss_fn(model(x), y).backward()
    ref = {n.removeprefix("module."): p.grad for n, p in ddp.named_parameters()}
    with fsdp.FullyShardedDataParallel.summon_full_params(model, with_grads=True):
        full = {n: (p.shape, p.grad.clone()) for n, p in model.named_parameters()}
    out["with_grads_shapes"] = all(full[n][0] == ref[n].shape for n in ref)
    out["with_grads_vs_ddp"] = max((full[n][1] - ref[n]).abs().max().item() for n in ref)
    out["sharded_after_summon"] = all(p.dim() == 1 for p in model.parameters())
    # zero_grad between forward and backward: no stale gradient survives.
    x, y = data[1]
    loss = loss_fn(model(x), y)
    model.zero_grad(set_to_none=True)
    loss.backward()
    ddp.zero_grad(set_to_none=True)
    loss_fn(ddp(x), y).backward()
    ref = {n.removeprefix("module."): p.grad for n, p in ddp.named_parameters()}
    with fsdp.FullyShardedDataParallel.summon_full_params(model, with_grads=True):
        out["zero_between_vs_ddp"] = max(
            (p.grad - ref[n]).abs().max().item() for n, p in model.named_parameters()
        )
    # Setting one gradient to None leaves its piece out of the next accumulation.
    model.module.head.weight.grad = None
    loss_fn(model(x), y).backward()
    with fsdp.FullyShardedDataParallel.summon_full_params(model, with_grads=True):
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
    out["one_none_head"] = (got["head.weight"] - ref["head.weight"]).abs().max().item()
    out["one_none_other"] = (got["head.bias"] - 2 * ref["head.bias"]).abs().max().item()
    # with_grads + writeback: gradients written in the summon persist (sharded).
    with fsdp.FullyShardedDataParallel.summon_full_params(model, with_grads=True):
        model.module.head.bias.grad.fill_(7.0)
    with fsdp.FullyShardedDataParallel.summon_full_params(model, with_grads=True):
        out["grad_writeback"] = model.module.head.bias.grad.tolist()
    return out


def _surface_size_based_policy() -> dict[str, Any]:
    # The original parameters of units already made are not counted again.
    import functools

    import fsdp
    import fsdp.wrap

    policy = functools.partial(fsdp.wrap.size_based_auto_wrap_policy, min_num_params=150)
    units = {}
    for orig in (False, True):
        model = fsdp.FullyShardedDataParallel(
            make_net(), auto_wrap_policy=policy, use_orig_params=orig
        )
        units[orig] = [
            type(m.module).__name__ for m in fsdp.FullyShardedDataParallel.fsdp_modules(model)
        ]
    return {"same_units": units[False] == units[True], "units": units[True]}


def _surface_writes() -> dict[str, Any]:
    import fsdp

    model = _wrap_ours(make_net())
    out: dict[str, Any] = {}
    ref = full_params(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # in place, as an optimizer does
    got = full_params(model)
    out["inplace_lands"] = max((got[k] - (ref[k] + 1.0)).abs().max().item() for k in ref)
    w = model.module.blocks[1].module.fc2.weight
    w.data = torch.full_like(w.data, 5.0)  # a new tensor: copied back at the next use
    x, _ = batches(1)[0]
    model(x)
    with fsdp.FullyShardedDataParallel.summon_full_params(model):
        out["replaced_data_lands"] = model.module.blocks[1].module.fc2.weight.unique().tolist()
        with torch.no_grad():
            model.module.emb.weight.zero_()  # full parameters written in the summon persist
    out["summon_writeback"] = model.module.emb.weight.abs().sum().item()
    sd = model.state_dict()
    out["state_dict_keys"] = list(sd) == list(make_net().state_dict())
    target = make_net(seed=3).state_dict()
    model.load_state_dict(target)
    got = full_params(model)
    out["load_state_dict"] = max((got[k] - target[k]).abs().max().item() for k in got)
    return out


def _surface_optimizer_before_wrapping() -> dict[str, Any]:
    # The original Parameter objects survive wrapping, so an optimizer built
    # before (without state yet) steps the shards as well as one built after.
    data = batches(4)
    net = make_net()
    opt = torch.optim.AdamW(param_groups(net), lr=1e-2)
    model = _wrap_ours(net)
    losses = []
    for x, y in data:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ref, _ = train_groups(_wrap_ours(make_net()), data)
    return {"before_vs_after": max(abs(a - b) for a, b in zip(losses, ref, strict=True))}


def _surface_mixed_precision() -> dict[str, Any]:
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.wrap as torch_wrap

    import fsdp
    import fsdp.wrap

    out: dict[str, Any] = {}
    data = batches(5)
    bf16 = torch.bfloat16
    for name, mp in {
        "bf16": {"param_dtype": bf16, "reduce_dtype": bf16, "buffer_dtype": bf16},
        "bf16_reduce_fp32": {"param_dtype": bf16, "reduce_dtype": torch.float32},
        "bf16_keep_low": {"param_dtype": bf16, "keep_low_precision_grads": True},
    }.items():
        models = []
        for api, wrap_mod in ((fsdp, fsdp.wrap), (torch_fsdp, torch_wrap)):
            models.append(
                api.FullyShardedDataParallel(
                    make_net(),
                    auto_wrap_policy=wrap_mod.ModuleWrapPolicy({Block}),
                    mixed_precision=api.MixedPrecision(**mp),
                    device_id=torch.device("cpu"),
                    use_orig_params=True,
                )
            )
        ours, theirs = models
        low = mp.get("keep_low_precision_grads", False)  # AdamW cannot step bf16 grads
        losses, _ = train_groups(ours, data) if not low else ([0.0], [])
        t_losses, _ = train_groups(theirs, data) if not low else ([0.0], [])
        loss_fn(ours(data[0][0]), data[0][1]).backward()
        out[name] = {
            "loss": max(abs(a - b) for a, b in zip(losses, t_losses, strict=True)),
            "param": max_diff(full_params(ours), full_params(theirs)),
            "param_dtypes": sorted({str(p.dtype) for p in ours.parameters()}),
            "grad_dtypes": sorted(
                {str(p.grad.dtype) for p in ours.parameters() if p.grad is not None}
            ),
        }
    return out


def _rank_surface() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fn in (
        _surface_names_and_views,
        _surface_grads_vs_ddp,
        _surface_writes,
        _surface_size_based_policy,
        _surface_optimizer_before_wrapping,
        _surface_mixed_precision,
    ):
        out[fn.__name__.removeprefix("_surface_")] = fn()
        dist.barrier()
    return out


def test_orig_params_surface() -> None:
    results = run_ranks(_rank_surface, 2, timeout=180)
    for rank, r in enumerate(results):
        where = f"rank {rank}: {r}"
        nv = r["names_and_views"]
        for key in (
            "names_equal",
            "same_objects",
            "all_1d",
            "numels_sum_to_original",
            "views_of_flat",
            "no_flat_param_listed",
            "getattr_is_orig",
            "grad_shapes_match",
            "frozen_grad_none",
            "trainable_local_have_grads",
        ):
            assert nv[key] is True, (key, where)
        assert nv["fc1_weight_in_forward"] == (13, 6), where
        assert nv["fc1_weight_is_param"] is False, where  # a view of the gathered data
        g = r["grads_vs_ddp"]
        assert g["with_grads_shapes"] and g["sharded_after_summon"], where
        assert g["with_grads_vs_ddp"] == 0.0, where
        assert g["zero_between_vs_ddp"] == 0.0, where
        assert g["one_none_head"] == 0.0, where  # only the new gradient
        assert g["one_none_other"] == 0.0, where  # the others accumulated
        assert g["grad_writeback"] == [7.0] * 13, where
        w = r["writes"]
        assert w["inplace_lands"] == 0.0, where
        assert w["replaced_data_lands"] == [5.0], where
        assert w["summon_writeback"] == 0.0, where
        assert w["state_dict_keys"] is True, where
        assert w["load_state_dict"] == 0.0, where
        assert r["optimizer_before_wrapping"]["before_vs_after"] == 0.0, where
        assert r["size_based_policy"]["same_units"] is True, where
        assert len(r["size_based_policy"]["units"]) > 2, where
        for name, m in r["mixed_precision"].items():
            assert m["loss"] == 0.0 and m["param"] == 0.0, (name, where)
            assert m["param_dtypes"] == ["torch.float32"], (name, where)
            low = name == "bf16_keep_low"
            assert m["grad_dtypes"] == ["torch.bfloat16" if low else "torch.float32"], where
    some_empty = [r["names_and_views"]["some_empty"] for r in results]
    assert any(some_empty), "the model should leave some parameter empty on some rank"


# ------------------------------------------------------------------ errors, one spawn


def _error_mixed_instances() -> None:
    import fsdp

    net = make_net()
    net.blocks[0] = fsdp.FullyShardedDataParallel(net.blocks[0], use_orig_params=False)
    model = fsdp.FullyShardedDataParallel(net, use_orig_params=True)
    model(batches(1)[0][0])


def _error_param_replaced() -> None:
    model = _wrap_ours(make_net())
    model.module.head.weight = nn.Parameter(torch.zeros(VOCAB_DIM))
    model(batches(1)[0][0])


def _error_data_wrong_shape() -> None:
    model = _wrap_ours(make_net())
    model.module.head.weight.data = torch.zeros(VOCAB_DIM)  # the full shape, not the piece
    model(batches(1)[0][0])


def _error_with_grads_offload() -> None:
    import fsdp

    with fsdp.FullyShardedDataParallel.summon_full_params(
        _wrap_ours(make_net()), with_grads=True, offload_to_cpu=True
    ):
        pass


VOCAB_DIM = (13, 6)  # head.weight's full shape

ERRORS: dict[str, tuple[Callable[[], None], type[Exception], str]] = {
    "mixed_instances": (_error_mixed_instances, ValueError, "mix use_orig_params=True and False"),
    "param_replaced": (
        _error_param_replaced,
        RuntimeError,
        "'head.weight' was replaced on its module.*in place",
    ),
    "data_wrong_shape": (
        _error_data_wrong_shape,
        RuntimeError,
        r"'head.weight' was given data of shape \(13, 6\).*summon_full_params",
    ),
    "with_grads_offload": (
        _error_with_grads_offload,
        NotImplementedError,
        "with_grads=True, offload_to_cpu=True",
    ),
}


def _rank_errors() -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    for name, (fn, _, _) in ERRORS.items():
        try:
            fn()
            out[name] = ("no error", "")
        except Exception as e:  # the case under test
            out[name] = (type(e).__name__, str(e))
        dist.barrier()
    return out


def test_orig_params_errors() -> None:
    import re

    for out in run_ranks(_rank_errors, 2, timeout=60):
        for name, (_, etype, pattern) in ERRORS.items():
            got_type, message = out[name]
            assert got_type == etype.__name__, (name, got_type, message)
            assert re.search(pattern, message, re.DOTALL), (name, pattern, message)


# ------------------------------------------------------------------ ckpt state-dict types


def _rank_state_dict_types() -> dict[str, Any]:
    import ckpt
    from fsdp import FullStateDictConfig, StateDictType

    data = batches(3)
    out: dict[str, Any] = {}
    settings: dict[str, tuple[Any, Any]] = {
        "sharded": (StateDictType.SHARDED_STATE_DICT, None),
        "local": (StateDictType.LOCAL_STATE_DICT, None),
        "full_offload": (StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True)),
    }
    for name, (sd_type, config) in settings.items():
        src = _wrap_ours(make_net())
        train_groups(src, data)
        with ckpt.state_dict_type(src, sd_type, config):
            sd = src.state_dict()
        names_after = [n for n, _ in src.named_parameters()]
        for orig in (True, False):  # same layout: interchangeable with use_orig_params=False
            import fsdp
            import fsdp.wrap

            dst = fsdp.FullyShardedDataParallel(
                make_net(seed=5),
                auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({Block}),
                use_orig_params=orig,
            )
            with ckpt.state_dict_type(dst, sd_type, config):
                dst.load_state_dict(sd)
            out[f"{name}/into_orig={orig}"] = max_diff(full_params(dst), full_params(src))
        out[f"{name}/names_kept"] = names_after == [n for n, _ in make_net().named_parameters()]
        out[f"{name}/1d_kept"] = all(p.dim() == 1 for p in src.parameters())
    # The optimizer state dict has the unwrapped names and full shapes (resharding and
    # resuming are tested in tests/ckpt/test_orig_params_optim.py).
    model = _wrap_ours(make_net())
    opt = torch.optim.AdamW(model.parameters())
    x, y = data[0]
    loss_fn(model(x), y).backward()
    opt.step()
    osd = ckpt.optim_state_dict(model, opt)
    want = {n: tuple(p.shape) for n, p in make_net().named_parameters()}
    got = {n: tuple(s["exp_avg"].shape) for n, s in osd["state"].items()}
    out["optim_full_shapes_kept"] = got == want
    names = [n for n, _ in make_net().named_parameters()]
    out["optim_names_kept"] = sorted(osd["param_groups"][0]["params"]) == sorted(names)
    return out


def test_orig_params_state_dict_types() -> None:
    for rank, r in enumerate(run_ranks(_rank_state_dict_types, 2, timeout=120)):
        where = f"rank {rank}: {r}"
        for key, value in r.items():
            if key.endswith("_kept"):
                assert value is True, (key, where)
            else:
                assert value == 0.0, (key, where)


# ------------------------------------------------------------ with the other constructor features


def _materialize(m: nn.Module) -> None:
    """param_init_fn for a meta-device Net: allocate, then each module's own init."""
    m.to_empty(device=torch.device("cpu"), recurse=False)
    reset = getattr(m, "reset_parameters", None)
    if callable(reset):
        reset()
    if "scale" in m._buffers:
        m._buffers["scale"].fill_(0.75)  # type: ignore[union-attr]


def _rank_compositions() -> dict[str, Any]:
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.wrap as torch_wrap
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp
    import fsdp.wrap

    data = batches(4)
    out: dict[str, Any] = {}
    ddp = DDP(make_net())
    ddp_losses, _ = train_groups(ddp, data)
    ddp_params = full_params(ddp)

    def compare(
        name: str, model: nn.Module, ref_losses: list[float], ref: dict[str, Tensor]
    ) -> None:
        losses, _ = train_groups(model, data)
        out[name] = {
            "loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
            "param": max_diff(full_params(model), ref),
            "1d": all(p.dim() == 1 for p in model.parameters()),
        }

    # Hybrid sharding 2x2 (replicate, shard), vs DDP and vs torch's FSDP1.
    mesh = init_device_mesh("cpu", (2, 2))
    for api, wrap_mod, tag in ((fsdp, fsdp.wrap, "ours"), (torch_fsdp, torch_wrap, "torch")):
        model = api.FullyShardedDataParallel(
            make_net(),
            sharding_strategy=api.ShardingStrategy.HYBRID_SHARD,
            device_mesh=mesh,
            auto_wrap_policy=wrap_mod.ModuleWrapPolicy({Block}),
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
        compare(f"hybrid_{tag}", model, ddp_losses, ddp_params)
    # Deferred init from the meta device (reset_parameters unit by unit) and
    # sync_module_states from rank 0 (each rank starts from other values):
    # the same as use_orig_params=False with the same settings.
    for name, kwargs in {
        "meta": {"param_init_fn": _materialize},
        "sync_module_states": {"sync_module_states": True},
    }.items():
        results = []
        for orig in (False, True):
            if name == "meta":
                with torch.device("meta"):
                    net: nn.Module = make_net()
            else:
                net = make_net(seed=dist.get_rank())
            torch.manual_seed(1)  # the same materialised values for both
            model = fsdp.FullyShardedDataParallel(
                net,
                auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({Block}),
                use_orig_params=orig,
                device_id=torch.device("cpu"),
                **{k: v for k, v in kwargs.items() if v is not None},
            )
            losses, _ = train(model, data)  # one group: the same optimizer for flat and orig
            results.append((losses, full_params(model)))
        (l0, p0), (l1, p1) = results
        out[name] = {
            "loss": max(abs(a - b) for a, b in zip(l0, l1, strict=True)),
            "param": max_diff(p0, p1),
            "1d": True,
        }
    # An ignored module keeps its whole parameters (and DDP-like all-reduced grads
    # are not FSDP's job: torch leaves them local too), vs torch's FSDP1.
    for api, wrap_mod, tag in ((fsdp, fsdp.wrap, "ours"), (torch_fsdp, torch_wrap, "torch")):
        net = make_net()
        model = api.FullyShardedDataParallel(
            net,
            auto_wrap_policy=wrap_mod.ModuleWrapPolicy({Block}),
            use_orig_params=True,
            ignored_modules=[net.head],
            device_id=torch.device("cpu"),
        )
        losses, _ = train_groups(model, data)
        out[f"ignored_{tag}"] = (losses, full_params(model), tuple(net.head.weight.shape))
    dist.barrier()
    return out


def test_orig_params_with_hybrid_meta_init_sync_and_ignored() -> None:
    for rank, r in enumerate(run_ranks(_rank_compositions, 4, timeout=240)):
        where = f"rank {rank}: { {k: v for k, v in r.items() if not k.startswith('ignored')} }"
        for key in ("hybrid_ours", "hybrid_torch", "meta", "sync_module_states"):
            assert r[key]["loss"] <= 1e-5 and r[key]["param"] <= 1e-5, (key, where)
        assert r["meta"]["loss"] == 0.0 and r["sync_module_states"]["param"] == 0.0, where
        assert r["hybrid_ours"]["1d"], where
        (losses, params, shape), (t_losses, t_params, t_shape) = (
            r["ignored_ours"],
            r["ignored_torch"],
        )
        assert shape == t_shape == (13, 6), where
        assert max(abs(a - b) for a, b in zip(losses, t_losses, strict=True)) <= 1e-5, where
        assert max_diff(params, t_params) <= 1e-5, where
