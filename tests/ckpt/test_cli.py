"""The ``ckpt`` program, run as a subprocess, on checkpoints of trained transformers.

One 2-rank job trains GPT-2 under our fsdp, Llama under DDP + zero_optim and Llama
under torch's ``fully_shard`` (saved with plain ``dcp.save``, no ckpt manifest), two
AdamW steps each, and records each trained model's logits on a probe batch. Then
``ckpt ls``/``inspect``/``verify``/``export`` run as ``python -m ckpt`` on the three
checkpoints, and each export loads with ``from_pretrained`` and gives the same logits.
Costs about 40 s on a shared 2-core machine (most of it starting interpreters).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import ckpt
from tests.ckpt._forge import Payload, forge_metadata
from tests.ranks import run_ranks

VOCAB = 50
ROOT = Path(__file__).resolve().parents[2]


def _config(kind: str) -> Any:
    from transformers import GPT2Config, LlamaConfig

    if kind == "gpt2":
        return GPT2Config(
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
    return LlamaConfig(
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


def _model(kind: str) -> tuple[nn.Module, type[nn.Module]]:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    if kind == "gpt2":
        return GPT2LMHeadModel(_config(kind)), GPT2Block
    return LlamaForCausalLM(_config(kind)), LlamaDecoderLayer


def _probe() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(99))


def _train(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()


def _rank_save(root: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    import fsdp
    import fsdp.wrap
    from zero_optim import ZeroRedundancyOptimizer

    logits: dict[str, torch.Tensor] = {}
    # GPT-2 under our fsdp (one unit per block), saved by ckpt
    net, block = _model("gpt2")
    policy = functools.partial(
        fsdp.wrap.transformer_auto_wrap_policy, transformer_layer_cls={block}
    )
    model: nn.Module = fsdp.FullyShardedDataParallel(net, auto_wrap_policy=policy)
    optim: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optim)
    ckpt.save({"model": model, "optim": optim, "step": 2}, f"{root}/fsdp-gpt2/step_00000002")
    with torch.no_grad():
        logits["fsdp-gpt2"] = model(input_ids=_probe()).logits
    # Llama under DDP + zero_optim, saved by ckpt
    net, _ = _model("llama")
    model = DDP(net)
    optim = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    _train(model, optim)
    ckpt.save({"model": model, "optim": optim}, f"{root}/zero-llama")
    with torch.no_grad():
        logits["zero-llama"] = net(input_ids=_probe()).logits
    # Llama under torch's fully_shard (FSDP2), saved by plain dcp.save
    net, block = _model("llama")
    for layer in net.modules():
        if isinstance(layer, block):
            fully_shard(layer)
    fully_shard(net)
    optim = torch.optim.AdamW(net.parameters(), lr=1e-2)
    _train(net, optim)
    dcp.save({"model": get_model_state_dict(net)}, checkpoint_id=f"{root}/fsdp2-llama")
    with torch.no_grad():
        logits["fsdp2-llama"] = net(input_ids=_probe()).logits
    return logits


def _ckpt(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(_paths())}
    return subprocess.run(
        [sys.executable, "-m", "ckpt", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


def _paths() -> list[str]:
    """The package sources (a checkout) or nothing extra (installed packages)."""
    extra = [str(p) for p in (ROOT / "packages").glob("*/src")]
    return [*extra, str(ROOT), os.environ.get("PYTHONPATH", "")]


def _from_pretrained(kind: str, folder: Path) -> nn.Module:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    _config(kind).save_pretrained(folder)
    cls = GPT2LMHeadModel if kind == "gpt2" else LlamaForCausalLM
    model: nn.Module = cls.from_pretrained(folder)
    return model.eval()


@pytest.mark.timeout(600)
def test_cli_on_fsdp_zero_and_fsdp2_checkpoints(tmp_path: Path) -> None:
    logits = run_ranks(_rank_save, 2, str(tmp_path), timeout=300)[0]

    listed = _ckpt("ls", "--json", str(tmp_path / "fsdp-gpt2"))
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert row["name"] == "step_00000002" and row["world_size"] == 2
    assert "model=fsdp.FullyShardedDataParallel" in row["saved_by"]

    fsdp_ckpt = tmp_path / "fsdp-gpt2" / "step_00000002"
    for path, kind in ((fsdp_ckpt, "ckpt"), (tmp_path / "fsdp2-llama", "dcp")):
        shown = _ckpt("inspect", "--json", str(path))
        assert shown.returncode == 0, shown.stderr
        doc = json.loads(shown.stdout)
        assert doc["kind"] == kind and doc["world_size"] == 2
        weight = next(
            t
            for k, t in doc["tensors"].items()
            if k.endswith("mlp.c_fc.weight" if kind == "ckpt" else "mlp.up_proj.weight")
        )
        # torch's fully_shard writes dim-0 chunks; ckpt writes each rank's run of the
        # parameter's row-major elements (cut mid-row here): [Note: flat pieces].
        assert weight["sharding"] == {"dcp": "2 row chunks", "ckpt": "4 runs"}[kind], weight

    ok = _ckpt("verify", str(tmp_path / "zero-llama"))
    assert ok.returncode == 0 and "ok" in ok.stdout, ok.stderr
    plain = _ckpt("verify", str(tmp_path / "fsdp2-llama"))  # no manifest: by its metadata
    assert plain.returncode == 0 and "no checksums were compared" in plain.stdout, plain

    exports = {
        "fsdp-gpt2": (
            fsdp_ckpt,
            "gpt2",
            ["--to", str(tmp_path / "out-fsdp-gpt2" / "model.safetensors")],
        ),
        "zero-llama": (
            tmp_path / "zero-llama",
            "llama",
            ["--to", str(tmp_path / "out-zero-llama"), "--max-shard-size", "4KB"],
        ),
        "fsdp2-llama": (
            tmp_path / "fsdp2-llama",
            "llama",
            ["--to", str(tmp_path / "out-fsdp2-llama")],
        ),
    }
    for name, (path, kind, args) in exports.items():
        done = _ckpt("export", str(path), *args)
        assert done.returncode == 0, done.stderr
        folder = tmp_path / f"out-{name}"
        with torch.no_grad():
            got = _from_pretrained(kind, folder)(input_ids=_probe()).logits
        torch.testing.assert_close(got, logits[name], rtol=0, atol=1e-6, msg=name)
    index = json.loads((tmp_path / "out-zero-llama" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # --max-shard-size split it


def test_cli_never_runs_a_forged_checkpoint(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    marker = tmp_path / "ran"
    net = nn.Linear(3, 2)
    forged_meta = tmp_path / "run" / "step_00000001"
    ckpt.save({"model": net}, forged_meta)
    forge_metadata(forged_meta, marker)
    FileSystemReader(forged_meta).read_metadata()  # live: torch's reader runs it
    assert marker.is_dir()
    marker.rmdir()
    forged_value = tmp_path / "value"
    ckpt.save({"model": net, "extra": Payload(marker)}, forged_value)

    codes = {
        "ls": _ckpt("ls", "--json", str(tmp_path / "run")).returncode,
        "inspect": _ckpt("inspect", str(forged_meta)).returncode,
        "verify": _ckpt("verify", str(forged_meta)).returncode,
        "export": _ckpt(
            "export", str(forged_meta), "--to", str(tmp_path / "o.safetensors")
        ).returncode,
        "inspect values": _ckpt("inspect", "--values", str(forged_value)).returncode,
        "verify value": _ckpt("verify", str(forged_value)).returncode,
    }
    assert codes == {
        "ls": 5,  # it lists the others and flags the forged one as untrusted
        "inspect": 5,
        "verify": 5,
        "export": 5,
        "inspect values": 5,
        "verify value": 5,
    }
    assert not marker.exists()
    assert not (tmp_path / "o.safetensors").exists()
