"""bf16 mixed precision vs torch's FSDP1 with the same ``MixedPrecision``.

Both gather bf16 copies of fp32 master shards, compute in bf16, reduce in the
reduce dtype and step fp32 shards, with the same division split, so the
results agree far better than "bf16 tolerance": we require the losses within
1e-3 relative and the fp32 master parameters within 1e-3 absolute (a bf16 ulp
at 1.0 is 7.8e-3; a single differently rounded gradient moves one AdamW step
by at most lr = 1e-2 relative to that). Also checked here: the dtypes FSDP
promises (bf16 compute, fp32 master parameters and gradients, bf16 buffers,
low-precision gradients kept on request) and that the losses differ from an
fp32 run (mixed precision did take effect).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.fsdp._common import Block, batches, full_params, loss_fn, make_net, max_diff, train
from tests.ranks import run_ranks

STEPS = 6
BF16 = torch.bfloat16

MP_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "full_all_bf16": (
        "FULL_SHARD",
        {"param_dtype": BF16, "reduce_dtype": BF16, "buffer_dtype": BF16},
    ),
    "full_reduce_fp32": ("FULL_SHARD", {"param_dtype": BF16, "reduce_dtype": torch.float32}),
    "sgo_param_only": ("SHARD_GRAD_OP", {"param_dtype": BF16}),
    "noshard_bf16": ("NO_SHARD", {"param_dtype": BF16, "reduce_dtype": BF16}),
    "full_cast_inputs": (
        "FULL_SHARD",
        {"param_dtype": BF16, "cast_forward_inputs": True, "cast_root_forward_inputs": False},
    ),
}


def _make(api: Any, wrap_mod: Any, strategy: str, mp: dict[str, Any]) -> nn.Module:
    return api.FullyShardedDataParallel(  # type: ignore[no-any-return]
        make_net(),
        sharding_strategy=api.ShardingStrategy[strategy],
        mixed_precision=api.MixedPrecision(**mp),
        auto_wrap_policy=wrap_mod.ModuleWrapPolicy({Block}),
        device_id=torch.device("cpu"),
    )


def _rank_mixed_precision() -> dict[str, Any]:
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.wrap as torch_wrap

    import fsdp
    import fsdp.wrap

    data = batches(STEPS)
    out: dict[str, Any] = {}
    fp32_losses, _ = train(fsdp.FullyShardedDataParallel(make_net()), data)
    for name, (strategy, mp) in MP_CONFIGS.items():
        ours = _make(fsdp, fsdp.wrap, strategy, mp)
        theirs = _make(torch_fsdp, torch_wrap, strategy, mp)
        losses, _ = train(ours, data)
        t_losses, _ = train(theirs, data)
        loss_fn(ours(data[0][0]), data[0][1]).backward()  # leave gradients to inspect
        out[name] = {
            "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, t_losses, strict=True)),
            "param": max_diff(full_params(ours), full_params(theirs)),
            "vs_fp32": max(abs(a - b) for a, b in zip(losses, fp32_losses, strict=True)),
            "flat_dtypes": sorted({str(p.dtype) for p in ours.parameters()}),
            "grad_dtypes": sorted(
                {str(p.grad.dtype) for p in ours.parameters() if p.grad is not None}
            ),
        }
    # Dtypes seen inside forward and after backward.
    model = _make(fsdp, fsdp.wrap, "FULL_SHARD", MP_CONFIGS["full_all_bf16"][1])
    seen: dict[str, str] = {}

    def hook(m: nn.Module, args: Any, output: Any) -> None:
        seen["weight"] = str(m.weight.dtype)
        seen["input"] = str(args[0].dtype)

    model.module.blocks[0].module.fc1.register_forward_hook(hook)
    x, y = data[0]
    loss_fn(model(x), y).backward()
    out["inside_forward"] = seen
    out["buffer_dtype"] = str(model.module.scale.dtype)
    with fsdp.FullyShardedDataParallel.summon_full_params(model):
        out["summoned_dtype"] = str(model.module.head.weight.dtype)
    out["state_dict_dtypes"] = sorted({str(v.dtype) for v in model.state_dict().values()})
    keep = _make(
        fsdp, fsdp.wrap, "FULL_SHARD", {"param_dtype": BF16, "keep_low_precision_grads": True}
    )
    loss_fn(keep(x), y).backward()
    out["kept_grad_dtypes"] = sorted({str(p.grad.dtype) for p in keep.parameters()})
    dist.barrier()
    return out


def test_bf16_matches_torch_fsdp() -> None:
    for rank, out in enumerate(run_ranks(_rank_mixed_precision, 2, timeout=180)):
        for name in MP_CONFIGS:
            r = out[name]
            where = f"rank {rank} {name}: {r}"
            assert r["loss_rel"] < 1e-3, where
            assert r["param"] < 1e-3, where
            assert r["vs_fp32"] > 1e-4, where  # bf16 compute really happened
            assert r["flat_dtypes"] == ["torch.float32"], where
            assert r["grad_dtypes"] == ["torch.float32"], where
        assert out["inside_forward"] == {"weight": "torch.bfloat16", "input": "torch.bfloat16"}
        assert out["buffer_dtype"] == "torch.bfloat16"
        assert out["summoned_dtype"] == "torch.float32"  # full precision when summoned
        assert out["state_dict_dtypes"] == ["torch.float32"]  # buffers back in their dtype
        assert out["kept_grad_dtypes"] == ["torch.bfloat16"]
