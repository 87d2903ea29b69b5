"""DDP + our ZeroRedundancyOptimizer vs DDP + torch's vs plain DDP, on a small GPT.

Two ranks (gloo, CPU), AdamW, the same model and data for every variant.
Step times come from one pair of rank processes that holds every variant and
steps them in turns (so load from elsewhere on the machine hits all alike);
memory comes from one fresh pair of processes per variant. Columns:

* step: median wall time of a training step (forward, backward, optimizer
  step, parameter broadcasts), each step as long as its slowest rank;
* vs torch: that time over torch's ZeRO with the same ``parameters_as_bucket_view``
  (torch's overlap refuses gloo, so our overlapped rows are compared with
  torch's non-overlapped ZeRO, its only option here);
* optim state/rank: bytes of optimizer state on the rank holding the most;
  vs ideal: that over the ideal 1/N share of plain AdamW's state (the excess is
  the greedy partition's imbalance, at most one parameter's state);
* peak RSS/rank: the largest peak resident set size among the ranks, and its
  ratio to torch's ZeRO;
* same params: whether the final parameters equal plain DDP's bit for bit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from benchmarks.common import (
    Options,
    Table,
    fmt_bytes,
    fmt_ms,
    launch,
    peak_rss_bytes,
    ratio,
    time_round_robin,
    timed_runs,
)

DESCRIPTION = (
    "DDP + zero_optim vs DDP + torch's ZeroRedundancyOptimizer vs plain DDP (GPT, 2 ranks)"
)

WORLD_SIZE = 2
MODEL = {"vocab": 4096, "d_model": 256, "n_layers": 4, "n_heads": 4, "seq_len": 64}
QUICK_MODEL = {"vocab": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}
BATCH = 4
LR = 1e-3
MEMORY_STEPS = 3  # steps before reading peak RSS: optimizer state exists after the first

DDP = "ddp (plain AdamW)"
TORCH = "torch zero"
TORCH_BUCKETS = "torch zero, bucket view"
OURS = "ours"
OURS_BUCKETS = "ours, bucket view"
OURS_OVERLAP = "ours, overlap"
OURS_INTERLEAVED = "ours, overlap interleaved"
# variant -> the torch row it is compared with
BASELINE = {
    DDP: TORCH,
    TORCH: TORCH,
    OURS: TORCH,
    OURS_OVERLAP: TORCH,
    OURS_INTERLEAVED: TORCH,
    TORCH_BUCKETS: TORCH_BUCKETS,
    OURS_BUCKETS: TORCH_BUCKETS,
}
VARIANTS = list(BASELINE)


class _Trainer:
    """One variant on this rank: GPT, DDP, optimizer (and hook), and its own data stream."""

    def __init__(self, variant: str, model_kwargs: dict[str, int]) -> None:
        import torch
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
        from torch.nn.parallel import DistributedDataParallel

        import zero_optim
        from benchmarks.gpt import GPT

        torch.manual_seed(0)
        self.model = GPT(**model_kwargs)
        self.ddp = DistributedDataParallel(self.model)
        adamw = torch.optim.AdamW
        self.opt: Any
        if variant == DDP:
            self.opt = adamw(self.model.parameters(), lr=LR)
        elif variant in (TORCH, TORCH_BUCKETS):
            self.opt = TorchZeRO(
                self.model.parameters(),
                adamw,
                parameters_as_bucket_view=variant == TORCH_BUCKETS,
                lr=LR,
            )
        else:
            self.opt = zero_optim.ZeroRedundancyOptimizer(
                self.model.parameters(),
                adamw,
                parameters_as_bucket_view=variant == OURS_BUCKETS,
                overlap_with_ddp=variant in (OURS_OVERLAP, OURS_INTERLEAVED),
                lr=LR,
            )
            make_hook = {
                OURS_OVERLAP: zero_optim.hook_with_zero_step,
                OURS_INTERLEAVED: zero_optim.hook_with_zero_step_interleaved,
            }.get(variant)
            if make_hook is not None:
                self.ddp.register_comm_hook(None, make_hook(allreduce_hook, self.ddp, self.opt))
        self.variant = variant
        self.steps_in_backward = variant in (OURS_OVERLAP, OURS_INTERLEAVED)
        self.counter = itertools.count()

    def step(self) -> None:
        """One training step on this variant's next batch (the same batches for all)."""
        import torch.distributed as dist

        from benchmarks.gpt import lm_loss, random_tokens

        seed = 1000 * next(self.counter) + dist.get_rank()
        tokens = random_tokens(self.model.config, BATCH, seed=seed)
        self.opt.zero_grad(set_to_none=True)
        lm_loss(self.ddp, tokens).backward()
        if not self.steps_in_backward:
            self.opt.step()

    def facts(self) -> dict[str, Any]:
        """Bytes of optimizer state here, a hash of the parameters, model sizes."""
        import hashlib

        import torch

        local = self.opt.state if self.variant == DDP else self.opt.optim.state
        state_bytes = sum(
            t.numel() * t.element_size()
            for s in local.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )
        digest = hashlib.sha256()
        for p in self.model.parameters():
            digest.update(p.detach().contiguous().numpy().tobytes())
        return {
            "state_bytes": state_bytes,
            "params_sha256": digest.hexdigest(),
            "param_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
            "largest_param": max(p.numel() for p in self.model.parameters()),
        }


