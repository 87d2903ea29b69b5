"""What every benchmark needs: ranks in fresh processes, timings, memory, tables.

A benchmark module (``benchmarks/bench_<name>.py``) defines ``DESCRIPTION`` (one
line) and ``run(options: Options) -> list[Table]``; ``python -m benchmarks``
finds it, runs it and prints its tables (see ``benchmarks/__main__.py``). A
typical ``run``:

1. Time: :func:`launch` one module-level function on ``N`` rank processes
   that builds every variant and times their steps with
   :func:`time_round_robin`: one step of each variant in turn, a barrier
   before each. Load from other processes on the machine then slows every
   variant alike, which separate runs per variant cannot promise.
2. Memory: :func:`launch` each variant again in fresh processes (peak RSS
   never goes down within a process) and read :func:`peak_rss_bytes`.
3. Combine the ranks with :func:`median_step_s` (each step lasts as long as
   its slowest rank; the median over steps) and build a :class:`Table` whose
   ratio columns come from :func:`ratio`.

Ranks return small picklable values (numbers, hashes), not tensors: the
launching process should stay small, and it imports no torch itself.

Ranks use gloo on CPU tensors unless the benchmark moves its model to CUDA;
:func:`time_steps` synchronises CUDA when it is in use, so the times are
device-agnostic. ``OMP_NUM_THREADS`` (1 under ``nox -s bench``) is passed on to
every rank, and each rank also calls ``torch.set_num_threads`` with it.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import resource
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "Options",
    "RankReport",
    "Table",
    "fmt_bytes",
    "fmt_ms",
    "launch",
    "median_step_s",
    "peak_rss_bytes",
    "proc_status_kb",
    "ratio",
    "time_round_robin",
    "time_steps",
]

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Options:
    """Command-line options every benchmark receives.

    ``quick`` asks for a smoke run (fewer and smaller steps) that checks the
    benchmark works, not what it measures; ``repeats`` runs each comparison
    that many times, alternating the variants' order, and pools the steps;
    ``flags`` holds the benchmark's own flags that were given on the command
    line (by ``dest``; see ``add_arguments`` in ``benchmarks/__main__.py``).
    """

    quick: bool = False
    repeats: int = 1
    flags: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {self.repeats}")


@dataclass
class RankReport:
    """What one rank measured for one variant (keep it small: it is pickled home)."""

    step_times_s: list[float]  # one wall time per timed step, in order
    peak_rss_bytes: int
    extra: dict[str, Any] = field(default_factory=dict)  # benchmark-specific numbers


# ----------------------------------------------------------------- launching


def launch(fn: Callable[..., T], world_size: int, *args: Any, timeout: float = 600.0) -> list[T]:
    """Run ``fn(*args)`` on ``world_size`` fresh processes with a gloo group; rank-ordered results.

    ``fn`` must be a module-level function (it is pickled into spawned
    interpreters). Each process initialises the default process group
    (``file://`` rendezvous in a temporary folder, so no port is needed),
    runs ``fn`` and destroys the group. A rank that raises makes this raise
    with that rank's traceback; a run longer than ``timeout`` seconds is
    killed and raises ``TimeoutError``.
    """
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-") as folder:
        procs = [
            ctx.Process(target=_rank_main, args=(fn, args, rank, world_size, (folder, timeout)))
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            if any(p.is_alive() for p in procs):
                raise TimeoutError(f"{fn.__qualname__} on {world_size} ranks ran over {timeout} s")
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        return read_results(
            folder,
            world_size,
            f"of {fn.__qualname__}",
            lambda rank: f"rank {rank} of {fn.__qualname__} exited ({procs[rank].exitcode})",
        )


def result_path(folder: str, rank: int) -> Path:
    """Where a launched rank leaves its outcome: ``("ok", value)`` or ``("raised", text)``."""
    return Path(folder) / f"rank{rank}.pkl"


def run_rank(
    folder: str,
    rank: int,
    world_size: int,
    work: Callable[[], Any],
    *,
    init_method: str,
    timeout: float,
) -> None:
    """One launched rank: a gloo group (every collective bounded by ``timeout``), ``work()``,
    the group destroyed, and the outcome (or the traceback) in :func:`result_path`."""
    import torch.distributed as dist

    record: tuple[str, Any]
    try:
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        record = ("ok", work())
    except BaseException:
        record = ("raised", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    result_path(folder, rank).write_bytes(pickle.dumps(record))


def read_results(
    folder: str, world_size: int, who: str, missing: Callable[[int], str]
) -> list[Any]:
    """Every rank's value from :func:`run_rank`'s files, rank-ordered; raises with the first
    rank's traceback (``who`` names the launch), or ``missing(rank)`` for a rank that left
    no file (killed before it could say why)."""
    results = []
    for rank in range(world_size):
        path = result_path(folder, rank)
        if not path.exists():
            raise RuntimeError(missing(rank))
        status, value = pickle.loads(path.read_bytes())
        if status != "ok":
            raise RuntimeError(f"rank {rank} {who} raised:\n{value}")
        results.append(value)
    return results


def _rank_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    rank: int,
    world_size: int,
    where: tuple[str, float],  # (temporary folder, timeout in seconds)
) -> None:
    import torch

    folder, timeout = where
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # every rank is on this host
    init_method = f"file://{Path(folder) / 'rendezvous'}"
    run_rank(folder, rank, world_size, lambda: fn(*args), init_method=init_method, timeout=timeout)


# ----------------------------------------------------------------- measuring


def proc_status_kb(field: str) -> int:
    """A kB field of this process's /proc/self/status (``VmRSS`` now, ``VmHWM`` peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def time_steps(step: Callable[[], object], *, warmup: int, iters: int) -> list[float]:
    """Wall time of each of ``iters`` calls of ``step`` after ``warmup`` untimed ones.

    Call on every rank: a barrier before each timed step lines the ranks up,
    so a step's time on a rank includes waiting for slower ranks inside the
    step's collectives, as in training, but not the skew left by the previous
    step. CUDA work is synchronised before the clock stops.
    """
    import torch
    import torch.distributed as dist

    def sync() -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return times


def time_round_robin(
    steps: dict[str, Callable[[], object]], *, warmup: int, iters: int
) -> dict[str, list[float]]:
    """Wall times of ``iters`` steps of every variant, taken in turns.

    Round ``i`` runs one step of each variant, starting at a different variant
    each round; each timed step is lined up by :func:`time_steps`' barrier.
    Returns each variant's times in its own step order.
    """
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(iters):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            times[name] += time_steps(steps[name], warmup=0, iters=1)
    return times


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes.

    On Linux it is ``VmHWM`` from ``/proc/self/status``: the peak of this
    process's own memory since it started. ``getrusage``'s ``ru_maxrss`` would
    also count its parent's resident set at the moment it was forked, which
    survives ``exec`` and makes spawned ranks look as big as their launcher.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def median_step_s(per_rank_times: Sequence[Sequence[float]]) -> float:
    """Median step time; each step lasts as long as its slowest rank.

    ``per_rank_times[rank][step]``: one variant's step times on every rank (the
    steps of several runs may be concatenated, in the same order on each rank).
    """
    return statistics.median(max(ts) for ts in zip(*per_rank_times, strict=True))


# ------------------------------------------------------------------ reporting


def timed_runs(
    timing_rank: Callable[..., dict[str, dict[str, Any]]],
    world_size: int,
    variants: Sequence[str],
    *args: Any,
    repeats: int,
    timeout: float = 1800.0,
) -> tuple[dict[str, float], list[dict[str, dict[str, Any]]]]:
    """Median step time per variant over ``repeats`` launches of ``timing_rank``, and the
    per-rank results of the last launch (its facts: bytes, hashes, losses).

    ``timing_rank(*args)`` returns, per variant, a dict with that rank's step ``"times"``;
    the times of every rank and launch are pooled before the median is taken.
    """
    timed: dict[str, list[list[float]]] = {v: [[] for _ in range(world_size)] for v in variants}
    ranks: list[dict[str, dict[str, Any]]] = []
    for _ in range(repeats):
        ranks = launch(timing_rank, world_size, *args, timeout=timeout)
        for rank, result in enumerate(ranks):
            for v in variants:
                timed[v][rank] += result[v]["times"]
    return {v: median_step_s(timed[v]) for v in variants}, ranks


def fmt_ms(seconds: float) -> str:
    """Seconds as milliseconds with three significant digits (whole milliseconds from
    a second up: ``1,080 ms``, where ``.3g`` would write ``1.08e+03 ms``)."""
    ms = seconds * 1e3
    return f"{ms:,.0f} ms" if ms >= 1000 else f"{ms:.3g} ms"


def fmt_bytes(n: float) -> str:
    """Bytes in MiB (or KiB when small), with the exact count for small values."""
    if n >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.1f} KiB"


def ratio(value: float, baseline: float) -> str:
    """``value / baseline`` as ``0.97x``; ``-`` when there is no baseline."""
    if baseline == 0:
        return "-"
    return f"{value / baseline:.2f}x"


@dataclass
class Table:
    """A titled table of strings, printed with aligned columns and notes below."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        """Append a row; cells are turned into strings."""
        if len(cells) != len(self.columns):
            raise ValueError(f"row has {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([str(c) for c in cells])

    def render(self) -> str:
        """The table as text: title, header, rule, rows (first column left-aligned)."""
        widths = [
            max(len(c), *(len(r[i]) for r in self.rows)) if self.rows else len(c)
            for i, c in enumerate(self.columns)
        ]

        def line(cells: Sequence[str]) -> str:
            first = cells[0].ljust(widths[0])
            rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
            return "  ".join([first, *rest]).rstrip()

        out = [self.title, line(self.columns), "  ".join("-" * w for w in widths)]
        out += [line(r) for r in self.rows]
        out += [f"  {n}" for n in self.notes]
        return "\n".join(out)
