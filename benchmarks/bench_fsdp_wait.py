"""Exposed communication in our FSDP: time spent waiting for gathers and reductions per step.

Two ranks (gloo, CPU), the ~30M GPT of ``bench_scale``, FULL_SHARD, one unit
per block, AdamW. Each rank wraps ``FlatParamUnit.wait_for_unshard`` and
``FlatParamUnit.finish_reduce_grad`` with timers (benchmark code only): the
time inside them is communication the computation did not hide; gather waits
are split into forward (gradients enabled) and backward. Rows compare the
default (``BACKWARD_PRE``; in forward the next unit's all-gather is issued
before the current unit computes, see [Note: issue-ahead] in
``fsdp/_root_context.py``) with ``limit_all_gathers=False``, where each unit
gathers on entry in forward: the default before issue-ahead, so the pair is a
before/after. The variants step in turns in one launch.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import Options, Table, fmt_ms, launch, time_round_robin

DESCRIPTION = "our FSDP's exposed gather/reduce wait per step, issue-ahead on/off (2 ranks)"

MODEL = {"vocab": 4096, "d_model": 512, "n_layers": 8, "n_heads": 8, "seq_len": 64}
QUICK_MODEL = {"vocab": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}
BATCH = 4
KINDS = ("gather fwd", "gather bwd", "reduce")
VARIANTS = {  # name -> limit_all_gathers
    "gather on entry (limit_all_gathers=False)": False,
    "default (issue-ahead)": True,
}


def _rank(model_kwargs: dict[str, int], warmup: int, iters: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import fsdp
    import fsdp.wrap
    from benchmarks.gpt import GPT, Block, lm_loss, random_tokens
    from fsdp._wrapper._flat_param_unit import FlatParamUnit

    waited = dict.fromkeys(KINDS, 0.0)

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            kind = name
            if name == "gather":  # the forward runs with gradients on, backward hooks without
                kind = "gather fwd" if torch.is_grad_enabled() else "gather bwd"
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                waited[kind] += time.perf_counter() - start

        return call

    FlatParamUnit.wait_for_unshard = timed("gather", FlatParamUnit.wait_for_unshard)  # type: ignore[method-assign]
    FlatParamUnit.finish_reduce_grad = timed("reduce", FlatParamUnit.finish_reduce_grad)  # type: ignore[method-assign]

    per_variant: dict[str, dict[str, list[float]]] = {}
    steps: dict[str, Callable[[], object]] = {}
    for name, limit in VARIANTS.items():
        torch.manual_seed(0)
        gpt = GPT(**model_kwargs)
        wrapped = fsdp.FullyShardedDataParallel(
            gpt,
            auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({Block}),
            limit_all_gathers=limit,
            device_id=torch.device("cpu"),
        )
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
        counter = itertools.count()
        record = per_variant.setdefault(name, {k: [] for k in KINDS})

        def step(
            wrapped: Any = wrapped,
            opt: Any = opt,
            counter: Any = counter,
            record: Any = record,
            config: Any = gpt.config,
        ) -> None:
            for k in KINDS:
                waited[k] = 0.0
            tokens = random_tokens(config, BATCH, seed=1000 * next(counter) + dist.get_rank())
            opt.zero_grad(set_to_none=True)
            lm_loss(wrapped, tokens).backward()
            opt.step()
            for k in KINDS:
                record[k].append(waited[k])

        steps[name] = step
    times = time_round_robin(steps, warmup=warmup, iters=iters)
    return {
        name: {"times": times[name], **{k: v[-iters:] for k, v in rec.items()}}
        for name, rec in per_variant.items()
    }


def run(options: Options) -> list[Table]:
    """Both variants in turns; median step and exposed waits per step (rank 0)."""
    model = QUICK_MODEL if options.quick else MODEL
    warmup, iters = (1, 3) if options.quick else (2, 10 * options.repeats)
    ranks = launch(_rank, 2, model, warmup, iters)
    table = Table(
        f"our FSDP FULL_SHARD, GPT({', '.join(f'{k}={v}' for k, v in model.items())}), 2 ranks, "
        f"gloo/CPU: medians of {iters} steps",
        ["variant", "step", *(f"{k} wait/step" for k in KINDS), "exposed/step"],
    )
    for name in VARIANTS:
        step = statistics.median(
            max(ts) for ts in zip(*(r[name]["times"] for r in ranks), strict=True)
        )
        waits = [statistics.median(ranks[0][name][k]) for k in KINDS]
        exposed = statistics.median(
            sum(w) for w in zip(*(ranks[0][name][k] for k in KINDS), strict=True)
        )
        table.add(name, fmt_ms(step), *(fmt_ms(w) for w in waits), fmt_ms(exposed))
    table.notes.append(
        "waits measured on rank 0, inside wait_for_unshard / finish_reduce_grad; "
        "exposed: median of the per-step sums"
    )
    return [table]
