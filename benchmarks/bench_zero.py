"""DDP + our ZeroRedundancyOptimizer vs DDP + torch's vs plain DDP, on a small GPT.

Two ranks (gloo, CPU), AdamW, the same data for every variant. Each variant runs
in fresh rank processes, so its peak RSS is its own. Columns:

* step: median wall time of a training step (forward, backward, optimizer
  step, parameter broadcasts), each step as long as its slowest rank;
* vs torch: that time over torch's ZeRO with the same ``parameters_as_bucket_view``
  (torch's overlap refuses gloo, so our overlapped rows are compared with
  torch's non-overlapped ZeRO, its only option here);
* optim state/rank: bytes of optimizer state on the rank holding the most;
  vs ideal: that over the ideal 1/N share of plain AdamW's state (the excess is
  the greedy partition's imbalance, at most one parameter's state);
* peak RSS/rank: the largest peak resident set size among the ranks;
* same params: whether the final parameters equal plain DDP's bit for bit.
"""

from __future__ import annotations

import itertools
from typing import Any

from benchmarks.common import (
    Options,
    RankReport,
    Table,
    fmt_bytes,
    fmt_ms,
    launch,
    peak_rss_bytes,
    ratio,
    step_time_s,
    time_steps,
)

DESCRIPTION = (
    "DDP + zero_optim vs DDP + torch's ZeroRedundancyOptimizer vs plain DDP (GPT, 2 ranks)"
)

WORLD_SIZE = 2
MODEL = {"vocab": 4096, "d_model": 256, "n_layers": 4, "n_heads": 4, "seq_len": 64}
QUICK_MODEL = {"vocab": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}
BATCH = 4
LR = 1e-3

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


def _variant_rank(
    variant: str, model_kwargs: dict[str, int], warmup: int, iters: int
) -> RankReport:
    """One rank of one variant: build, train ``warmup + iters`` steps, measure."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
    from torch.nn.parallel import DistributedDataParallel

    import zero_optim
    from benchmarks.gpt import GPT, lm_loss, random_tokens

    torch.manual_seed(0)
    model = GPT(**model_kwargs)
    ddp = DistributedDataParallel(model)
    adamw = torch.optim.AdamW
    opt: Any
    if variant == DDP:
        opt = adamw(model.parameters(), lr=LR)
    elif variant in (TORCH, TORCH_BUCKETS):
        opt = TorchZeRO(
            model.parameters(), adamw, parameters_as_bucket_view=variant == TORCH_BUCKETS, lr=LR
        )
    else:
        opt = zero_optim.ZeroRedundancyOptimizer(
            model.parameters(),
            adamw,
            parameters_as_bucket_view=variant == OURS_BUCKETS,
            overlap_with_ddp=variant in (OURS_OVERLAP, OURS_INTERLEAVED),
            lr=LR,
        )
        if variant == OURS_OVERLAP:
            ddp.register_comm_hook(None, zero_optim.hook_with_zero_step(allreduce_hook, ddp, opt))
        if variant == OURS_INTERLEAVED:
            hook = zero_optim.hook_with_zero_step_interleaved(allreduce_hook, ddp, opt)
            ddp.register_comm_hook(None, hook)
    steps_in_backward = variant in (OURS_OVERLAP, OURS_INTERLEAVED)
    rank = dist.get_rank()
    counter = itertools.count()

    def step() -> None:
        tokens = random_tokens(model.config, BATCH, seed=1000 * next(counter) + rank)
        opt.zero_grad(set_to_none=True)
        lm_loss(ddp, tokens).backward()
        if not steps_in_backward:
            opt.step()

    times = time_steps(step, warmup=warmup, iters=iters)
    local = opt.state if variant == DDP else opt.optim.state
    state_bytes = sum(
        t.numel() * t.element_size()
        for s in local.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return RankReport(
        step_times_s=times,
        peak_rss_bytes=peak_rss_bytes(),
        extra={
            "state_bytes": state_bytes,
            "params": flat,
            "param_bytes": flat.numel() * flat.element_size(),
            "largest_param": max(p.numel() for p in model.parameters()),
        },
    )


def run(options: Options) -> list[Table]:
    """Every variant ``options.repeats`` times (order rotated each time), then the table."""
    model = QUICK_MODEL if options.quick else MODEL
    warmup, iters = (1, 3) if options.quick else (3, 20)
    reports: dict[str, list[list[RankReport]]] = {v: [] for v in VARIANTS}
    for repeat in range(options.repeats):
        order = VARIANTS[repeat % len(VARIANTS) :] + VARIANTS[: repeat % len(VARIANTS)]
        for variant in order:
            reports[variant].append(
                launch(_variant_rank, WORLD_SIZE, variant, model, warmup, iters, timeout=900)
            )
    return [_table(reports, model, iters, options)]


def _table(
    reports: dict[str, list[list[RankReport]]],
    model: dict[str, int],
    iters: int,
    options: Options,
) -> Table:
    plain = reports[DDP][0]
    total_state = plain[0].extra["state_bytes"]  # plain AdamW: the whole state on each rank
    ideal = total_state / WORLD_SIZE
    times = {v: step_time_s(r) for v, r in reports.items()}
    table = Table(
        f"ZeRO on a GPT {model} (batch {BATCH}), {WORLD_SIZE} ranks, gloo/CPU, AdamW; median of "
        f"{iters} steps x {options.repeats} run(s)",
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
    for variant in VARIANTS:
        ranks = reports[variant][0]
        state = max(r.extra["state_bytes"] for r in ranks)
        rss = max(r.peak_rss_bytes for ranks_ in reports[variant] for r in ranks_)
        torch_rss = max(r.peak_rss_bytes for ranks_ in reports[BASELINE[variant]] for r in ranks_)
        same = all(
            bool((r.extra["params"] == p.extra["params"]).all())
            for r, p in zip(ranks, plain, strict=True)
        )
        table.add(
            variant,
            fmt_ms(times[variant]),
            ratio(times[variant], times[BASELINE[variant]]),
            fmt_bytes(state),
            "-" if variant == DDP else ratio(state, ideal),
            fmt_bytes(rss),
            ratio(rss, torch_rss),
            "yes" if same else "NO",
        )
    largest = plain[0].extra["largest_param"] * 8  # AdamW keeps two fp32 tensors per element
    table.notes += [
        f"plain AdamW state {fmt_bytes(total_state)} per rank; ideal 1/{WORLD_SIZE} share "
        f"{fmt_bytes(ideal)}; greedy bound adds at most one parameter's state "
        f"({fmt_bytes(largest)})",
        f"model parameters {fmt_bytes(plain[0].extra['param_bytes'])}",
        "torch's overlapped ZeRO refuses gloo; our overlap rows compare with its plain ZeRO",
    ]
    return table
