"""Ours vs torch's ZeRO, FSDP1 and FSDP2 at three model sizes (~5M, ~30M, ~60M), 2 and 4 ranks.

One table. For every size and world size, four families are timed, each in
one launch that holds the family's variants and steps them in turns (so load
from elsewhere on the machine hits them alike):

* ZeRO: DDP + torch's ``ZeroRedundancyOptimizer``; DDP + ours (``step()``);
  DDP + ours driven by ``hook_with_zero_step_to_owners`` (no ``step()``); and
  a floor: the same forward, backward and AdamW on the rank's 1/N of the
  parameters with no collective at all, which no data-parallel wrapper can
  beat on this machine (its ratio bounds every other row's);
* FSDP1 FULL_SHARD: torch's and ours; FSDP1 SHARD_GRAD_OP: torch's and ours
  (one unit per transformer block plus the root, as in ``bench_fsdp``);
* FSDP2: torch's ``fully_shard`` and ours (each block, then the root, with
  their defaults), and torch's FSDP1 FULL_SHARD beside them for reference.

All with AdamW, fp32, gloo on the CPU, the same GPT and batches. Columns:

* step: median wall time of a training step, each step as long as its
  slowest rank; vs torch: ours over torch's of the same family (ratio of
  medians); paired: the 25th-75th percentile of the per-round ratios (each
  round steps both variants back to back, so the pair saw the same load);
* peak RSS/rank: the largest peak resident set size among the ranks, each
  variant alone in fresh processes after a few steps; vs torch as above;
* state/rank: bytes of parameters, gradients and AdamW state on the rank
  holding the most, just before the optimizer step; vs ideal: over the ZeRO
  paper's ideal for the stage (stage 1 for ZeRO, ``4 + 4 + 8/N`` bytes per
  parameter; stage 3 for FSDP, ``16/N``);
* traffic/step: bytes a rank sends per step in the bandwidth-optimal (ring)
  model, from the collectives called through ``torch.distributed``
  (all-reduce ``2n(N-1)/N``; reduce, broadcast, all-gather output and
  reduce-scatter input ``n(N-1)/N``; DDP's built-in all-reduce, which runs in
  C++, is added as the gradient bytes); x DDP: over plain DDP's ``2Ψ(N-1)/N``.

``--quick`` runs one tiny model with few steps: it checks that the benchmark
works, not what it measures. ``BENCH_SCALE_FAMILIES=full,sgo`` and
``BENCH_SCALE_WORLD_SIZES=2`` (environment, comma-separated) run a part of
the table (e.g. the FSDP rows at 2 ranks). A full run launches about 60 groups of rank
processes (about 45 min on a loaded 2-core machine).
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
)

DESCRIPTION = "ours vs torch ZeRO / FSDP1 / FSDP2 at ~5M, ~30M, ~60M parameters, 2 and 4 ranks"

SIZES = {
    "5M": {"vocab": 4096, "d_model": 256, "n_layers": 4, "n_heads": 4, "seq_len": 64},
    "30M": {"vocab": 4096, "d_model": 512, "n_layers": 8, "n_heads": 8, "seq_len": 64},
    "60M": {"vocab": 4096, "d_model": 768, "n_layers": 8, "n_heads": 12, "seq_len": 64},
}
QUICK_SIZES = {"tiny": {"vocab": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}}
WORLD_SIZES = (2, 4)
BATCH = 4
LR = 1e-3
MEMORY_STEPS = 2  # steps before reading peak RSS: optimizer state exists after the first

TORCH_ZERO = "torch ZeRO"
FLOOR = "floor: no communication"
OURS_ZERO = "ours ZeRO step()"
OURS_OWNERS = "ours ZeRO to-owners hook"
TORCH_FULL = "torch FSDP1 FULL_SHARD"
OURS_FULL = "ours FULL_SHARD"
TORCH_SGO = "torch FSDP1 SHARD_GRAD_OP"
OURS_SGO = "ours SHARD_GRAD_OP"
TORCH_FSDP2 = "torch fully_shard"
OURS_FSDP2 = "ours fully_shard"
# family -> its variants, torch's first (the baseline of the others)
FAMILIES = {
    "zero": [TORCH_ZERO, OURS_ZERO, OURS_OWNERS, FLOOR],
    "full": [TORCH_FULL, OURS_FULL],
    "sgo": [TORCH_SGO, OURS_SGO],
    "fsdp2": [TORCH_FSDP2, OURS_FSDP2, TORCH_FULL],
}

_SPIED = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",  # torch's FSDP1 gathers CPU tensors into a list
    "all_gather_single",
    "reduce_scatter_single",
    "all_to_all_single",  # our FSDP's reduce-scatter on gloo
)


@contextmanager
def _ring_bytes(world_size: int) -> Iterator[Counter[str]]:
    """Per collective name, the bytes this rank sends in the ring model, inside the block."""
    import torch.distributed as dist

    counts: Counter[str] = Counter()
    share = (world_size - 1) / world_size
    originals = {name: getattr(dist, name) for name in _SPIED}

    def spy(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if name == "all_gather":
                outputs = args[0] if args else kwargs["tensor_list"]
                n = sum(o.numel() * o.element_size() for o in outputs)
                counts[name] += int(share * n)
                return originals[name](*args, **kwargs)
            if name in ("reduce_scatter_single", "all_to_all_single"):
                t = args[1] if len(args) > 1 else kwargs["input"]
            elif name == "all_gather_single":
                t = args[0] if args else kwargs["output_tensor"]
            else:
                t = args[0] if args else kwargs["tensor"]
            factor = 2 if name == "all_reduce" else 1
            counts[name] += int(factor * share * t.numel() * t.element_size())
            return originals[name](*args, **kwargs)

        return call

    for name in _SPIED:
        setattr(dist, name, spy(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


class _Trainer:
    """One variant on this rank: GPT, its wrapper and optimizer, its own data stream."""

    def __init__(self, variant: str, model_kwargs: dict[str, int]) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        import zero_optim
        from benchmarks.gpt import GPT, Block

        torch.manual_seed(0)
        self.model = GPT(**model_kwargs)
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.variant = variant
        self.counter = itertools.count()
        self.steps_in_backward = variant == OURS_OWNERS
        self.ddp_builtin = variant in (TORCH_ZERO, OURS_ZERO)  # DDP's C++ all-reduce
        adamw = torch.optim.AdamW
        self.opt: Any
        self.wrapped: Any
        if variant == FLOOR:
            import torch.distributed as dist

            # What any data-parallel step costs at least here: this rank's forward,
            # backward and AdamW on its 1/N of the parameters, no collective at all.
            self.wrapped = self.model
            params = list(self.model.parameters())
            self.opt = adamw(params[dist.get_rank() :: dist.get_world_size()], lr=LR)
            return
        if variant in FAMILIES["zero"]:
            self.wrapped = DistributedDataParallel(self.model)
            if variant == TORCH_ZERO:
                from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

                self.opt = TorchZeRO(self.model.parameters(), adamw, lr=LR)
            else:
                self.opt = zero_optim.ZeroRedundancyOptimizer(
                    self.model.parameters(), adamw, overlap_with_ddp=self.steps_in_backward, lr=LR
                )
                if self.steps_in_backward:
                    hook = zero_optim.hook_with_zero_step_to_owners(self.wrapped, self.opt)
                    self.wrapped.register_comm_hook(None, hook)
            return
        if variant in (TORCH_FSDP2, OURS_FSDP2):
            if variant == OURS_FSDP2:
                from fsdp import fully_shard
            else:
                from torch.distributed.fsdp import fully_shard
            for module in self.model.modules():
                if isinstance(module, Block):
                    fully_shard(module)
            fully_shard(self.model)
            self.wrapped = self.model
            self.opt = adamw(self.model.parameters(), lr=LR)
            return
        if variant in (OURS_FULL, OURS_SGO):
            import fsdp
            import fsdp.wrap

            api: Any = fsdp
            policy: Any = fsdp.wrap.ModuleWrapPolicy({Block})
        else:
            import torch.distributed.fsdp as torch_fsdp
            import torch.distributed.fsdp.wrap as torch_wrap

            api = torch_fsdp
            policy = torch_wrap.ModuleWrapPolicy({Block})
        strategy = "FULL_SHARD" if variant in (OURS_FULL, TORCH_FULL) else "SHARD_GRAD_OP"
        self.wrapped = api.FullyShardedDataParallel(
            self.model,
            sharding_strategy=api.ShardingStrategy[strategy],
            auto_wrap_policy=policy,
            device_id=torch.device("cpu"),
        )
        self.opt = adamw(self.wrapped.parameters(), lr=LR)

    def forward_backward(self) -> None:
        """Forward and backward on this variant's next batch (the same batches for all)."""
        import torch.distributed as dist

        from benchmarks.gpt import lm_loss, random_tokens

        seed = 1000 * next(self.counter) + dist.get_rank()
        tokens = random_tokens(self.model.config, BATCH, seed=seed)
        self.opt.zero_grad(set_to_none=True)
        if self.variant == FLOOR:  # its optimizer holds only this rank's 1/N
            self.model.zero_grad(set_to_none=True)
        lm_loss(self.wrapped, tokens).backward()

    def step(self) -> None:
        """One training step."""
        self.forward_backward()
        if not self.steps_in_backward:
            self.opt.step()

    def facts(self) -> dict[str, Any]:
        """One more step, counting its traffic and the model-state bytes before the update."""
        import torch.distributed as dist

        world = dist.get_world_size()
        with _ring_bytes(world) as counts:
            self.forward_backward()
            held = self._held_bytes()
            if not self.steps_in_backward:
                self.opt.step()
        traffic = sum(counts.values())
        if self.ddp_builtin:
            grads = sum(p.numel() * p.element_size() for p in self.model.parameters())
            traffic += int(2 * (world - 1) / world * grads)
        return {"held": held, "traffic": traffic, "param_bytes": self.param_bytes}

    def _held_bytes(self) -> int:
        import torch

        params = list(self.wrapped.parameters())
        held = sum(_local_bytes(p) for p in params)
        held += sum(_local_bytes(p.grad) for p in params if p.grad is not None)
        state = self.opt.optim.state if hasattr(self.opt, "optim") else self.opt.state
        held += sum(
            _local_bytes(t)
            for s in state.values()
            for k, t in s.items()
            if k != "step" and isinstance(t, torch.Tensor)
        )
        return int(held)


