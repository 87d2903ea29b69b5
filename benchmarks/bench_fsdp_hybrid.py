"""Hybrid sharding (HSDP) on 4 ranks as 2x2: ours vs torch's FSDP1 and FSDP2, small GPT.

Every variant shards each GPT block (and the root: embeddings, final norm,
head) inside a shard group of 2 ranks and replicates across the 2 groups, on
one 2-D ``DeviceMesh`` ``(replicate=2, shard=2)``, gloo on CPU, AdamW. Step
times come from one set of 4 rank processes that holds every variant and steps
them in turns (load from elsewhere on the machine hits all alike); memory
comes from fresh processes per variant. Columns:

* step: median wall time of a training step (forward, backward with the
  reduce-scatter in the shard group and the all-reduce across replicas,
  optimizer step), each step as long as its slowest rank;
* vs FSDP1: that time over torch's FSDP1 with the same strategy (the target
  is at most 1.00x);
* peak RSS/rank: the largest peak resident set size among the ranks, and its
  ratio to torch's FSDP1 with the same strategy;
* same params as FSDP1: whether the final full parameters equal those of
  torch's FSDP1 with the same strategy, bit for bit (ours) or within 1e-5
  (FSDP2, which sums gradients in another order).
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

DESCRIPTION = "HYBRID_SHARD (2x2 mesh): ours vs torch FSDP1 HYBRID_SHARD and FSDP2 HSDP (GPT)"

WORLD_SIZE = 4
MESH = (2, 2)  # (replicate, shard)
MODEL = {"vocab": 4096, "d_model": 256, "n_layers": 4, "n_heads": 4, "seq_len": 64}
QUICK_MODEL = {"vocab": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}
BATCH = 4
LR = 1e-3
MEMORY_STEPS = 3

OURS = "ours HYBRID_SHARD"
FSDP1 = "torch FSDP1 HYBRID_SHARD"
FSDP2 = "torch FSDP2 fully_shard (HSDP)"
OURS_Z2 = "ours _HYBRID_SHARD_ZERO2"
FSDP1_Z2 = "torch FSDP1 _HYBRID_SHARD_ZERO2"
FSDP2_Z2 = "torch FSDP2 HSDP, no reshard after forward"
# variant -> the FSDP1 row it is compared with
BASELINE = {
    OURS: FSDP1,
    FSDP1: FSDP1,
    FSDP2: FSDP1,
    OURS_Z2: FSDP1_Z2,
    FSDP1_Z2: FSDP1_Z2,
    FSDP2_Z2: FSDP1_Z2,
}
VARIANTS = list(BASELINE)


class _Trainer:
    """One variant on this rank: GPT wrapped on the shared mesh, AdamW, its own data stream."""

    def __init__(self, variant: str, model_kwargs: dict[str, int], mesh: Any) -> None:
        import torch

        from benchmarks.gpt import GPT, Block

        torch.manual_seed(0)
        net = GPT(**model_kwargs)
        zero2 = variant in (OURS_Z2, FSDP1_Z2, FSDP2_Z2)
        self.model: Any
        if variant in (FSDP2, FSDP2_Z2):
            from torch.distributed.fsdp import fully_shard

            for block in net.blocks:
                fully_shard(block, mesh=mesh, reshard_after_forward=not zero2)
            self.model = fully_shard(net, mesh=mesh, reshard_after_forward=not zero2)
        else:
            if variant in (OURS, OURS_Z2):
                import fsdp as api
                from fsdp.wrap import ModuleWrapPolicy
            else:
                import torch.distributed.fsdp as api  # type: ignore[no-redef]
                from torch.distributed.fsdp.wrap import (  # type: ignore[assignment]
                    ModuleWrapPolicy,
                )
            strategy = "_HYBRID_SHARD_ZERO2" if zero2 else "HYBRID_SHARD"
            self.model = api.FullyShardedDataParallel(
                net,
                sharding_strategy=api.ShardingStrategy[strategy],
                device_mesh=mesh,
                auto_wrap_policy=ModuleWrapPolicy({Block}),
                device_id=torch.device("cpu"),
            )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.variant = variant
        self.config = net.config
        self.counter = itertools.count()

    def step(self) -> None:
        """One training step on this variant's next batch (the same batches for all)."""
        import torch.distributed as dist

        from benchmarks.gpt import lm_loss, random_tokens

        seed = 1000 * next(self.counter) + dist.get_rank()
        tokens = random_tokens(self.config, BATCH, seed=seed)
        self.opt.zero_grad(set_to_none=True)
        lm_loss(self.model, tokens).backward()
        self.opt.step()

    def full_params(self) -> dict[str, Any]:
        """The full parameters by unwrapped name (a collective: every rank calls it)."""
        if self.variant in (FSDP2, FSDP2_Z2):
            return {n: p.full_tensor().detach().clone() for n, p in self.model.named_parameters()}
        with type(self.model).summon_full_params(self.model):
            return {
                n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                for n, p in self.model.named_parameters()
            }


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    if sorted(a) != sorted(b):
        return float("inf")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", MESH, mesh_dim_names=("replicate", "shard"))


