"""HF accelerate (``fsdp_version=2`` with activation checkpointing) over our ``fully_shard``.

accelerate's ``fsdp2_prepare_model`` wraps each decoder layer in a
``CheckpointWrapper``, shards the layer, then the wrapper, then the model. The
wrapper forwards unknown attributes to the layer, and ours once took it for a
module already sharded (issue 41). A tiny Llama trains three steps on 2 CPU ranks
with torch's ``fully_shard`` and, after ``fsdp.torch_compat.install()``, with ours:
the same modules sharded, the same losses and the same full parameters, bit for
bit; then accelerate's ``save_state`` / ``load_state`` resume ours into a model
seeded otherwise, and the resumed step equals the uninterrupted one.

accelerate enables FSDP only on accelerators; on CPU the state is switched to FSDP
(:func:`_as_fsdp`) before each call that reads it (``prepare`` sets it back to its
CPU value).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.compat._fabric import lightning_env
from tests.ranks import run_ranks

pytest.importorskip("accelerate")

STEPS = 3


def _accelerator(ckpt_dir: str) -> Any:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        activation_checkpointing=True,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        state_dict_type="SHARDED_STATE_DICT",
    )
    acc = Accelerator(fsdp_plugin=plugin, cpu=True, project_dir=ckpt_dir)
    acc.fsdp_plugin_for_cpu = plugin
    _as_fsdp(acc)
    return acc


def _as_fsdp(acc: Any) -> Any:
    from accelerate.utils import DistributedType

    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = acc.fsdp_plugin_for_cpu
    return acc


def _model(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def _batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 64, (2, 8), generator=g) for _ in range(STEPS)]


def _step(acc: Any, model: Any, opt: Any, x: torch.Tensor) -> float:
    loss = model(input_ids=x, labels=x).loss
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    return float(loss.item())


def _rank(impl: str, ckpt_dir: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    lightning_env()
    if impl == "ours":
        import fsdp.torch_compat

        fsdp.torch_compat.install()
    acc = _accelerator(ckpt_dir)
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    data = _batches(dist.get_rank())
    losses = []
    for i, x in enumerate(data):
        if i == STEPS - 1 and impl == "ours":
            _as_fsdp(acc).save_state(ckpt_dir)
        losses.append(_step(acc, model, opt, x))
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }
    out: dict[str, Any] = {
        "losses": losses,
        "params": params,
        "checkpoint_wrapped": sum(
            type(m).__name__ == "FSDPCheckpointWrapper" for m in model.modules()
        ),
        "sharded_class": type(model).__module__.split(".")[0],
    }
    if impl == "ours":  # resume the last step into a model seeded otherwise
        acc.free_memory()
        fresh = _model(7)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        fresh, fresh_opt = _as_fsdp(acc).prepare(fresh, fresh_opt)
        _as_fsdp(acc).load_state(ckpt_dir)
        out["resumed_loss"] = _step(acc, fresh, fresh_opt, data[-1])
    return out


def test_accelerate_fsdp2_with_activation_checkpointing_trains_as_torchs(tmp_path: Path) -> None:
    ref = run_ranks(_rank, 2, "torch", str(tmp_path / "torch"), timeout=240)
    ours = run_ranks(_rank, 2, "ours", str(tmp_path / "ours"), timeout=240)
    for rank, (r, o) in enumerate(zip(ref, ours, strict=True)):
        assert r["sharded_class"] == "torch" and o["sharded_class"] == "fsdp", (r, o)
        assert o["checkpoint_wrapped"] == r["checkpoint_wrapped"] == 2
        assert o["losses"] == r["losses"], f"rank {rank}: {o['losses']} != {r['losses']}"
        assert r["losses"][0] != r["losses"][-1]
        for name, value in r["params"].items():
            assert torch.equal(o["params"][name], value), f"rank {rank}: {name} differs"
        assert o["resumed_loss"] == o["losses"][-1], (rank, o["resumed_loss"], o["losses"])
