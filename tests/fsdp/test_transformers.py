"""Hugging Face models (random weights from a config, no download) train like DDP.

GPT-2 (tied input/output embeddings, Conv1D layers, learned positions) and
Llama (RMSNorm, rotary embeddings with a non-persistent buffer, grouped
query attention) in tiny configurations, wrapped with
``transformer_auto_wrap_policy`` on their block class, with
``use_orig_params`` False and True, trained on 2 ranks for 4 AdamW steps
with the model's own loss (``labels=``). The losses and final parameters
must equal DDP's bit for bit (2 ranks: the same arithmetic in the same
order), and torch's FSDP1 with the same settings gives the same numbers.
Dropout is off so that the runs are deterministic.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from tests.fsdp._common import full_params, max_diff
from tests.ranks import run_ranks

VOCAB = 50
STEPS = 4


def _model(kind: str) -> tuple[nn.Module, type[nn.Module]]:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=16,
            n_embd=16,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(config), GPT2Block
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config), LlamaDecoderLayer


def _train(model: nn.Module, data: list[torch.Tensor]) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _unwrapped(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("module."): v for k, v in params.items()}


def _rank_transformers() -> dict[str, Any]:
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.wrap as torch_wrap

    import fsdp
    import fsdp.wrap

    g = torch.Generator().manual_seed(7 + dist.get_rank())
    data = [torch.randint(0, VOCAB, (2, 12), generator=g)] * STEPS  # memorised: loss falls
    out: dict[str, Any] = {}
    for kind in ("gpt2", "llama"):
        net, block = _model(kind)
        ddp = DDP(net)
        ddp_losses = _train(ddp, data)
        ddp_params = _unwrapped(full_params(ddp))
        for orig in (False, True):
            results = {}
            for api, wrap_mod in ((fsdp, fsdp.wrap), (torch_fsdp, torch_wrap)):
                net, block = _model(kind)
                policy = functools.partial(
                    wrap_mod.transformer_auto_wrap_policy, transformer_layer_cls={block}
                )
                model = api.FullyShardedDataParallel(
                    net,
                    auto_wrap_policy=policy,
                    use_orig_params=orig,
                    device_id=torch.device("cpu"),
                )
                units = len(api.FullyShardedDataParallel.fsdp_modules(model))
                results[api.__name__] = (_train(model, data), full_params(model), units)
            (losses, params, units), (t_losses, t_params, _) = results.values()
            out[f"{kind}/orig={orig}"] = {
                "loss_vs_ddp": max(abs(a - b) for a, b in zip(losses, ddp_losses, strict=True)),
                "param_vs_ddp": max_diff(params, ddp_params),
                "loss_vs_torch": max(abs(a - b) for a, b in zip(losses, t_losses, strict=True)),
                "param_vs_torch": max_diff(params, t_params),
                "units": units,
                "losses": losses,
            }
    dist.barrier()
    return out


@pytest.mark.timeout(300)
def test_hf_gpt2_and_llama_train_like_ddp() -> None:
    for rank, results in enumerate(run_ranks(_rank_transformers, 2, timeout=240)):
        for name, r in results.items():
            where = f"rank {rank}, {name}: {r}"
            assert r["units"] == 3, where  # two blocks and the root
            assert r["losses"][-1] < r["losses"][0], where  # it trains
            assert r["loss_vs_ddp"] == 0.0, where
            assert r["param_vs_ddp"] == 0.0, where
            assert r["loss_vs_torch"] == 0.0, where
            assert r["param_vs_torch"] == 0.0, where
