"""The CUDA paths for real: NCCL at world size 1, gloo with CUDA tensors, NCCL across GPUs.

Run on a GPU machine with ``nox -s gpu`` (each test here is skipped without
CUDA, so the CPU suite is unchanged). What each part checks:

* NCCL at world size 1 (any GPU): every sharding strategy (they fall back to
  one rank's layout), ``use_orig_params``, CPU offload, bf16 mixed precision
  and prefetching train exactly like the plain model on the same GPU; the
  device is chosen from ``LOCAL_RANK`` (see [Note: choosing the CUDA device]);
  after a step the device holds, in bytes as the allocator counts them, the
  parameters, gradients and AdamW moments and nothing else; ``ckpt.save``
  adds less than one unit's bytes to the peak (chunks go to the host unit by
  unit) and the checkpoint loads back.
* gloo with CUDA tensors, 2 ranks on one GPU (``device_id`` given, since both
  ranks share cuda:0): NO_SHARD FSDP and ZeRO (all-reduce and broadcast, which
  gloo supports on CUDA) against by-hand averaged plain training; without
  ``device_id`` the rank whose ``LOCAL_RANK`` names no GPU gets the error
  naming ``torch.cuda.set_device``.
* NCCL on 2 GPUs: ranks start on cuda:0 as under torchrun without
  ``set_device``; FULL_SHARD against torch's FSDP1, ZeRO against torch's ZeRO
  (consolidated on rank 1), a ckpt round trip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.gpu._common import Block, allocated_bytes, data, make, needs_2_gpus, needs_cuda
from tests.ranks import run_ranks

pytestmark = needs_cuda

STEPS = 3


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return (model(x).float() - y).square().mean()


def _train(model: nn.Module, opt: Any, batches: list[tuple[Tensor, Tensor]], avg: bool) -> None:
    for x, y in batches:
        _loss(model, x, y).backward()
        if avg:  # by hand, what DDP does
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad(set_to_none=False)


def _full(model: nn.Module) -> dict[str, Tensor]:
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model):
            return {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    if isinstance(model, TorchFSDP):
        with TorchFSDP.summon_full_params(model):
            return {
                n.replace("_fsdp_wrapped_module.", ""): p.detach().float().cpu()
                for n, p in model.named_parameters()
            }
    return {n: p.detach().float().cpu() for n, p in model.named_parameters()}


def _diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _configs() -> dict[str, dict[str, Any]]:
    from fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

    return {
        "full_shard": {"sharding_strategy": ShardingStrategy.FULL_SHARD},
        "shard_grad_op": {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP},
        "no_shard": {"sharding_strategy": ShardingStrategy.NO_SHARD},
        "orig_params": {"use_orig_params": True},
        "cpu_offload": {"cpu_offload": CPUOffload(offload_params=True)},
        "bf16": {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)},
        "prefetch": {
            "backward_prefetch": BackwardPrefetch.BACKWARD_PRE,
            "forward_prefetch": True,
            "limit_all_gathers": True,
        },
    }


def _world1_rank(folder: str) -> dict[str, Any]:
    import ckpt
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
    from fsdp.wrap import ModuleWrapPolicy

    torch.cuda.set_device(0)  # as torchrun leaves it: the choice comes from LOCAL_RANK=0
    device = torch.device("cuda", 0)
    batches = data(STEPS, 0, device)
    out: dict[str, Any] = {}
    plain = make().to(device)
    _train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), batches, avg=False)
    want = _full(plain)
    for name, kw in _configs().items():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        model = FSDP(make(), auto_wrap_policy=ModuleWrapPolicy({Block}), **kw)
        assert model._fsdp_state.compute_device == device, name
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _train(model, opt, batches, avg=False)
        out[name] = _diff(_full(model), want)
        if name in ("full_shard", "no_shard"):
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated() - base
            tensors = [p for p in model.parameters()]
            tensors += [p.grad for p in model.parameters() if p.grad is not None]
            tensors += [
                t for st in opt.state.values() for t in st.values() if isinstance(t, Tensor)
            ]
            on_gpu = [t for t in tensors if t.is_cuda]
            out[f"{name}_held"] = (held, allocated_bytes(on_gpu))
        if name == "full_shard":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            ckpt.save({"model": model, "optim": opt}, Path(folder) / "c")
            torch.cuda.synchronize()
            out["save_extra_peak"] = torch.cuda.max_memory_allocated() - before
            out["unit_bytes"] = allocated_bytes(list(make().blocks[0].parameters()))
            fresh = FSDP(make(seed=1), auto_wrap_policy=ModuleWrapPolicy({Block}), **kw)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            ckpt.load({"model": fresh}, Path(folder) / "c")
            torch.cuda.synchronize()
            out["load_extra_peak"] = torch.cuda.max_memory_allocated() - before
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
            ckpt.load({"model": fresh, "optim": fresh_opt}, Path(folder) / "c")
            out["ckpt_diff"] = _diff(_full(fresh), _full(model))
        del model, opt
    return out


def test_nccl_world_size_1(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RANKS_BACKEND", "nccl")
    (out,) = run_ranks(_world1_rank, 1, str(tmp_path), timeout=300)
    for name in _configs():
        tol = 2e-2 if name == "bf16" else 1e-5
        assert out[name] <= tol, (name, out[name])
    for name in ("full_shard", "no_shard"):
        held, counted = out[f"{name}_held"]
        assert held == counted, (name, held, counted)  # nothing else left on the device
    # Chunks go to the host unit by unit: well under one unit's bytes on the device
    # (before: the whole shard again and both AdamW moments, held until the write).
    assert out["save_extra_peak"] < out["unit_bytes"], out
    # Loading reads into a host template and moves one unit's chunks (and the shard
    # built from them) to the device at a time, not a second copy of the model.
    assert out["load_extra_peak"] < 3 * out["unit_bytes"], out
    assert out["ckpt_diff"] == 0.0


def _gloo_cuda_rank() -> dict[str, Any]:
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
    from fsdp import ShardingStrategy
    from fsdp._runtime._device import default_cuda_device
    from fsdp.wrap import ModuleWrapPolicy
    from zero_optim import ZeroRedundancyOptimizer

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    try:
        out["chosen"] = str(default_cuda_device())
    except RuntimeError as e:
        out["chosen"] = str(e)
    # One GPU for every rank: tests/ranks.py sets LOCAL_RANK=rank, which on a one-GPU
    # machine names no device for rank 1, so nothing below may depend on it: the current
    # device, FSDP's device_id and every tensor name cuda:0 explicitly.
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    batches = data(STEPS, rank, device)
    plain = make().to(device)
    _train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), batches, avg=True)
    want = _full(plain)
    model = FSDP(
        make(),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=ShardingStrategy.NO_SHARD,
        device_id=0,  # an int, as users pass it; LOCAL_RANK is not consulted
    )
    assert model._fsdp_state.compute_device == device
    _train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches, avg=False)
    out["no_shard"] = _diff(_full(model), want)
    net = make().to(device)
    zero = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-3)
    _train(net, zero, batches, avg=True)
    out["zero"] = _diff(_full(net), want)
    zero.consolidate_state_dict(to=1)
    out["consolidated"] = len(zero.state_dict()["state"]) if rank == 1 else None
    return out


def test_gloo_cuda_tensors_two_ranks_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKS_BACKEND", "gloo")
    outs = run_ranks(_gloo_cuda_rank, 2, timeout=300)
    assert outs[0]["chosen"] == "cuda:0"
    if torch.cuda.device_count() == 1:
        assert "LOCAL_RANK=1" in outs[1]["chosen"] and "torch.cuda.set_device" in outs[1]["chosen"]
    else:
        assert outs[1]["chosen"] == "cuda:1"
    for out in outs:
        assert out["no_shard"] <= 1e-5 and out["zero"] <= 1e-5, out
    assert outs[1]["consolidated"] == len(list(make().parameters()))


def _nccl_rank(folder: str) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    import ckpt
    from fsdp import FullyShardedDataParallel as FSDP  # noqa: N817
    from fsdp.wrap import ModuleWrapPolicy
    from zero_optim import ZeroRedundancyOptimizer

    rank = dist.get_rank()
    torch.cuda.set_device(0)  # torchrun without set_device: every rank starts on cuda:0
    device = torch.device("cuda", rank)  # what LOCAL_RANK names
    batches = data(STEPS, rank, device)
    out: dict[str, Any] = {}
    model = FSDP(make(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    out["device"] = str(model._fsdp_state.compute_device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, batches, avg=False)
    theirs = TorchFSDP(make(), auto_wrap_policy=TorchPolicy({Block}), device_id=device)
    _train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-3), batches, avg=False)
    out["fsdp_vs_torch"] = _diff(_full(model), _full(theirs))
    ours_net, torch_net = make().to(device), make().to(device)
    ours_zero = ZeroRedundancyOptimizer(ours_net.parameters(), torch.optim.AdamW, lr=1e-3)
    torch_zero = TorchZero(torch_net.parameters(), torch.optim.AdamW, lr=1e-3)
    _train(ours_net, ours_zero, batches, avg=True)
    _train(torch_net, torch_zero, batches, avg=True)
    out["zero_vs_torch"] = _diff(_full(ours_net), _full(torch_net))
    ours_zero.consolidate_state_dict(to=1)
    torch_zero.consolidate_state_dict(to=1)
    if rank == 1:
        got, want = ours_zero.state_dict()["state"], torch_zero.state_dict()["state"]
        out["consolidated_equal"] = sorted(got) == sorted(want) and all(
            torch.equal(got[i][k].cpu(), v.cpu()) for i in want for k, v in want[i].items()
        )
    ckpt.save({"model": model, "optim": opt}, Path(folder) / "c")
    fresh = FSDP(make(seed=1), auto_wrap_policy=ModuleWrapPolicy({Block}))
    ckpt.load({"model": fresh}, Path(folder) / "c")
    out["ckpt_diff"] = _diff(_full(fresh), _full(model))
    # Back on this rank's GPU, so that the harness's exit barrier (which NCCL issues on
    # the current device) does not put both ranks on cuda:0.
    torch.cuda.set_device(device)
    return out


@needs_2_gpus
def test_nccl_two_gpus_parity(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RANKS_BACKEND", "nccl")
    outs = run_ranks(_nccl_rank, 2, str(tmp_path), timeout=300)
    assert [o["device"] for o in outs] == ["cuda:0", "cuda:1"]
    for out in outs:
        assert out["fsdp_vs_torch"] <= 1e-5 and out["zero_vs_torch"] <= 1e-6, out
        assert out["ckpt_diff"] == 0.0
    assert outs[1]["consolidated_equal"]