def _local_bytes(t: Any) -> int:
    """Bytes of ``t`` on this rank (a ``DTensor``'s local shard)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.numel() * local.element_size())


def _timing_rank(variants: list[str], model: dict[str, int], warmup: int, iters: int) -> Any:
    """The family's variants on this rank, stepped in turns; their times and facts."""
    trainers = {v: _Trainer(v, model) for v in variants}
    steps: dict[str, Callable[[], object]] = {v: t.step for v, t in trainers.items()}
    times = time_round_robin(steps, warmup=warmup, iters=iters)
    return {v: {"times": times[v], **t.facts()} for v, t in trainers.items()}


def _memory_rank(variant: str, model: dict[str, int]) -> int:
    """One variant alone in a fresh process: peak RSS after a few steps."""
    trainer = _Trainer(variant, model)
    for _ in range(MEMORY_STEPS):
        trainer.step()
    return peak_rss_bytes()


def _peak_rss(variants: list[str], world: int, model: dict[str, int]) -> dict[str, int]:
    """Each variant's peak RSS/rank, two variants' fresh launches at a time.

    Load does not change resident memory, so running two at once only saves
    the launches' start-up time.
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        peaks = pool.map(lambda v: max(launch(_memory_rank, world, v, model)), variants)
        return dict(zip(variants, peaks, strict=True))


def _selected(env: str, default: list[str]) -> list[str]:
    """The comma-separated values of environment variable ``env`` (all of ``default`` if unset)."""
    import os

    raw = os.environ.get(env, "")
    if not raw:
        return default
    chosen = [v.strip() for v in raw.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in default]
    if unknown:
        raise ValueError(f"{env}: unknown {unknown}; choose from {default}")
    return chosen


def _quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1]


def run(options: Options) -> list[Table]:
    """Every size, world size and family: time, measure memory, tabulate."""
    sizes = QUICK_SIZES if options.quick else SIZES
    warmup, iters = (1, 3) if options.quick else (1, 8)
    table = Table(
        f"ours vs torch, GPT at three sizes, batch {BATCH} x seq_len 64, gloo/CPU, AdamW fp32: "
        f"median of {iters * options.repeats} steps per variant",
        [
            "params",
            "N",
            "variant",
            "step",
            "vs torch",
            "paired",
            "peak RSS/rank",
            "vs torch",
            "state/rank",
            "vs ideal",
            "traffic/step",
            "x DDP",
        ],
    )
    families = _selected("BENCH_SCALE_FAMILIES", list(FAMILIES))
    worlds = [int(w) for w in _selected("BENCH_SCALE_WORLD_SIZES", [str(w) for w in WORLD_SIZES])]
    for label, model in sizes.items():
        for world in worlds:
            for variants in (FAMILIES[f] for f in families):
                per_step: dict[str, list[float]] = {v: [] for v in variants}
                ranks: list[Any] = []
                for _ in range(options.repeats):
                    ranks = launch(_timing_rank, world, variants, model, warmup, iters)
                    for v in variants:
                        times = [r[v]["times"] for r in ranks]
                        per_step[v] += [max(ts) for ts in zip(*times, strict=True)]
                rss = _peak_rss(variants, world, model)
                psi = ranks[0][variants[0]]["param_bytes"]
                ddp_traffic = 2 * (world - 1) / world * psi
                torch_v = variants[0]
                base = statistics.median(per_step[torch_v])
                for v in variants:
                    med = statistics.median(per_step[v])
                    paired = [a / b for a, b in zip(per_step[v], per_step[torch_v], strict=True)]
                    held = max(r[v]["held"] for r in ranks)
                    traffic = max(r[v]["traffic"] for r in ranks)
                    ideal = (8 + 8 / world) * psi / 4 if v in FAMILIES["zero"] else 4 * psi / world
                    table.add(
                        f"{psi / 4 / 1e6:.1f}M ({label})",
                        world,
                        v,
                        fmt_ms(med),
                        "-" if v == torch_v else ratio(med, base),
                        "-"
                        if v == torch_v
                        else f"{_quantile(paired, 0.25):.2f}-{_quantile(paired, 0.75):.2f}",
                        fmt_bytes(rss[v]),
                        "-" if v == torch_v else ratio(rss[v], rss[torch_v]),
                        fmt_bytes(held),
                        ratio(held, ideal),
                        fmt_bytes(traffic),
                        ratio(traffic, ddp_traffic),
                    )
                print("\n".join(table.render().splitlines()[-len(variants) :]), flush=True)
    table.notes += [
        "ideal state/rank (ZeRO paper, fp32 AdamW): stage 1 = (4 + 4 + 8/N) bytes per "
        "parameter for the ZeRO rows (the to-owners hook reduces like stage 2, but DDP still "
        "allocates every gradient); stage 3 = 16/N for every FSDP row",
        "fully_shard rows: vs torch = over torch's fully_shard; the FSDP1 row beside them is "
        "torch's FSDP1 FULL_SHARD, for reference",
        "traffic in the ring model; x DDP = over plain DDP's 2 x param bytes x (N-1)/N",
        "paired = 25th-75th percentile of per-round ratios ours/torch (same round, same load)",
    ]
    return [table]
