"""Checkpoints of a sharded model and its AdamW state: ours against torch's, and the disk.

The issue-28 setup: 2 gloo ranks on the CPU, a 25M-parameter model (12 blocks of two
1024x1024 linears, one FSDP unit or ``fully_shard`` group per block) with AdamW after
one step (about 300 MB of state). Variants:

* ``ours FSDP1``: our ``FullyShardedDataParallel`` + ``ckpt.save`` / ``ckpt.async_save``
  / ``ckpt.load`` (manifest of CRC-32 digests, atomic commit, verified load);
* ``ours fully_shard``: our ``fully_shard`` + the same ``ckpt`` calls;
* ``torch FSDP2``: torch's ``fully_shard`` + ``get_state_dict`` + ``dcp.save`` /
  ``dcp.async_save`` / ``dcp.load`` + ``set_state_dict``, as a new user writes it;
* ``torch FSDP1``: torch's ``FullyShardedDataParallel`` the same way, where it runs on
  the CPU (its ``dcp.async_save`` fails there: the staging copy cannot read its
  ``ShardedTensor``s; the row says so).

Rows: ``sync save`` (returns when committed), ``async: training blocked`` (until
``async_save`` returns), ``async: until committed`` (until its handle/future is done),
``load`` (into the same model, from a checkpoint it saved). Every save writes a new
directory (removed after the round). One pair of rank processes holds every variant and
takes one of each operation per variant per round, the variants' order rotating each
round; each timed operation starts once the page cache holds nothing dirty (``sync``)
and after a barrier, and lasts as long as its slowest rank
(:func:`~benchmarks.common.median_step_s`).

The disk, measured in the same rounds: each rank writes as many bytes as it holds of
the state, in one ``write`` of a buffer and an ``fsync``, both ranks at once; the
``disk`` column is that time, and the note gives the rate. Nothing can save the state
faster than the disk takes its bytes. ``BENCH_CKPT_DIR`` picks the folder (default:
the temporary folder's disk).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import Options, Table, fmt_bytes, fmt_ms, launch, median_step_s, ratio

DESCRIPTION = "checkpoints: ckpt on our FSDP1/fully_shard vs torch FSDP2/FSDP1 + DCP, and the disk"

WORLD_SIZE = 2
MODEL = {"blocks": 12, "width": 1024}
QUICK_MODEL = {"blocks": 2, "width": 64}
VARIANTS = ("ours FSDP1", "ours fully_shard", "torch FSDP2", "torch FSDP1")
BASELINE = "torch FSDP2"
ROWS = ("sync save", "async: training blocked", "async: until committed", "load")
DISK = "disk"


def _build(variant: str, model: dict[str, int]) -> tuple[Any, Any]:
    """The model under ``variant`` and its AdamW optimizer, after one step."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    width = model["width"]
    net = nn.Sequential(
        *[
            nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))
            for _ in range(model["blocks"])
        ]
    )
    wrapped: nn.Module
    if variant == "ours FSDP1":
        from fsdp import FullyShardedDataParallel

        for i, block in enumerate(net):
            net[i] = FullyShardedDataParallel(block)
        wrapped = FullyShardedDataParallel(net)
    elif variant == "torch FSDP1":
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

        cpu = torch.device("cpu")
        for i, block in enumerate(net):
            net[i] = TorchFSDP(block, device_id=cpu)
        wrapped = TorchFSDP(net, device_id=cpu)
    else:
        if variant == "ours fully_shard":
            from fsdp import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        for block in net:
            fully_shard(block)
        fully_shard(net)
        wrapped = net
    optim = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    wrapped(torch.randn(4, width)).sum().backward()
    optim.step()
    optim.zero_grad()
    return wrapped, optim