def _timing_rank(model: dict[str, int], warmup: int, iters: int) -> dict[str, Any]:
    """Every variant on this rank, stepped in turns; their times and parameter agreement."""
    mesh = _mesh()
    trainers = {v: _Trainer(v, model, mesh) for v in VARIANTS}
    steps: dict[str, Callable[[], object]] = {v: t.step for v, t in trainers.items()}
    times = time_round_robin(steps, warmup=warmup, iters=iters)
    params = {v: t.full_params() for v, t in trainers.items()}
    return {
        v: {"times": times[v], "vs_fsdp1": _max_diff(params[v], params[BASELINE[v]])}
        for v in VARIANTS
    }


def _memory_rank(variant: str, model: dict[str, int]) -> dict[str, Any]:
    """One variant alone in a fresh process: peak RSS after a few steps."""
    trainer = _Trainer(variant, model, _mesh())
    for _ in range(MEMORY_STEPS):
        trainer.step()
    return {"peak_rss": peak_rss_bytes()}


def run(options: Options) -> list[Table]:
    """Time all variants together, measure each one's memory alone, tabulate."""
    model = QUICK_MODEL if options.quick else MODEL
    warmup, iters = (1, 3) if options.quick else (3, 30)
    times, facts = timed_runs(
        _timing_rank, WORLD_SIZE, VARIANTS, model, warmup, iters, repeats=options.repeats
    )
    memory = {v: launch(_memory_rank, WORLD_SIZE, v, model, timeout=600) for v in VARIANTS}

    rss = {v: max(r["peak_rss"] for r in memory[v]) for v in VARIANTS}
    table = Table(
        f"HSDP on GPT({', '.join(f'{k}={v}' for k, v in model.items())}), batch {BATCH}, "
        f"{WORLD_SIZE} ranks as {MESH[0]} replicas x {MESH[1]} shards, gloo/CPU, AdamW: "
        f"median of {iters * options.repeats} steps",
        ["variant", "step", "vs FSDP1", "peak RSS/rank", "RSS vs FSDP1", "same params as FSDP1"],
    )
    for v in VARIANTS:
        diff = max(r[v]["vs_fsdp1"] for r in facts)
        same = "yes (bitwise)" if diff == 0.0 else f"within {diff:.1e}"
        table.add(
            v,
            fmt_ms(times[v]),
            ratio(times[v], times[BASELINE[v]]),
            fmt_bytes(rss[v]),
            ratio(rss[v], rss[BASELINE[v]]),
            same,
        )
    table.notes += [
        "each block and the root are one unit in every variant; "
        "FSDP2 keeps parameters as per-parameter DTensors instead of one flat parameter per unit",
    ]
    return [table]
