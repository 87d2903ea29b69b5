"""Our FullyShardedDataParallel vs torch's FSDP1 and FSDP2 (``fully_shard``) vs DDP, on a GPT.

Two ranks (gloo, CPU), AdamW, one unit per transformer block plus the root,
the same model and data for every variant. Step times come from one pair of
rank processes that holds every variant and steps them in turns (so load from
elsewhere on the machine hits all alike); peak RSS comes from one fresh pair of
processes per variant. Columns:

* step: median wall time of a training step (forward, backward, optimizer
  step), each step as long as its slowest rank;
* vs FSDP1: that time over torch's FSDP1 with the same sharding strategy
  (target: at most 1.00x); FSDP2 and DDP rows are compared with FSDP1
  FULL_SHARD;
* state/rank: bytes of parameters + gradients + AdamW state held by a rank
  after a step (flat shards for FSDP, local DTensor shards for FSDP2);
  vs ZeRO-3: that over the ideal ``4 x parameter bytes / N`` (parameters,
  gradients and two AdamW moments, each split evenly);
* comm/step: bytes moved per step per rank, counting each collective's full
  tensor (all-gather output, reduce-scatter input, 2x an all-reduce);
  x params: that over the model's parameter bytes;
* peak RSS/rank: the largest peak resident set size among the ranks;
* same params: whether the final parameters equal DDP's bit for bit.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import defaultdict
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
    timed_runs,
)

DESCRIPTION = "fsdp vs torch FSDP1 vs torch fully_shard (FSDP2) vs DDP (GPT, 2 ranks)"

WORLD_SIZE = 2
MODEL = {"vocab": 4096, "d_model": 256, "n_layers": 4, "n_heads": 4, "seq_len": 64}
QUICK_MODEL = {"vocab": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}
BATCH = 4
LR = 1e-3
MEMORY_STEPS = 3  # steps before reading peak RSS: optimizer state exists after the first

OURS_FULL = "ours FULL_SHARD"
TORCH_FULL = "torch FSDP1 FULL_SHARD"
OURS_SGO = "ours SHARD_GRAD_OP"
TORCH_SGO = "torch FSDP1 SHARD_GRAD_OP"
FSDP2 = "torch fully_shard (FSDP2)"
DDP = "DDP"
# variant -> the torch FSDP1 row it is compared with
BASELINE = {
    OURS_FULL: TORCH_FULL,
    TORCH_FULL: TORCH_FULL,
    OURS_SGO: TORCH_SGO,
    TORCH_SGO: TORCH_SGO,
    FSDP2: TORCH_FULL,
    DDP: TORCH_FULL,
}
VARIANTS = list(BASELINE)

_SPIED = ("all_gather_single", "all_gather", "reduce_scatter_single", "all_reduce", "broadcast")


@contextmanager
def _count_bytes() -> Iterator[dict[str, int]]:
    """Bytes of every collective called through ``torch.distributed`` inside the block."""
    import torch.distributed as dist

    counts: dict[str, int] = defaultdict(int)
    originals = {name: getattr(dist, name) for name in _SPIED}

    def spy(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            def arg(i: int, key: str) -> Any:
                return args[i] if len(args) > i else kwargs[key]

            if name == "all_gather_single":
                t = arg(0, "output_tensor")
                counts[name] += t.numel() * t.element_size()
            elif name == "all_gather":
                counts[name] += sum(t.numel() * t.element_size() for t in arg(0, "tensor_list"))
            elif name == "reduce_scatter_single":
                t = arg(1, "input")
                counts[name] += t.numel() * t.element_size()
            else:  # all_reduce (counted twice: reduce-scatter + all-gather) or broadcast
                t = arg(0, "tensor")
                counts[name] += (2 if name == "all_reduce" else 1) * t.numel() * t.element_size()
            return originals[name](*args, **kwargs)

        return call

    for name in _SPIED:
        setattr(dist, name, spy(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _build(variant: str, model: Any) -> Any:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks.gpt import Block

    cpu = torch.device("cpu")
    if variant == DDP:
        return DistributedDataParallel(model)
    if variant == FSDP2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
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
    return api.FullyShardedDataParallel(
        model,
        sharding_strategy=api.ShardingStrategy[strategy],
        auto_wrap_policy=policy,
        device_id=cpu,
    )


def _full_params(variant: str, wrapped: Any) -> list[Any]:
    """All parameters, full, in the unwrapped model's order."""
    if variant == DDP:
        return [p.detach() for p in wrapped.module.parameters()]
    if variant == FSDP2:
        return [p.full_tensor().detach() for p in wrapped.parameters()]
    with type(wrapped).summon_full_params(wrapped):
        return [p.detach().clone() for p in wrapped.parameters()]


def _local_bytes(t: Any) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.numel() * local.element_size())