class _Variant:
    """One variant's model and the three timed operations on it."""

    def __init__(self, name: str, model: dict[str, int], root: Path) -> None:
        self.name = name
        self.ours = name.startswith("ours")
        self.model, self.optim = _build(name, model)
        self.root = root
        self.fixed = root / f"{name.replace(' ', '-')}-fixed"
        self.async_error: str | None = None

    def save(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        import ckpt

        if self.ours:
            ckpt.save({"model": self.model, "optim": self.optim}, path)
        else:
            msd, osd = get_state_dict(self.model, self.optim)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))

    def async_save(self, path: Path) -> tuple[float, float]:
        """Seconds until the call returned, and until the save was committed."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        import ckpt

        start = time.perf_counter()
        if self.ours:
            handle = ckpt.async_save({"model": self.model, "optim": self.optim}, path)
            returned = time.perf_counter()
            handle.wait()
        else:
            msd, osd = get_state_dict(self.model, self.optim)
            future = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(path))
            returned = time.perf_counter()
            future.result()
        return returned - start, time.perf_counter() - start

    def load(self) -> None:
        import ckpt

        if self.ours:
            ckpt.load({"model": self.model, "optim": self.optim}, self.fixed)
            return
        torch_dcp_load(self.model, self.optim, self.fixed)


def torch_dcp_load(model: Any, optim: Any, path: Path) -> None:
    """torch's load of a model and its optimizer, as a new user writes it:
    ``get_state_dict``, ``dcp.load``, ``set_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _state_bytes(variant: _Variant) -> int:
    """Bytes of this rank's shards of the parameters and the optimizer state."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    total = sum(local(p).numel() * p.element_size() for p in variant.model.parameters())
    for state in variant.optim.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                total += local(v).numel() * v.element_size()
    return total


def _disk_write(folder: Path, data: bytes) -> None:
    """Write ``data`` to a new file in one call and fsync it (what the disk takes). The
    bytes are made before (random, so nothing on the way can skip zeros): allocating and
    filling them took 0.1 s of the 0.2 s a write of the issue's state took alone."""
    path = folder / f"disk-{os.getpid()}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
        path.unlink()


def _shared_root() -> Path:
    """One temporary directory for both ranks (rank 0 creates it, then broadcasts)."""
    import torch.distributed as dist

    where = os.environ.get("BENCH_CKPT_DIR")  # another disk than the temporary folder's
    box = [tempfile.mkdtemp(prefix="bench-ckpt-", dir=where) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return Path(box[0])


def _quiet_disk() -> None:
    """Flush every dirty page (``sync``), then wait for the other rank: on ext4 an
    ``fsync`` also waits for other files' data written before it, so without this an
    operation pays for whatever the one before it left in the page cache (seen: the disk
    write measured at 0.87 s after a round, 0.3 s alone)."""
    import torch.distributed as dist

    os.sync()
    dist.barrier()


def _timed(fn: Callable[[], object]) -> float:
    _quiet_disk()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _timing_rank(model: dict[str, int], warmup: int, rounds: int) -> dict[str, Any]:
    import torch.distributed as dist

    # torch's FSDP1 warns on every state dict (ShardedTensor and an object-collective
    # helper are deprecated): pages of the same lines around the table.
    warnings.filterwarnings("ignore", module=r"torch\.distributed\.(fsdp|_state_dict_utils|_shard)")
    warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)

    root = _shared_root()
    try:
        variants = [_Variant(name, model, root) for name in VARIANTS]
        state_bytes = _state_bytes(variants[0])
        disk_data = os.urandom(state_bytes)
        for v in variants:
            v.save(v.fixed)
        times: dict[str, list[float]] = {}
        counter = 0

        def record(key: str, seconds: float) -> None:
            times.setdefault(key, []).append(seconds)

        for i in range(warmup + rounds):
            keep = i >= warmup
            order = variants[i % len(variants) :] + variants[: i % len(variants)]
            for v in order:
                counter += 1
                path = root / f"save-{counter}"
                seconds = _timed(lambda v=v, path=path: v.save(path))
                if keep:
                    record(f"{v.name}|sync save", seconds)
                if v.async_error is None:
                    _quiet_disk()
                    try:
                        blocked, total = v.async_save(root / f"async-{counter}")
                    except Exception as e:  # torch's FSDP1 on the CPU
                        v.async_error = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    else:
                        if keep:
                            record(f"{v.name}|async: training blocked", blocked)
                            record(f"{v.name}|async: until committed", total)
                seconds = _timed(v.load)
                if keep:
                    record(f"{v.name}|load", seconds)
            seconds = _timed(lambda: _disk_write(root, disk_data))
            if keep:
                record(f"{DISK}|write", seconds)
            dist.barrier()
            if dist.get_rank() == 0:  # the round's checkpoints, not the fixed ones
                for p in root.iterdir():
                    if p.name.startswith(("save-", "async-", ".save-", ".async-")):
                        shutil.rmtree(p, ignore_errors=True)
            dist.barrier()
        errors = {v.name: v.async_error for v in variants if v.async_error is not None}
        return {"times": times, "state_bytes": state_bytes, "async_errors": errors}
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


