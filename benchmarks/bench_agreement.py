"""The agreement step's cost: construction with and without it, at 2 and 4 ranks.

[Note: agreement step] (flatparam's ``_agreement.py``) adds one all-to-all of a
digest where ranks must agree: at FSDP's lazy initialisation, at
ZeroRedundancyOptimizer's construction, at every ckpt save and load. Each rank
times, round-robin, the same construction with the step and with it replaced by
a no-op (the FSDP row: a GPT wrapped per block plus the lazy initialisation; the
ZeRO row: the optimizer over that GPT's parameters), and the agreement call
alone (ckpt's, which fingerprints only the call's path and options).
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import Options, Table, fmt_ms, median_step_s, ratio

DESCRIPTION = "agreement step: FSDP/ZeRO construction with and without it, 2 and 4 ranks"

MODEL = {"vocab": 512, "d_model": 128, "n_layers": 8, "n_heads": 4}
QUICK_MODEL = {"vocab": 64, "d_model": 32, "n_layers": 2, "n_heads": 2}
WORLD_SIZES = (2, 4)


def _timing_rank(model_kw: dict[str, Any], warmup: int, iters: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    import ckpt._commit.agreement as ckpt_agreement
    import fsdp._wrapper._fsdp_state as fsdp_state
    import zero_optim._optimizer as zero_module
    from benchmarks.common import time_round_robin
    from benchmarks.gpt import GPT, Block
    from ckpt._comm import Comm
    from fsdp import FullyShardedDataParallel
    from fsdp.wrap import ModuleWrapPolicy
    from zero_optim import ZeroRedundancyOptimizer

    real_fsdp, real_zero = fsdp_state.check_ranks_agree, zero_module.check_ranks_agree

    def build_fsdp(agree: bool) -> None:
        fsdp_state.check_ranks_agree = real_fsdp if agree else (lambda *a, **k: None)  # type: ignore[assignment]
        torch.manual_seed(0)
        model = FullyShardedDataParallel(
            GPT(**model_kw), auto_wrap_policy=ModuleWrapPolicy({Block})
        )
        model._fsdp_state.lazy_init()

    torch.manual_seed(0)
    params = list(GPT(**model_kw).parameters())

    def build_zero(agree: bool) -> None:
        zero_module.check_ranks_agree = real_zero if agree else (lambda *a, **k: None)  # type: ignore[assignment]
        ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=1e-3)

    comm = Comm.of(None)
    from pathlib import Path

    path = Path("/tmp/ckpt/step_00000100")

    def ckpt_agree() -> None:
        ckpt_agreement.check_ranks_agree("ckpt.save", comm, path, {"overwrite": False})

    steps = {
        "fsdp with": lambda: build_fsdp(True),
        "fsdp without": lambda: build_fsdp(False),
        "zero with": lambda: build_zero(True),
        "zero without": lambda: build_zero(False),
        "ckpt agreement alone": ckpt_agree,
    }
    times = time_round_robin(steps, warmup=warmup, iters=iters)
    dist.barrier()
    return times


def run(options: Options) -> list[Table]:
    """Time every variant at each world size, tabulate the difference."""
    from benchmarks.common import launch

    model = QUICK_MODEL if options.quick else MODEL
    warmup, iters = (1, 3) if options.quick else (3, 30)
    table = Table(
        f"Agreement step on GPT({', '.join(f'{k}={v}' for k, v in model.items())}), gloo/CPU: "
        f"median of {iters * options.repeats} constructions (slowest rank each)",
        ["what", "ranks", "without", "with", "added", "with/without"],
    )
    for world_size in WORLD_SIZES:
        pooled: dict[str, list[list[float]]] = {}
        for _ in range(options.repeats):
            ranks = launch(_timing_rank, world_size, model, warmup, iters, timeout=1200)
            for name in ranks[0]:
                per_rank = pooled.setdefault(name, [[] for _ in range(world_size)])
                for rank, result in enumerate(ranks):
                    per_rank[rank] += result[name]
        median = {name: median_step_s(times) for name, times in pooled.items()}
        for what in ("fsdp", "zero"):
            with_s, without_s = median[f"{what} with"], median[f"{what} without"]
            label = "FSDP wrap + lazy init" if what == "fsdp" else "ZeroRedundancyOptimizer()"
            table.add(
                label,
                world_size,
                fmt_ms(without_s),
                fmt_ms(with_s),
                fmt_ms(with_s - without_s),
                ratio(with_s, without_s),
            )
        alone = median["ckpt agreement alone"]
        table.add("ckpt agreement call alone", world_size, "-", fmt_ms(alone), fmt_ms(alone), "-")
    table.notes.append("one all-to-all of 3 int64 per rank when the ranks agree")
    return [table]