class _Trainer:
    """One variant on this rank: GPT, its wrapper, AdamW, and its own data stream."""

    def __init__(self, variant: str, model_kwargs: dict[str, int]) -> None:
        import torch

        from benchmarks.gpt import GPT

        torch.manual_seed(0)
        self.model = GPT(**model_kwargs)
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.variant = variant
        self.wrapped = _build(variant, self.model)
        self.opt = torch.optim.AdamW(self.wrapped.parameters(), lr=LR)
        self.counter = itertools.count()

    def forward_backward(self) -> None:
        """Forward and backward on this variant's next batch (the same batches for all)."""
        import torch.distributed as dist

        from benchmarks.gpt import lm_loss, random_tokens

        seed = 1000 * next(self.counter) + dist.get_rank()
        tokens = random_tokens(self.model.config, BATCH, seed=seed)
        self.opt.zero_grad(set_to_none=True)
        lm_loss(self.wrapped, tokens).backward()

    def step(self) -> None:
        """One training step."""
        self.forward_backward()
        self.opt.step()

    def facts(self) -> dict[str, Any]:
        """One more step, counting its communication and the bytes held before the
        optimizer step; then a hash of the full parameters."""
        import torch

        with _count_bytes() as counts:
            self.forward_backward()
        params = list(self.wrapped.parameters())
        held = sum(_local_bytes(p) for p in params)
        held += sum(_local_bytes(p.grad) for p in params if p.grad is not None)
        held += sum(
            _local_bytes(t)
            for s in self.opt.state.values()
            for k, t in s.items()
            if k != "step" and isinstance(t, torch.Tensor)
        )
        self.opt.step()
        digest = hashlib.sha256()
        for p in _full_params(self.variant, self.wrapped):
            digest.update(p.contiguous().numpy().tobytes())
        return {
            "held_bytes": held,
            "comm_bytes": sum(counts.values()),
            "param_bytes": self.param_bytes,
            "params_sha256": digest.hexdigest(),
        }


def _timing_rank(model: dict[str, int], warmup: int, iters: int) -> dict[str, Any]:
    """Every variant on this rank, stepped in turns; their times and facts."""
    trainers = {v: _Trainer(v, model) for v in VARIANTS}
    steps: dict[str, Callable[[], object]] = {v: t.step for v, t in trainers.items()}
    times = time_round_robin(steps, warmup=warmup, iters=iters)
    return {v: {"times": times[v], **t.facts()} for v, t in trainers.items()}


def _memory_rank(variant: str, model: dict[str, int]) -> int:
    """One variant alone in a fresh process: peak RSS after a few steps."""
    trainer = _Trainer(variant, model)
    for _ in range(MEMORY_STEPS):
        trainer.step()
    return peak_rss_bytes()


def run(options: Options) -> list[Table]:
    """Time all variants together, measure each one's memory alone, tabulate."""
    model = QUICK_MODEL if options.quick else MODEL
    warmup, iters = (1, 3) if options.quick else (3, 30)
    times, facts = timed_runs(
        _timing_rank, WORLD_SIZE, VARIANTS, model, warmup, iters, repeats=options.repeats
    )
    rss = {v: max(launch(_memory_rank, WORLD_SIZE, v, model, timeout=600)) for v in VARIANTS}

    param_bytes = facts[0][DDP]["param_bytes"]
    ideal = 4 * param_bytes / WORLD_SIZE
    table = Table(
        f"FSDP on GPT({', '.join(f'{k}={v}' for k, v in model.items())}), batch {BATCH}, "
        f"{WORLD_SIZE} ranks, gloo/CPU, AdamW, one unit per block: median of "
        f"{iters * options.repeats} steps",
        [
            "variant",
            "step",
            "vs FSDP1",
            "state/rank",
            "vs ZeRO-3",
            "comm/step",
            "x params",
            "peak RSS/rank",
            "RSS vs FSDP1",
            "same params",
        ],
    )
    for v in VARIANTS:
        held = max(r[v]["held_bytes"] for r in facts)
        comm = max(r[v]["comm_bytes"] for r in facts)
        same = all(r[v]["params_sha256"] == r[DDP]["params_sha256"] for r in facts)
        table.add(
            v,
            fmt_ms(times[v]),
            ratio(times[v], times[BASELINE[v]]),
            f"{fmt_bytes(held)} ({held} B)",
            ratio(held, ideal),
            "-" if v == DDP else fmt_bytes(comm),
            "-" if v == DDP else ratio(comm, param_bytes),
            fmt_bytes(rss[v]),
            ratio(rss[v], rss[BASELINE[v]]),
            "yes" if same else "NO",
        )
    table.notes += [
        f"model parameters {fmt_bytes(param_bytes)} ({param_bytes} B); ZeRO-3 ideal state/rank "
        f"{ideal:.0f} B (4 x params / {WORLD_SIZE}); the excess is flat-parameter padding",
        "FULL_SHARD moves < 3x params: the root unit (embeddings, head) stays gathered "
        "between forward and backward, as in torch's FSDP1",
        "DDP's all-reduce runs inside its C++ reducer, out of the Python spies' sight (2x params)",
        "same params: bit-for-bit equal to DDP's after every step taken here",
    ]
    return [table]