def _timing_rank(model: dict[str, int], warmup: int, iters: int) -> dict[str, Any]:
    """Every variant on this rank, stepped in turns; their times and facts."""
    trainers = {v: _Trainer(v, model) for v in VARIANTS}
    steps: dict[str, Callable[[], object]] = {v: t.step for v, t in trainers.items()}
    times = time_round_robin(steps, warmup=warmup, iters=iters)
    return {v: {"times": times[v], **t.facts()} for v, t in trainers.items()}


def _memory_rank(variant: str, model: dict[str, int]) -> dict[str, Any]:
    """One variant alone in a fresh process: peak RSS after a few steps."""
    trainer = _Trainer(variant, model)
    for _ in range(MEMORY_STEPS):
        trainer.step()
    return {"peak_rss": peak_rss_bytes(), **trainer.facts()}


def run(options: Options) -> list[Table]:
    """Time all variants together, measure each one's memory alone, tabulate."""
    model = QUICK_MODEL if options.quick else MODEL
    warmup, iters = (1, 3) if options.quick else (3, 30)
    times, facts = timed_runs(
        _timing_rank, WORLD_SIZE, VARIANTS, model, warmup, iters, repeats=options.repeats
    )
    memory = {v: launch(_memory_rank, WORLD_SIZE, v, model, timeout=600) for v in VARIANTS}

    rss = {v: max(r["peak_rss"] for r in memory[v]) for v in VARIANTS}
    total_state = facts[0][DDP]["state_bytes"]  # plain AdamW: the whole state on every rank
    ideal = total_state / WORLD_SIZE
    table = Table(
        f"ZeRO on GPT({', '.join(f'{k}={v}' for k, v in model.items())}), batch {BATCH}, "
        f"{WORLD_SIZE} ranks, gloo/CPU, AdamW: median of {iters * options.repeats} steps",
        [
            "variant",
            "step",
            "vs torch",
            "optim state/rank",
            "vs ideal",
            "peak RSS/rank",
            "RSS vs torch",
            "same params",
        ],
    )
    for v in VARIANTS:
        state = max(r[v]["state_bytes"] for r in facts)
        same = all(r[v]["params_sha256"] == r[DDP]["params_sha256"] for r in facts)
        table.add(
            v,
            fmt_ms(times[v]),
            ratio(times[v], times[BASELINE[v]]),
            f"{fmt_bytes(state)} ({state} B)",
            "-" if v == DDP else ratio(state, ideal),
            fmt_bytes(rss[v]),
            ratio(rss[v], rss[BASELINE[v]]),
            "yes" if same else "NO",
        )
    largest = facts[0][DDP]["largest_param"] * 8  # AdamW: two fp32 tensors per element
    table.notes += [
        f"plain AdamW state: {fmt_bytes(total_state)} ({total_state} B) per rank; ideal 1/"
        f"{WORLD_SIZE} share {ideal:.0f} B; the greedy bound allows one parameter's state "
        f"more ({largest} B)",
        f"model parameters: {fmt_bytes(facts[0][DDP]['param_bytes'])}",
        "torch's overlapped ZeRO refuses gloo; our overlap rows compare with its plain ZeRO",
    ]
    return [table]
