"""gloo's sharded collectives, native vs composed: the measurement behind FSDP's choice.

One unit's buffer (7M and 1M elements, fp32) on 2 and 4 gloo/CPU ranks:
gloo's ``all_gather_into_tensor`` against one broadcast per rank (what our
FSDP runs on gloo), and gloo's ``reduce_scatter_tensor`` against an
all-to-all and a local sum in rank order (ditto); see [Note: gloo's sharded
collectives] in ``fsdp/_collectives.py``. Every variant moves the same bytes
per rank. Times are the median of 7 calls, each as long as its slowest rank,
with a barrier before each call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import Options, Table, fmt_ms, launch, ratio

DESCRIPTION = "gloo all-gather / reduce-scatter: native vs FSDP's composites (2 and 4 ranks)"

SIZES = (7_000_000, 1_000_000)
QUICK_SIZES = (10_000,)
WORLD_SIZES = (2, 4)
CALLS = 7


def _rank(numel: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    import fsdp._runtime._collectives as collectives

    world = dist.get_world_size()
    shard = torch.randn(numel // world)
    gathered = torch.empty(numel)
    full = torch.randn(numel)
    out = torch.empty(numel // world)

    def with_composites(on: bool, fn: Callable[[], Any]) -> Callable[[], None]:
        def call() -> None:
            collectives.GLOO_COMPOSITES = on
            fn().wait()

        return call

    variants = {
        "all-gather native": with_composites(
            False, lambda: collectives.all_gather_into(gathered, shard, None)
        ),
        "all-gather by broadcasts": with_composites(
            True, lambda: collectives.all_gather_into(gathered, shard, None)
        ),
        "reduce-scatter native": with_composites(
            False, lambda: collectives.reduce_scatter_into(out, full, None)
        ),
        "reduce-scatter by all-to-all": with_composites(
            True, lambda: collectives.reduce_scatter_into(out, full, None)
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for name, call in variants.items():
        call()  # warm-up: connections and allocations
        for _ in range(CALLS):
            dist.barrier()
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return times


def run(options: Options) -> list[Table]:
    """Every size and world size; one row per variant."""
    table = Table(
        f"gloo/CPU fp32, median of {CALLS} calls (slowest rank)",
        ["elements", "N", "collective", "time", "vs native"],
    )
    for numel in QUICK_SIZES if options.quick else SIZES:
        for world in WORLD_SIZES:
            ranks = launch(_rank, world, numel)
            medians = {
                name: statistics.median(
                    max(ts) for ts in zip(*(r[name] for r in ranks), strict=True)
                )
                for name in ranks[0]
            }
            for name, med in medians.items():
                native = medians[name.split(" ")[0] + " native"]
                table.add(
                    f"{numel:,}",
                    world,
                    name,
                    fmt_ms(med),
                    "-" if name.endswith("native") else ratio(med, native),
                )
    return [table]
