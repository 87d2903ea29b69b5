"""Checkpoints of an fsdp model: ours (ckpt) vs torch's FSDP1 state dicts + DCP.

A GPT of >= 100 MB (fp32) under FULL_SHARD with each Block its own unit, on two ranks
(gloo, CPU). Rows:

* save sharded: ``ckpt.save({"model": model}, path)`` (SHARDED state dict, DCP write,
  fsync, CRC-32 manifest, atomic rename) vs torch's
  ``dcp.save({"model": get_model_state_dict(model)}, ...)`` on torch's FSDP1 (its
  sharded state dict; fsync too, no manifest or rename);
* load sharded: ``ckpt.load`` (verify the manifest, check keys and shapes, DCP read,
  load) vs ``get_model_state_dict`` + ``dcp.load`` + ``set_model_state_dict``;
* full rank0_only: ``model.state_dict()`` under FULL_STATE_DICT with
  ``FullStateDictConfig(rank0_only=True)`` on both, what a consolidated
  ``torch.save`` on rank 0 needs. Without ``offload_to_cpu``: on a CPU model torch's
  FSDP1 with it runs one all-gather more on rank 1 than on rank 0 and hangs (and on
  CPU the offload copies nothing anyway).

Times of save/load: one pair of rank processes holds both models and runs every variant
in turns (:func:`~benchmarks.common.time_round_robin`); each save goes to a fresh
directory. torch's FSDP1 fails on a second FULL rank0_only + offload_to_cpu state dict
of a CPU model in one process (its unsharded views lose their storage), so the
full rank0_only row is timed once per fresh pair of processes, alternating sides.
Memory: each variant alone in a fresh pair of processes; "peak extra" is the peak
resident set during the operation above the resident set before it (the peak is reset
first through ``/proc/self/clear_refs``), the largest among the ranks.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (
    Options,
    Table,
    fmt_bytes,
    fmt_ms,
    launch,
    median_step_s,
    peak_rss_bytes,
    ratio,
    time_round_robin,
)

DESCRIPTION = "fsdp checkpoints: ckpt vs torch FSDP1 state dicts + DCP (GPT >= 100 MB, 2 ranks)"

WORLD_SIZE = 2
MODEL = {"vocab": 8192, "d_model": 512, "n_layers": 8, "n_heads": 8, "seq_len": 64}
QUICK_MODEL = {"vocab": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}

OPERATIONS = ("save sharded", "load sharded", "full rank0_only")
TIMED_TOGETHER = OPERATIONS[:2]
SIDES = ("ours", "torch")


class _Bench:
    """Both models on this rank and one callable per (side, operation)."""

    def __init__(self, model_kwargs: dict[str, int], root: Path, sides: tuple[str, ...]) -> None:
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

        from benchmarks.gpt import GPT, Block
        from fsdp import FullyShardedDataParallel
        from fsdp.wrap import ModuleWrapPolicy

        self.root = root
        self.models: dict[str, Any] = {}
        for side in sides:
            torch.manual_seed(0)
            net = GPT(**model_kwargs)
            if side == "ours":
                self.models[side] = FullyShardedDataParallel(
                    net, auto_wrap_policy=ModuleWrapPolicy({Block})
                )
            else:
                self.models[side] = TorchFSDP(
                    net, auto_wrap_policy=TorchPolicy({Block}), device_id=torch.device("cpu")
                )
        self.param_bytes = sum(
            p.numel() * p.element_size() for p in GPT(**model_kwargs).parameters()
        )
        self.counter = itertools.count()
        self.kept: Any = None

    def fixed(self, side: str) -> Path:
        return self.root / f"{side}-fixed"

    def save(self, side: str, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        import ckpt

        if side == "ours":
            ckpt.save({"model": self.models[side]}, path)
        else:
            dcp.save({"model": get_model_state_dict(self.models[side])}, checkpoint_id=str(path))

    def load(self, side: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            set_model_state_dict,
        )

        import ckpt

        model = self.models[side]
        if side == "ours":
            ckpt.load({"model": model}, self.fixed(side))
        else:
            state = {"model": get_model_state_dict(model)}
            dcp.load(state, checkpoint_id=str(self.fixed(side)))
            set_model_state_dict(model, state["model"])

    def full_rank0(self, side: str) -> int:
        import torch
        from torch.distributed.fsdp import FullStateDictConfig as TorchFullConfig
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp import StateDictType as TorchType

        import ckpt

        model = self.models[side]
        if side == "ours":
            config = ckpt.FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
            with ckpt.state_dict_type(model, ckpt.StateDictType.FULL_STATE_DICT, config):
                sd = model.state_dict()
        else:
            torch_config = TorchFullConfig(offload_to_cpu=False, rank0_only=True)
            with TorchFSDP.state_dict_type(model, TorchType.FULL_STATE_DICT, torch_config):
                sd = model.state_dict()
        total = sum(
            v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor)
        )
        self.kept = sd  # alive until the next call, as a caller saving it would hold it
        return total

    def step(self, side: str, operation: str) -> Callable[[], object]:
        if operation == "save sharded":
            return lambda: self.save(side, self.root / f"{side}-{next(self.counter)}")
        if operation == "load sharded":
            return lambda: self.load(side)
        return lambda: self.full_rank0(side)


def _shared_root() -> Path:
    """One temporary directory for both ranks (rank 0 creates it, then broadcasts)."""
    import torch.distributed as dist

    box = [tempfile.mkdtemp(prefix="bench-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return Path(box[0])


def _cleanup(root: Path) -> None:
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)


def _timing_rank(model: dict[str, int], warmup: int, iters: int) -> dict[str, Any]:
    root = _shared_root()
    try:
        bench = _Bench(model, root, SIDES)
        for side in SIDES:
            bench.save(side, bench.fixed(side))
        steps = {f"{side}|{op}": bench.step(side, op) for side in SIDES for op in TIMED_TOGETHER}
        times = time_round_robin(steps, warmup=warmup, iters=iters)
        return {"times": times, "param_bytes": bench.param_bytes}
    finally:
        _cleanup(root)


def _current_rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _memory_rank(side: str, operation: str, model: dict[str, int]) -> dict[str, Any]:
    import gc

    import torch.distributed as dist

    root = _shared_root()
    try:
        bench = _Bench(model, root, (side,))
        if operation == "load sharded":
            bench.save(side, bench.fixed(side))
        gc.collect()
        dist.barrier()
        reset = _reset_peak()
        before = _current_rss()
        start = time.perf_counter()
        bench.step(side, operation)()
        elapsed = time.perf_counter() - start
        extra = peak_rss_bytes() - before
        return {"extra": extra if reset else None, "peak": peak_rss_bytes(), "time": elapsed}
    finally:
        _cleanup(root)


def run(options: Options) -> list[Table]:
    """Time the variants together, measure each alone, tabulate ours against torch's."""
    model = QUICK_MODEL if options.quick else MODEL
    warmup, iters = (1, 2) if options.quick else (1, 5)
    names = [f"{side}|{op}" for side in SIDES for op in OPERATIONS]
    together = [f"{side}|{op}" for side in SIDES for op in TIMED_TOGETHER]
    timed: dict[str, list[list[float]]] = {n: [[] for _ in range(WORLD_SIZE)] for n in names}
    param_bytes = 0
    for _ in range(options.repeats):
        ranks = launch(_timing_rank, WORLD_SIZE, model, warmup, iters, timeout=3600)
        for rank, result in enumerate(ranks):
            param_bytes = result["param_bytes"]
            for n in together:
                timed[n][rank] += result["times"][n]
    memory = {
        n: launch(_memory_rank, WORLD_SIZE, *n.split("|"), model, timeout=1800) for n in names
    }
    alone = [n for n in names if n not in together]
    for n in alone:
        for rank, r in enumerate(memory[n]):
            timed[n][rank].append(r["time"])
    for i in range(1, iters):  # more fresh runs, alternating which side goes first
        for n in alone if i % 2 else alone[::-1]:
            for rank, r in enumerate(launch(_memory_rank, WORLD_SIZE, *n.split("|"), model)):
                timed[n][rank].append(r["time"])
    times = {n: median_step_s(timed[n]) for n in names}
    extra = {
        n: max((r["extra"] for r in memory[n] if r["extra"] is not None), default=0) for n in names
    }
    table = Table(
        f"Checkpointing GPT({', '.join(f'{k}={v}' for k, v in model.items())}) = "
        f"{fmt_bytes(param_bytes)} fp32 under FULL_SHARD (a unit per Block), {WORLD_SIZE} "
        f"ranks, gloo/CPU: median of {iters * options.repeats} runs",
        [
            "operation",
            "ours",
            "torch",
            "time vs torch",
            "ours peak extra",
            "torch peak extra",
            "memory vs torch",
        ],
    )
    for op in OPERATIONS:
        ours, theirs = f"ours|{op}", f"torch|{op}"
        table.add(
            op,
            fmt_ms(times[ours]),
            fmt_ms(times[theirs]),
            ratio(times[ours], times[theirs]),
            fmt_bytes(extra[ours]),
            fmt_bytes(extra[theirs]),
            ratio(extra[ours], extra[theirs]),
        )
    table.notes += [
        "peak extra: the largest rank's peak RSS during the operation above its RSS before",
        f"full rank0_only: {iters} fresh process pairs per side (see the module docstring)",
        "ours save includes CRC-32 hashing of every file and the atomic commit; ours load "
        "includes verifying them",
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
    ]
    return [table]
