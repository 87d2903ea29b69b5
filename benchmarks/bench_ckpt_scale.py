"""Checkpoint coordination as ranks and tensors grow: ckpt against DCP (issue 39).

A model of many small tensors, so that the files hold little and a save or a load is
nearly all coordination: ``L`` ``Linear(16, 16)`` layers (``2L`` tensors, the count in
the table), sharded in groups of 50 layers, with AdamW state after one step (each
parameter's two moments and its step: four state entries per tensor). Variants, each
in the same rank processes (gloo on the CPU), their operations in turns:

* ``ours``: our ``fully_shard`` + ``ckpt.save`` / ``ckpt.load`` (manifest, atomic
  commit, verified load; [Note: flat coordination] in ``ckpt/_format/chunk_table.py``);
* ``torch FSDP2``: torch's ``fully_shard`` + ``get_state_dict`` + ``dcp.save`` /
  ``dcp.load`` + ``set_state_dict``, as torch's docs write it;
* ``torch FSDP1``: torch's ``FullyShardedDataParallel`` (one unit per group) the same
  way.

Per variant and operation: the wall time (each operation as long as its slowest rank,
the median over rounds), the collective rounds it made (``benchmarks/collective_rounds``:
every ``torch.distributed`` primitive call, object collectives counted as the two or
three they are) and the bytes a rank put into them (the most of any rank; rank 0's
broadcasts count on rank 0), apart from the files. Operations: ``first save`` (the
first save of the model's structure in the process, after a save of another structure
so the process's own first-time costs are not in it: ours plans it), ``save`` (the
same structure again: ours reuses its plan), ``load``. The ratio columns are ours over
torch FSDP2 in the same run.

``--scale-ranks 2,4,8,16`` and ``--scale-tensors 100,1000,5000`` pick the grid (each
pair one launch; on a 2-core machine 16 ranks take long), ``--scale-rounds`` the timed
rounds; ``--scale-no-fsdp1`` leaves torch's FSDP1 out (the slowest to run).
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.bench_ckpt import _shared_root, torch_dcp_load
from benchmarks.common import Options, Table, fmt_bytes, fmt_ms, launch, median_step_s, ratio

DESCRIPTION = "checkpoint coordination at 2-16 ranks, 100-5,000 tensors: ckpt vs DCP"

RANKS = (2, 4, 8, 16)
TENSORS = (100, 1000, 5000)
ROUNDS = 3
QUICK = {"ranks": (2,), "tensors": (100,), "rounds": 1}
GROUP_LAYERS = 50  # layers per fully_shard group / FSDP1 unit
OURS = "ours"
FSDP2 = "torch FSDP2"
FSDP1 = "torch FSDP1"
OPS = ("first save", "save", "load")


def _build(variant: str, tensors: int) -> tuple[Any, Any]:
    """``tensors // 2`` layers under ``variant``, with AdamW after one step."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = [nn.Linear(16, 16) for _ in range(max(1, tensors // 2))]
    groups = [
        nn.Sequential(*layers[i : i + GROUP_LAYERS]) for i in range(0, len(layers), GROUP_LAYERS)
    ]
    model: nn.Module = nn.Sequential(*groups)
    if variant == FSDP1:
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

        cpu = torch.device("cpu")
        for i, group in enumerate(groups):
            model[i] = TorchFSDP(group, device_id=cpu)  # type: ignore[index]
        model = TorchFSDP(model, device_id=cpu)
    else:
        if variant == OURS:
            from fsdp import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        for group in groups:
            fully_shard(group)
        fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 16)).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


