"""``ckpt.load_pretrained``: safetensors weights into fsdp (meta-device init included)
and DDP + zero_optim models, each rank reading its own slices; exact at 1, 2 and 4 ranks.

The reference is the same file loaded into the unwrapped model by transformers'
``from_pretrained``. A second part measures, per rank, the peak resident memory the
load adds (VmHWM after resetting it through /proc/self/clear_refs) and the bytes it
read, on a 30 MB Llama: both fall with the world size, and the transient buffer stays
below the largest tensor.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import ckpt
from tests.ckpt.test_cli import _config, _model, _probe
from tests.fsdp._common import full_params
from tests.ranks import run_ranks


def materialize(module: nn.Module) -> None:
    """``param_init_fn`` for a meta-device transformers model whose weights will be
    loaded: storage only, except the rotary frequencies (computed, not in the file)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    module.to_empty(device=torch.device("cpu"), recurse=False)
    if isinstance(module, LlamaRotaryEmbedding):
        inv_freq, _ = module.compute_default_rope_parameters(module.config)
        module.inv_freq.copy_(inv_freq)
        module.original_inv_freq.copy_(inv_freq)


def _fsdp(net: nn.Module, block: type[nn.Module], *, meta: bool, orig: bool) -> nn.Module:
    import fsdp
    import fsdp.wrap

    policy = functools.partial(
        fsdp.wrap.transformer_auto_wrap_policy, transformer_layer_cls={block}
    )
    init = materialize if meta else None
    return fsdp.FullyShardedDataParallel(
        net, auto_wrap_policy=policy, use_orig_params=orig, param_init_fn=init
    )


def _meta_model(kind: str) -> tuple[nn.Module, type[nn.Module]]:
    with torch.device("meta"):
        return _model(kind)


def _rank_load(root: str) -> dict[str, dict[str, torch.Tensor]]:
    from zero_optim import ZeroRedundancyOptimizer

    out: dict[str, dict[str, torch.Tensor]] = {}
    # GPT-2 built on the meta device, our fsdp, flat parameters
    net, block = _meta_model("gpt2")
    model = _fsdp(net, block, meta=True, orig=False)
    ckpt.load_pretrained(model, f"{root}/gpt2")
    out["fsdp-meta/gpt2"] = full_params(model)
    # Llama, our fsdp with use_orig_params, from a sharded folder with an index
    net, block = _model("llama")
    model = _fsdp(net, block, meta=False, orig=True)
    ckpt.load_pretrained(model, f"{root}/llama")
    out["fsdp-orig/llama"] = full_params(model)
    # Llama built on the meta device: the loaded model computes the reference's logits
    net, block = _meta_model("llama")
    model = _fsdp(net, block, meta=True, orig=False)
    ckpt.load_pretrained(model, f"{root}/llama")
    with torch.no_grad():
        out["logits"] = {"llama": model(input_ids=_probe()).logits}
    # GPT-2 under DDP + zero_optim
    net, _ = _model("gpt2")
    torch.manual_seed(1 + dist.get_rank())  # other random weights on every rank
    for p in net.parameters():
        p.data.normal_()
    ddp = DDP(net)
    ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-3)
    ckpt.load_pretrained(ddp, f"{root}/gpt2")
    out["ddp-zero/gpt2"] = full_params(ddp)
    return out


