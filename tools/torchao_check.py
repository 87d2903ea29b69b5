"""Manual check (not in CI): torchao's all-gather extensions on our ``fully_shard`` vs torch's.

Needs torchao (not a dependency of ours), in a venv of its own::

    python3 -m venv /work/venv-torchao
    /work/venv-torchao/bin/pip install torch==2.13.0   # first, or pip pulls a CUDA build
    /work/venv-torchao/bin/pip install torchao==0.18.0
    PYTHONPATH=packages/flatparam/src:packages/fsdp/src:. /work/venv-torchao/bin/python \\
        tools/torchao_check.py

Each setting trains three AdamW steps on 2 gloo ranks with torch's ``fully_shard`` and
with ours (per block, then the root) on the same model and data, and prints per rank
whether losses, full gradients and full parameters are equal bit for bit, the largest
difference, and the dtype and bytes of every all-gather:

- float8: a small MLP stack converted with ``convert_to_float8_training(
  Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True))`` (emulated
  float8 matmuls run on the CPU), with ``precompute_float8_dynamic_scale_for_fsdp``
  after each step or without it. The float8 weights gather one byte per element.
  torch's own ``fully_shard`` cannot gather float8 on gloo ("Invalid scalar type"), so
  its all-gathers are sent as bytes here (the same data); ours does that itself.
- nf4 (QLoRA, torchtune's layout): two linears whose frozen bf16 base weights are
  torchao ``NF4Tensor`` s (``to_nf4``, ``linear_nf4``) with trainable bf16 LoRA
  adapters; the NF4 weights gather as bytes, about half a byte per element.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.ranks import run_ranks

DIM = 32
STEPS = 3


class QLoRALinear(nn.Module):
    """A frozen NF4 base weight plus a trainable rank-8 LoRA adapter (bf16)."""

    def __init__(self) -> None:
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        base = torch.randn(2 * DIM, 2 * DIM, dtype=torch.bfloat16) / 8
        # block 64, scaler block 8: each rank's chunk holds whole scaler blocks at 2 ranks
        nf4 = to_nf4(base, block_size=64, scaler_block_size=8)
        self.weight = nn.Parameter(nf4, requires_grad=False)
        self.lora_a = nn.Linear(2 * DIM, 8, bias=False, dtype=torch.bfloat16)
        self.lora_b = nn.Linear(8, 2 * DIM, bias=False, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x))


def _model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(DIM, 2 * DIM, bias=False), nn.ReLU(), nn.Linear(2 * DIM, DIM))
        for _ in range(2)
    ]
    return nn.Sequential(*blocks, nn.Linear(DIM, DIM, bias=False))


def _full(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.full_tensor() if isinstance(t, DTensor) else t
    if hasattr(t, "_tensor"):  # torchao's WeightWithDynamicFloat8CastTensor
        t = t._tensor
    if type(t).__name__ == "NF4Tensor":
        t = t.get_original_weight()
    return t.detach().clone()


def _train(impl: str, setting: str) -> tuple[dict[str, list[Any]], list[tuple[str, int]]]:
    from torchao.float8 import (
        Float8LinearConfig,
        convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp,
    )

    precompute = setting == "float8+precompute"

    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        import fsdp._runtime._collectives as collectives
        from fsdp import fully_shard  # type: ignore[assignment]

        collectives.GLOO_COMPOSITES = False  # count the native all-gathers, as torch's
    if setting == "nf4":
        torch.manual_seed(0)
        model: nn.Module = nn.Sequential(QLoRALinear(), nn.ReLU(), QLoRALinear())
        blocks = [model[0], model[2]]
    else:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
        model = convert_to_float8_training(_model(), config=config)
        blocks = list(model)[:2]
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    gathers: list[tuple[str, int]] = []
    native = dist.all_gather_single

    def spy(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        gathers.append((str(output.dtype), output.numel() * output.element_size()))
        if output.dtype.itemsize == 1 and output.dtype not in (torch.uint8, torch.int8):
            # gloo has no float8 collectives (torch's gathers float8 as it is): its bytes
            output, input = output.view(torch.uint8), input.view(torch.uint8)
        return native(output, input, *args, **kwargs)

    dist.all_gather_single = spy  # type: ignore[assignment]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    width, dtype = (2 * DIM, torch.bfloat16) if setting == "nf4" else (DIM, torch.float32)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    record: dict[str, list[Any]] = {"loss": [], "grads": [], "params": []}
    try:
        for _ in range(STEPS):
            x = torch.randn(4, width, generator=g).to(dtype)
            loss = model(x).float().square().mean()
            loss.backward()
            record["loss"].append(loss.item())
            grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
            record["grads"].append(grads)
            opt.step()
            opt.zero_grad()
            if precompute:
                precompute_float8_dynamic_scale_for_fsdp(model)
            record["params"].append({n: _full(p) for n, p in model.named_parameters()})
    finally:
        dist.all_gather_single = native
    return record, gathers


def _rank() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for setting in ("float8", "float8+precompute", "nf4"):
        ref, ref_gathers = _train("torch", setting)
        ours, our_gathers = _train("ours", setting)
        equal = ref["loss"] == ours["loss"]
        worst = 0.0
        for key in ("grads", "params"):
            for a, b in zip(ref[key], ours[key], strict=True):
                assert sorted(a) == sorted(b), (sorted(a), sorted(b))
                for name in a:
                    equal = equal and torch.equal(a[name], b[name])
                    worst = max(worst, (a[name].float() - b[name].float()).abs().max().item())
        out[setting] = {
            "bitwise": equal,
            "max_diff": worst,
            "losses": ours["loss"],
            "torch_gathers": sorted(set(ref_gathers)),
            "our_gathers": sorted(set(our_gathers)),
        }
    return out


if __name__ == "__main__":
    for rank, result in enumerate(run_ranks(_rank, 2, timeout=300)):
        for setting, r in result.items():
            print(f"rank {rank} {setting}: {r}")