class _Variant:
    """One variant's model and its save and load."""

    def __init__(self, name: str, tensors: int) -> None:
        self.name = name
        self.model, self.optim = _build(name, tensors)
        self.last: Path | None = None

    def save(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        import ckpt

        if self.name == OURS:
            ckpt.save({"model": self.model, "optim": self.optim}, path)
        else:
            msd, osd = get_state_dict(self.model, self.optim)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
        self.last = path

    def warm_up(self, path: Path) -> None:
        """Save one tensor of another structure, so that what a process does once (its
        first collectives, imports) is not in the first save timed."""
        import torch
        import torch.distributed.checkpoint as dcp

        import ckpt

        state = {"warm-up": torch.zeros(4)}
        if self.name == OURS:
            ckpt.save(state, path)
        else:
            dcp.save(state, checkpoint_id=str(path))

    def load(self) -> None:
        import ckpt

        assert self.last is not None
        if self.name == OURS:
            ckpt.load({"model": self.model, "optim": self.optim}, self.last)
            return
        torch_dcp_load(self.model, self.optim, self.last)


def _measured(op: Callable[[], object]) -> tuple[float, int, int]:
    """Seconds, collective rounds and bytes sent of one operation on this rank."""
    import torch.distributed as dist

    from benchmarks.collective_rounds import counting

    # A full collection before each operation, as ``timeit`` keeps the collector out of
    # what it times: a process holding torch's modules pays 150 ms for a pass over its
    # oldest objects, and such a pass lands in whichever operation happens to cross the
    # collector's threshold, a 75 ms save of 1,000 tensors or DCP's 4 s one alike.
    gc.collect()
    dist.barrier()
    with counting() as rounds:
        start = time.perf_counter()
        op()
        seconds = time.perf_counter() - start
    return seconds, rounds.total, rounds.sent


def _scale_rank(tensors: int, rounds: int, variants: list[str]) -> dict[str, Any]:
    import torch.distributed as dist

    warnings.filterwarnings("ignore", module=r"torch\.distributed\.(fsdp|_state_dict_utils|_shard)")
    warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
    root = _shared_root()
    out: dict[str, Any] = {"times": {}, "rounds": {}, "sent": {}}
    try:
        built = [_Variant(name, tensors) for name in variants]
        for v in built:  # the process's first save (imports, first collectives) is not timed
            v.warm_up(root / f"warm-up-{v.name.replace(' ', '-')}")
        counter = 0

        def record(variant: str, op: str, measured: tuple[float, int, int]) -> None:
            key = f"{variant}|{op}"
            out["times"].setdefault(key, []).append(measured[0])
            out["rounds"][key] = measured[1]
            out["sent"][key] = max(out["sent"].get(key, 0), measured[2])

        for i in range(rounds + 1):
            order = built[i % len(built) :] + built[: i % len(built)]
            for v in order:
                counter += 1
                path = root / f"{v.name.replace(' ', '-')}-{counter}"
                saved = _measured(functools.partial(v.save, path))
                record(v.name, "first save" if i == 0 else "save", saved)
                if i > 0:
                    record(v.name, "load", _measured(v.load))
            dist.barrier()
            if dist.get_rank() == 0:  # keep each variant's last checkpoint only
                keep = {v.last for v in built}
                for p in root.iterdir():
                    if p not in keep:
                        shutil.rmtree(p, ignore_errors=True)
            dist.barrier()
        return out
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


def _csv(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers, comma-separated") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers")
    return values


def add_arguments(group: argparse._ArgumentGroup) -> list[argparse.Action]:
    """This benchmark's flags (named apart from other benchmarks', which share a parser)."""
    return [
        group.add_argument("--scale-ranks", type=_csv, help=f"rank counts (default {RANKS})"),
        group.add_argument("--scale-tensors", type=_csv, help=f"tensor counts (default {TENSORS})"),
        group.add_argument("--scale-rounds", type=int, help=f"timed rounds (default {ROUNDS})"),
        group.add_argument(
            "--scale-no-fsdp1", action="store_true", help="leave torch's FSDP1 + DCP out"
        ),
    ]


def run(options: Options) -> list[Table]:
    """Every (ranks, tensors) pair in one launch; one table of all."""
    flags = options.flags
    ranks = QUICK["ranks"] if options.quick else flags.get("scale_ranks", RANKS)
    tensors = QUICK["tensors"] if options.quick else flags.get("scale_tensors", TENSORS)
    rounds = QUICK["rounds"] if options.quick else flags.get("scale_rounds", ROUNDS)
    variants = [OURS, FSDP2] + ([] if flags.get("scale_no_fsdp1") else [FSDP1])
    load_before = os.getloadavg()[0]
    table = Table(
        "Save and load of a fully_shard model of small tensors with AdamW state, gloo on the "
        f"CPU: median of {rounds} rounds (first save: one), each operation as long as its "
        "slowest rank",
        ["ranks", "tensors", "operation", *[f"{v}" for v in variants], "ours / FSDP2",
         "rounds: ours", "rounds: FSDP2", "bytes/rank: ours", "bytes/rank: FSDP2"],
    )  # fmt: skip
    repeated = Table(
        "ours: a save of an unchanged structure against the first save of it",
        ["ranks", "tensors", "first save", "save again", "again / first"],
    )
    for world in ranks:
        for count in tensors:
            started = time.monotonic()
            results = launch(_scale_rank, world, count, rounds, variants, timeout=7200)
            took = time.monotonic() - started
            for op in OPS:
                medians = {}
                for v in variants:
                    key = f"{v}|{op}"
                    medians[v] = median_step_s([r["times"][key] for r in results])
                table.add(
                    world,
                    count,
                    op,
                    *[fmt_ms(medians[v]) for v in variants],
                    ratio(medians[OURS], medians[FSDP2]),
                    max(r["rounds"][f"{OURS}|{op}"] for r in results),
                    max(r["rounds"][f"{FSDP2}|{op}"] for r in results),
                    fmt_bytes(max(r["sent"][f"{OURS}|{op}"] for r in results)),
                    fmt_bytes(max(r["sent"][f"{FSDP2}|{op}"] for r in results)),
                )
                if op == "save":
                    first = median_step_s([r["times"][f"{OURS}|first save"] for r in results])
                    repeated.add(world, count, fmt_ms(first), fmt_ms(medians[OURS]),
                                 ratio(medians[OURS], first))  # fmt: skip
            point = "; ".join(" ".join(row[2:]) for row in table.rows[-len(OPS) :])
            print(f"  ({world} ranks, {count} tensors, {took:.0f} s: {point})", flush=True)
    ours_first = [r for r in table.rows if r[2] == "first save"]
    table.notes += [
        "rounds: torch.distributed primitive calls of one operation (the most of any rank); "
        "bytes/rank: what the rank that sent the most put into them (not the files)",
        "save: the same structure saved again (ours reuses the plan, the .metadata and the "
        "index of the first save); torch FSDP2 and FSDP1 plan every save",
        f"{len(ours_first)} grid points; load average {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after; OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}",
    ]
    return [table, repeated]
