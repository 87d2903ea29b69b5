"""FSDP with ``use_orig_params=True``: ours vs torch's FSDP1 vs FSDP2, on a small GPT.

Two ranks (gloo, CPU), FULL_SHARD with one unit per :class:`~benchmarks.gpt.Block`
plus the root, the same model and data for every variant. Step times come
from one pair of rank processes holding every variant, stepped in turns (see
``benchmarks/common.py``). The ``use_orig_params=True`` variants and FSDP2
train with the optimizer people use them for: AdamW with two parameter groups
chosen by the original names (no weight decay for norms and biases); the
``use_orig_params=False`` rows can only give AdamW one group (their parameters
are flat), so they step fewer, larger tensors. Columns:

* step: median wall time of a training step (zero_grad, forward, backward,
  optimizer step), each step as long as its slowest rank;
* vs torch FSDP1: that time over torch's FSDP1 with the same
  ``use_orig_params`` (FSDP2 is compared with FSDP1 ``use_orig_params=True``);
* vs ours flat: that time over ours with ``use_orig_params=False``: what
  exposing the original parameters costs;
* loss: the last step's loss on rank 0; same params: whether the final full
  parameters equal torch FSDP1's with the same setting bit for bit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from benchmarks.common import (
    Options,
    Table,
    fmt_ms,
    ratio,
    time_round_robin,
    timed_runs,
)

DESCRIPTION = "fsdp use_orig_params=True vs torch FSDP1 (same setting) vs FSDP2 (GPT, 2 ranks)"

WORLD_SIZE = 2
MODEL = {"vocab": 4096, "d_model": 256, "n_layers": 4, "n_heads": 4, "seq_len": 64}
QUICK_MODEL = {"vocab": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}
BATCH = 4
LR = 1e-3

OURS_ORIG = "ours, use_orig_params=True"
TORCH_ORIG = "torch FSDP1, use_orig_params=True"
FSDP2 = "torch FSDP2 fully_shard"
OURS_FLAT = "ours, use_orig_params=False"
TORCH_FLAT = "torch FSDP1, use_orig_params=False"
# variant -> the torch FSDP1 row it is compared with
BASELINE = {
    OURS_ORIG: TORCH_ORIG,
    TORCH_ORIG: TORCH_ORIG,
    FSDP2: TORCH_ORIG,
    OURS_FLAT: TORCH_FLAT,
    TORCH_FLAT: TORCH_FLAT,
}
VARIANTS = list(BASELINE)


def _param_groups(named: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """Weight decay for matrices and embeddings only, chosen by the original names."""
    no_decay = [p for n, p in named if n.endswith("bias") or ".ln_" in n or n.startswith("ln_f")]
    decay = [p for n, p in named if not (n.endswith("bias") or ".ln_" in n or "ln_f" in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


class _Trainer:
    """One variant on this rank: the wrapped GPT, its optimizer and its data stream."""

    def __init__(self, variant: str, model_kwargs: dict[str, int]) -> None:
        import functools

        import torch
        import torch.distributed.fsdp as torch_fsdp
        import torch.distributed.fsdp.wrap as torch_wrap
        from torch.distributed.device_mesh import init_device_mesh

        import fsdp
        import fsdp.wrap
        from benchmarks.gpt import GPT, Block

        torch.manual_seed(0)
        net = GPT(**model_kwargs)
        self.model: Any
        if variant == FSDP2:
            mesh = init_device_mesh("cpu", (WORLD_SIZE,))
            for block in net.blocks:
                torch_fsdp.fully_shard(block, mesh=mesh)
            self.model = torch_fsdp.fully_shard(net, mesh=mesh)
        else:
            api, wrap_mod = (
                (fsdp, fsdp.wrap)
                if variant.startswith("ours")
                else (
                    torch_fsdp,
                    torch_wrap,
                )
            )
            self.model = api.FullyShardedDataParallel(
                net,
                auto_wrap_policy=wrap_mod.ModuleWrapPolicy({Block}),
                use_orig_params=variant in (OURS_ORIG, TORCH_ORIG),
                device_id=torch.device("cpu"),
            )
        adamw = functools.partial(torch.optim.AdamW, lr=LR)
        if variant in (OURS_FLAT, TORCH_FLAT):
            self.opt = adamw(self.model.parameters(), weight_decay=0.1)
        else:
            named = [
                (n.replace("_fsdp_wrapped_module.", ""), p)
                for n, p in self.model.named_parameters()
            ]
            self.opt = adamw(_param_groups(named))
        self.variant = variant
        self.counter = itertools.count()
        self.loss = 0.0

    def step(self) -> None:
        """One training step on this variant's next batch (the same batches for all)."""
        import torch.distributed as dist

        from benchmarks.gpt import lm_loss, random_tokens

        seed = 1000 * next(self.counter) + dist.get_rank()
        tokens = random_tokens(self.model.config, BATCH, seed=seed)
        self.opt.zero_grad(set_to_none=True)
        loss = lm_loss(self.model, tokens)
        loss.backward()
        self.opt.step()
        self.loss = loss.detach()

    def facts(self) -> dict[str, Any]:
        """A hash of the full parameters (a collective) and the last loss."""
        import hashlib

        import torch
        import torch.distributed.fsdp as torch_fsdp

        import fsdp

        digest = hashlib.sha256()
        if self.variant == FSDP2:
            for p in self.model.parameters():
                digest.update(p.full_tensor().detach().contiguous().numpy().tobytes())
        else:
            api = fsdp if self.variant.startswith("ours") else torch_fsdp
            with api.FullyShardedDataParallel.summon_full_params(self.model):
                for p in self.model.parameters():
                    digest.update(p.detach().clone().numpy().tobytes())  # clone: numpy pins storage
        return {"params_sha256": digest.hexdigest(), "loss": float(torch.as_tensor(self.loss))}