def run(options: Options) -> list[Table]:
    """Time every variant's save, async save and load in rotating rounds, and the disk."""
    model = QUICK_MODEL if options.quick else MODEL
    warmup, rounds = (1, 2) if options.quick else (1, 19)
    pooled: dict[str, list[list[float]]] = {}
    state_bytes: list[int] = []
    errors: dict[str, str] = {}
    load_before = os.getloadavg()[0]
    for _ in range(options.repeats):
        ranks = launch(_timing_rank, WORLD_SIZE, model, warmup, rounds, timeout=3600)
        state_bytes = [r["state_bytes"] for r in ranks]
        errors.update(ranks[0]["async_errors"])
        for rank, result in enumerate(ranks):
            for key, values in result["times"].items():
                pooled.setdefault(key, [[] for _ in range(WORLD_SIZE)])[rank] += values
    load_after = os.getloadavg()[0]
    median = {key: median_step_s(per_rank) for key, per_rank in pooled.items()}
    disk_s = median[f"{DISK}|write"]
    total_bytes = sum(state_bytes)
    params = model["blocks"] * 2 * (model["width"] ** 2 + model["width"])
    table = Table(
        f"Checkpoints of {params / 1e6:.1f}M parameters + AdamW ({fmt_bytes(total_bytes)} of "
        f"state, {fmt_bytes(max(state_bytes))} per rank), {WORLD_SIZE} gloo ranks on the "
        f"CPU: median of {rounds * options.repeats} rounds, variants in rotating order",
        ["operation", *VARIANTS, "ours FSDP1 / FSDP2", "ours fully_shard / FSDP2", DISK],
    )
    for row in ROWS:
        cells = []
        for v in VARIANTS:
            key = f"{v}|{row}"
            cells.append(fmt_ms(median[key]) if key in median else "fails")
        ours = [
            ratio(median[f"{v}|{row}"], median[f"{BASELINE}|{row}"])
            if f"{v}|{row}" in median and f"{BASELINE}|{row}" in median
            else "-"
            for v in ("ours FSDP1", "ours fully_shard")
        ]
        disk = fmt_ms(disk_s) if row in ("sync save", "async: until committed") else ""
        table.add(row, *cells, *ours, disk)
    rate = max(state_bytes) / disk_s / 2**20 if disk_s else 0.0
    table.notes += [
        f"disk: each rank writes its {fmt_bytes(max(state_bytes))} in one write + fsync, both "
        f"at once: {fmt_ms(disk_s)} ({rate:.0f} MiB/s per rank, "
        f"{total_bytes / disk_s / 2**20 if disk_s else 0:.0f} MiB/s together)",
        "ours: ckpt (CRC-32 manifest written while saving, atomic rename; load verifies every "
        "file first); torch: get_state_dict + DCP (no manifest, no rename)",
        *(f"{name} async_save: {error}" for name, error in errors.items()),
        f"load average {load_before:.2f} before, {load_after:.2f} after; "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
    ]
    spread = Table(
        "The same rounds: each timed operation's fastest and slowest round (max over ranks)",
        ["operation", *VARIANTS],
    )
    for row in ROWS:
        cells = []
        for v in VARIANTS:
            per_rank = pooled.get(f"{v}|{row}")
            if per_rank is None:
                cells.append("fails")
                continue
            steps = [max(ts) for ts in zip(*per_rank, strict=True)]
            cells.append(f"{min(steps) * 1e3:.0f}-{max(steps) * 1e3:.0f} ms")
        spread.add(row, *cells)
    disk_steps = [max(ts) for ts in zip(*pooled[f"{DISK}|write"], strict=True)]
    spread.notes.append(f"disk: {min(disk_steps) * 1e3:.0f}-{max(disk_steps) * 1e3:.0f} ms")
    return [table, spread]
