"""LoRA with ``peft`` on a Llama: trains like DDP, holds gradients for the adapters only.

``peft`` puts each LoRA adapter inside the Linear it adapts, so every decoder
layer unit mixes frozen base weights and trainable adapters: wrapping frozen
and trainable modules separately (torch's FSDP1 advice) is impossible. Ours
gives each unit's frozen parameters a FlatParameter of their own (fsdp's
[Note: frozen part]). On 2 ranks, a tiny Llama from a config with LoRA on
``q_proj``/``v_proj``, wrapped per decoder layer with ``use_orig_params=True``:

- losses equal DDP + the same peft model step for step, and so do the final
  parameters;
- each rank's gradient bytes are exactly ``ceil(T_u / 2)`` fp32 elements per
  unit (``T_u``: the unit's trainable elements), and AdamW's two moments cover
  exactly this rank's pieces of the trainable parameters, which add up over
  the ranks to peft's trainable count;
- the model saved with ``ckpt.save`` loads (``ckpt.load``) into a fresh,
  unwrapped peft model whose LoRA and base weights equal the trained ones.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from tests.fsdp._common import full_params, max_diff
from tests.ranks import run_ranks

STEPS = 4


def _peft_llama() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    from tests.fsdp.test_transformers import _model

    model, _ = _model("llama")
    torch.manual_seed(1)  # the adapters' initial values: the same on every rank and run
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    peft_model: nn.Module = get_peft_model(model, config)
    return peft_model


def _train(model: nn.Module, data: list[torch.Tensor]) -> tuple[list[float], Any]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.0)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the gradients to count them
        losses.append(loss.item())
    return losses, opt


def _rank_lora(path: str) -> dict[str, Any]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import ckpt
    import fsdp
    from fsdp.wrap import ModuleWrapPolicy
    from tests.fsdp.test_transformers import VOCAB

    g = torch.Generator().manual_seed(11 + dist.get_rank())
    data = [torch.randint(0, VOCAB, (2, 12), generator=g) for _ in range(STEPS)]
    ddp = DDP(_peft_llama())
    ref_losses, _ = _train(ddp, data)
    net = _peft_llama()
    n_trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    n_total = sum(p.numel() for p in net.parameters())
    model = fsdp.FullyShardedDataParallel(
        net, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), use_orig_params=True
    )
    losses, opt = _train(model, data)
    ws = dist.get_world_size()
    # Gradient bytes held, and the formula: ceil(T_u / ws) fp32 elements per unit.
    grad_bytes = expected = 0
    for s in model._fsdp_state.ctx.states:
        if s.unit is None:
            continue
        for part in s.unit.parts():
            if part.flat_param.grad is not None:
                grad_bytes += part.flat_param.grad.numel() * part.flat_param.grad.element_size()
            if part.flat_param.requires_grad:
                expected += math.ceil(sum(part.flat_param._param_numels) / ws) * 4
    local = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total_local = torch.tensor([local])
    dist.all_reduce(total_local)
    optim_bytes = sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for k, v in st.items()
        if k != "step"
    )
    params = full_params(model)
    ckpt.save({"model": model}, path)
    fresh = _peft_llama()
    ckpt.load({"model": fresh}, path)
    loaded = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "param_diff": max_diff(
            params, {n.removeprefix("module."): v for n, v in full_params(ddp).items()}
        ),
        "n_trainable": n_trainable,
        "n_total": n_total,
        "grad_bytes": grad_bytes,
        "expected_grad_bytes": expected,
        "local_trainable": local,
        "sum_local_trainable": int(total_local.item()),
        "optim_bytes": optim_bytes,
        "loaded_diff": max_diff(loaded, params),
        "lora_names": sorted(n for n in loaded if "lora_" in n),
    }


def test_lora_with_peft_trains_like_ddp_and_holds_adapter_gradients_only(tmp_path: Any) -> None:
    results = run_ranks(_rank_lora, 2, str(tmp_path / "lora"), timeout=300)
    for rank, r in enumerate(results):
        where = f"rank {rank}: {r}"
        assert r["loss_diff"] <= 1e-6, where
        assert r["param_diff"] <= 1e-6, where
        assert 0 < r["n_trainable"] < r["n_total"] // 10, where  # LoRA: a few % train
        assert r["grad_bytes"] == r["expected_grad_bytes"], where
        # Within padding of half the trainable fp32 bytes: (T / 2) * 4 plus < 1 element/unit.
        assert abs(r["grad_bytes"] - r["n_trainable"] * 2) <= 4 * 4, where
        assert r["sum_local_trainable"] == r["n_trainable"], where
        assert r["optim_bytes"] == 2 * 4 * r["local_trainable"], where  # exp_avg, exp_avg_sq
        assert r["loaded_diff"] == 0.0, where
        assert len(r["lora_names"]) == 2 * 2 * 2, where  # 2 layers x (q, v) x (A, B)