def _timing_rank(model: dict[str, int], warmup: int, iters: int) -> dict[str, Any]:
    """Every variant on this rank, stepped in turns; their times and facts."""
    trainers = {v: _Trainer(v, model) for v in VARIANTS}
    steps: dict[str, Callable[[], object]] = {v: t.step for v, t in trainers.items()}
    times = time_round_robin(steps, warmup=warmup, iters=iters)
    return {v: {"times": times[v], **t.facts()} for v, t in trainers.items()}


def run(options: Options) -> list[Table]:
    """Time all variants together and tabulate."""
    model = QUICK_MODEL if options.quick else MODEL
    warmup, iters = (1, 3) if options.quick else (3, 30)
    times, facts = timed_runs(
        _timing_rank, WORLD_SIZE, VARIANTS, model, warmup, iters, repeats=options.repeats
    )
    table = Table(
        f"FSDP FULL_SHARD on GPT({', '.join(f'{k}={v}' for k, v in model.items())}), batch "
        f"{BATCH}, {WORLD_SIZE} ranks, gloo/CPU, AdamW: median of {iters * options.repeats} steps",
        ["variant", "step", "vs torch FSDP1", "vs ours flat", "loss", "same params as FSDP1"],
    )
    for v in VARIANTS:
        same = all(r[v]["params_sha256"] == r[BASELINE[v]]["params_sha256"] for r in facts)
        table.add(
            v,
            fmt_ms(times[v]),
            ratio(times[v], times[BASELINE[v]]),
            ratio(times[v], times[OURS_FLAT]),
            f"{facts[0][v]['loss']:.6f}",
            "-" if v == BASELINE[v] else ("yes" if same else "NO"),
        )
    table.notes += [
        "use_orig_params=True rows and FSDP2 step AdamW with two parameter groups over the "
        "original parameters; use_orig_params=False rows one group over the flat parameters",
        "FSDP1 pads each original parameter to 16 bytes under use_orig_params, so its shards "
        "differ from ours; the elementwise AdamW update still agrees bit for bit",
    ]
    return [table]
