"""The two-level benchmark's pure logic and its command line, without machines.

``python -m benchmarks two-level`` makes simulated machines (root) and runs for
minutes; here are what decides what it measures: the plan from its flags (shared
with ``slow-link``: one definition, both modules get the values), and the summary
of the ranks' numbers into the table.
"""

from __future__ import annotations

import pytest

import benchmarks.__main__ as cli
from benchmarks import bench_slow_link as sl
from benchmarks import bench_two_level as tl
from benchmarks.common import Options


def test_plan() -> None:
    plan = tl.Plan.from_options(Options())
    assert (list(plan.sizes), plan.rates) == (["30M", "60M"], ["1gbit", "10gbit"])
    assert (plan.steps, plan.warmup, plan.batch) == (tl.STEPS, tl.WARMUP, tl.BATCH)
    flags = {"sizes": ["60M"], "rates": ["500mbit"], "steps": 2, "warmup": 0, "batch": 1}
    plan = tl.Plan.from_options(Options(repeats=2, flags=flags))
    assert (list(plan.sizes), plan.rates, plan.steps, plan.batch) == (["60M"], ["500mbit"], 4, 1)
    assert plan.warmup == 1  # the first step counts the memory: never skipped
    quick = tl.Plan.from_options(Options(quick=True))
    assert (list(quick.sizes), quick.rates, quick.steps) == (["tiny"], ["1gbit"], 1)


def test_shared_flags_reach_both_benchmarks(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Options] = {}
    for module in (sl, tl):
        monkeypatch.setattr(module, "preflight", lambda options: None)
        name = module.__name__
        monkeypatch.setattr(module, "run", lambda options, n=name: seen.update({n: options}) or [])
    argv = ["two-level", "slow-link", "--rates", "1gbit", "--sizes", "30M", "--world-sizes", "2"]
    assert cli.main(argv) == 0
    both = {"rates": ["1gbit"], "sizes": ["30M"]}
    assert dict(seen[tl.__name__].flags) == both
    assert dict(seen[sl.__name__].flags) == {**both, "world_sizes": [2]}


def _rank(times: list[float], sent: list[int], master: int) -> dict[str, object]:
    memory = {"master": master, "replica": 0, "grads": master, "optim": 2 * master}
    variants = tl.LAUNCHES[0]
    return {
        "variants": {v: {"times": times, "bytes": sent} for v in variants},
        "memory": {v: memory for v in variants},
        "params": 7_000_000,
    }


def test_summarize() -> None:
    ranks = [
        _rank([1.0, 2.0, 3.0], [100, 300, 200], 10),
        _rank([1.5, 1.0, 4.0], [0, 0, 0], 12),  # a machine's cable is read by its first rank
        _rank([1.0, 1.0, 1.0], [400, 500, 600], 10),
        _rank([1.0, 1.0, 1.0], [0, 0, 0], 10),
    ]
    rows = tl.summarize(ranks)
    row = rows[tl.OURS_ACROSS]
    assert row.step_s == 2.0  # slowest rank per step: 1.5, 2.0, 4.0
    assert row.link_bytes == 350  # medians 200 and 500, mean of the two machines
    assert row.memory == {"master": 12, "replica": 0, "grads": 12, "optim": 24}  # the largest
    cells = tl.table_rows("30M", 10**9, 7_000_000, rows)
    assert [c[2] for c in cells] == list(tl.LAUNCHES[0])
    assert sorted({v for launch in tl.LAUNCHES for v in launch}) == sorted(tl.VARIANTS)
    assert all(tl.TORCH_WORLD in launch for launch in tl.LAUNCHES)  # every launch's reference
    assert cells[0][:2] == ["7.0M (30M)", "1 Gbit/s"]
    assert cells[0][4:6] == ["1.00x", "1.00x"] and cells[0][9] == "-"  # equal times here
