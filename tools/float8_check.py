"""Manual check (not in CI): torchao's float8 all-gather on our ``fully_shard`` against torch's.

Needs torchao (not a dependency of ours), in a venv of its own::

    python3 -m venv /work/venv-torchao
    /work/venv-torchao/bin/pip install torch==2.13.0   # first, or pip pulls a CUDA build
    /work/venv-torchao/bin/pip install torchao==0.18.0
    PYTHONPATH=packages/flatparam/src:packages/fsdp/src:. /work/venv-torchao/bin/python \\
        tools/float8_check.py

A small MLP stack is converted with ``convert_to_float8_training(Float8LinearConfig(
enable_fsdp_float8_all_gather=True, emulate=True))`` (emulated float8 matmuls run on
the CPU), sharded per block and at the root, and trained three AdamW steps on 2 gloo
ranks with torch's ``fully_shard`` and with ours, calling
``precompute_float8_dynamic_scale_for_fsdp`` after each step (and without it). Prints,
per rank and setting, whether losses, full gradients and full parameters are equal bit
for bit, the largest difference, and the dtypes and bytes of every all-gather of the
float8 weights (one byte per element).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.ranks import run_ranks

DIM = 32
STEPS = 3


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
    return t.detach().clone()


def _train(impl: str, precompute: bool) -> tuple[dict[str, list[Any]], list[tuple[str, int]]]:
    from torchao.float8 import (
        Float8LinearConfig,
        convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp,
    )

    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        import fsdp._runtime._collectives as collectives
        from fsdp import fully_shard  # type: ignore[assignment]

        collectives.GLOO_COMPOSITES = False  # count the native all-gathers, as torch's
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
    model = convert_to_float8_training(_model(), config=config)
    for block in list(model)[:2]:
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
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    record: dict[str, list[Any]] = {"loss": [], "grads": [], "params": []}
    try:
        for _ in range(STEPS):
            loss = model(torch.randn(4, DIM, generator=g)).square().mean()
            loss.backward()
            record["loss"].append(loss.item())
            record["grads"].append({n: _full(p.grad) for n, p in model.named_parameters()})
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
    for precompute in (False, True):
        ref, ref_gathers = _train("torch", precompute)
        ours, our_gathers = _train("ours", precompute)
        equal = ref["loss"] == ours["loss"]
        worst = 0.0
        for key in ("grads", "params"):
            for a, b in zip(ref[key], ours[key], strict=True):
                for name in a:
                    equal = equal and torch.equal(a[name], b[name])
                    worst = max(worst, (a[name].float() - b[name].float()).abs().max().item())
        out[f"precompute={precompute}"] = {
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