def _save_pretrained(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    refs: dict[str, dict[str, torch.Tensor]] = {}
    for kind, cls, shard in (("gpt2", GPT2LMHeadModel, None), ("llama", LlamaForCausalLM, "8KB")):
        torch.manual_seed(123)
        source = cls(_config(kind))
        for p in source.parameters():  # not the init values any model would start from
            p.data.uniform_(-1, 1)
        args: dict[str, Any] = {} if shard is None else {"max_shard_size": shard}
        source.save_pretrained(root / kind, **args)
        loaded = cls.from_pretrained(root / kind)
        refs[kind] = {n: p.detach().clone() for n, p in loaded.named_parameters()}
        if kind == "llama":
            with torch.no_grad():
                refs["logits"] = {kind: loaded(input_ids=_probe()).logits}
    assert (root / "llama" / "model.safetensors.index.json").is_file()
    return refs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_pretrained_into_sharded_models_is_exact(tmp_path: Path, world_size: int) -> None:
    refs = _save_pretrained(tmp_path)
    for rank, results in enumerate(run_ranks(_rank_load, world_size, str(tmp_path), timeout=400)):
        for name, params in results.items():
            ref = refs[name.split("/")[-1]]
            assert params.keys() == ref.keys(), (rank, name)
            for key, value in params.items():
                if name == "logits":  # other thread counts sum in another order
                    torch.testing.assert_close(value, ref[key], rtol=0, atol=1e-5)
                    continue
                assert torch.equal(value, ref[key]), (rank, name, key)


def test_pretrained_mismatch_is_refused_before_reading(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    save_file(
        {"0.weight": torch.ones(4, 3), "0.bias": torch.ones(4), "9.x": torch.ones(1)},
        tmp_path / "m.safetensors",
    )
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ckpt.StateDictMismatchError) as info:
        ckpt.load_pretrained(net, tmp_path / "m.safetensors")
    assert set(info.value.missing) == {"1.weight", "1.bias"} and info.value.unexpected == ("9.x",)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    ckpt.load_pretrained(net, tmp_path / "m.safetensors", strict=False)
    assert torch.equal(net[0].weight, torch.ones(4, 3))
    save_file({"0.weight": torch.ones(3, 3)}, tmp_path / "bad.safetensors")
    with pytest.raises(ckpt.StateDictMismatchError, match="shape"):
        ckpt.load_pretrained(net, tmp_path / "bad.safetensors", strict=False)


def _big_llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def _hwm_kib() -> tuple[int, int]:
    fields = dict(
        line.split(":", 1)
        for line in Path("/proc/self/status").read_text().splitlines()
        if ":" in line
    )
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def _rank_peak(path: str) -> dict[str, int]:
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    with torch.device("meta"):
        net = LlamaForCausalLM(_big_llama_config())
    model = _fsdp(net, LlamaDecoderLayer, meta=True, orig=False)
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    rss_before, _ = _hwm_kib()
    report = ckpt.load_pretrained(model, path)
    _, hwm = _hwm_kib()
    return {
        "shard_bytes": shard_bytes,
        "load_peak_growth": (hwm - rss_before) * 1024,
        "bytes_read": report.bytes_read,
        "largest_read": report.largest_read,
    }


@pytest.mark.timeout(600)
def test_pretrained_peak_per_rank(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    source = LlamaForCausalLM(_big_llama_config())
    source.save_pretrained(tmp_path / "big")
    total = sum(p.numel() * p.element_size() for p in source.parameters())
    largest = max(p.numel() * p.element_size() for p in source.parameters())
    del source
    mib = 1 << 20
    lines = [f"model {total / mib:.1f} MiB, largest tensor {largest / mib:.1f} MiB"]
    for world_size in (1, 2, 4):
        results = run_ranks(_rank_peak, world_size, str(tmp_path / "big"), timeout=400)
        for rank, r in enumerate(results):
            lines.append(
                f"world {world_size} rank {rank}: shard {r['shard_bytes'] / mib:.1f} MiB, "
                f"read {r['bytes_read'] / mib:.1f} MiB, largest slice "
                f"{r['largest_read'] / mib:.1f} MiB, load peak growth "
                f"{r['load_peak_growth'] / mib:.1f} MiB"
            )
            # it reads about its shard (plus partial rows at the edges), never the model
            assert r["bytes_read"] <= r["shard_bytes"] + 4 * 256 * 4 * 64, lines[-1]
            assert r["largest_read"] <= largest
            # resident growth while loading: the shard's pages (first written now) and
            # one slice in flight (read, and its file pages while mapped), not the model
            bound = r["shard_bytes"] + 2 * r["largest_read"] + 6 * mib
            assert r["load_peak_growth"] <= bound, lines[-1]
    print("\n".join(lines))


def _rank_load_frozen(path: str, orig: bool) -> dict[str, torch.Tensor]:
    """A LoRA-like model: units that mix frozen and trainable parameters keep the frozen
    ones in a frozen part (fsdp's [Note: frozen part]), which must be filled too."""
    import fsdp
    from fsdp.wrap import ModuleWrapPolicy
    from tests.fsdp._common import Block, make_net

    net = make_net(1)  # other values than the file's
    for name, p in net.named_parameters():
        p.requires_grad_(name not in {"blocks.1.fc1.weight", "ln_f.weight", "emb.weight"})
    model = fsdp.FullyShardedDataParallel(
        net, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=orig
    )
    ckpt.load_pretrained(model, path)
    return full_params(model)


@pytest.mark.parametrize("orig", [False, True])
def test_pretrained_fills_frozen_parts(tmp_path: Path, orig: bool) -> None:
    from safetensors.torch import save_file

    from tests.fsdp._common import make_net

    reference = make_net(0).state_dict()
    save_file(dict(reference), tmp_path / "model.safetensors")
    for params in run_ranks(_rank_load_frozen, 2, str(tmp_path / "model.safetensors"), orig):
        assert params.keys() == {k for k in reference if k != "scale"}
        for key, value in params.items():
            assert torch.equal(value, reference[key]), key
