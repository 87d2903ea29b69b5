"""What the run shows the user: bytes per rank, the progress bar and log lines, the
metrics file, the summary table and the plot.

Only rank 0 prints or writes files; the one collective here (``gather_memory``) is
called by every rank at the same steps.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import resource
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from torch import nn
from torch.distributed.tensor import DTensor

from .parallel import local_optimizer

# ---- bytes per rank ---------------------------------------------------------------


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storage behind ``tensors`` on this rank, each storage counted once.

    Counting storages rather than ``numel() * element_size()`` is what makes the number
    honest: DDP's gradients are views into its communication buckets, FSDP's parameters
    are shards of one flat buffer, and a DTensor's memory is its local shard."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        key = (str(local.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


@dataclass(frozen=True)
class MemoryBytes:
    """Bytes one rank holds for training state (its local tensors only)."""

    params: int
    grads: int
    optim: int

    @property
    def total(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optim


def param_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameters (under FSDP: its shards)."""
    return local_bytes(model.parameters())


def grad_bytes(model: nn.Module) -> int:
    """Bytes of this rank's gradients; measured after backward, before they are freed."""
    return local_bytes(p.grad for p in model.parameters() if p.grad is not None)


def optim_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's optimizer state (under ZeRO: its shard only)."""
    state = local_optimizer(optimizer).state
    return local_bytes(
        value for per_param in state.values() for value in per_param.values()
        if isinstance(value, torch.Tensor)
    )  # fmt: skip


def gather_memory(mine: MemoryBytes, device: torch.device) -> list[MemoryBytes]:
    """Every rank's MemoryBytes (collective: all ranks call it at the same step)."""
    local = torch.tensor([mine.params, mine.grads, mine.optim], dtype=torch.int64, device=device)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return [MemoryBytes(*(int(v) for v in part.tolist())) for part in parts]


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def memory_line(per_rank: Sequence[MemoryBytes]) -> str:
    """'params 1.2 MiB grads ... optim ...' for each rank (min..max beyond 4 ranks)."""

    def fmt(m: MemoryBytes) -> str:
        return (
            f"params {human_bytes(m.params)} grads {human_bytes(m.grads)} "
            f"optim {human_bytes(m.optim)}"
        )

    if len(per_rank) == 1:
        return f"1 rank: {fmt(per_rank[0])}"
    if len(set(per_rank)) == 1:
        return f"each of {len(per_rank)} ranks: {fmt(per_rank[0])}"
    if len(per_rank) <= 4:
        return " | ".join(f"rank{r}: {fmt(m)}" for r, m in enumerate(per_rank))
    low = min(per_rank, key=lambda m: m.total)
    high = max(per_rank, key=lambda m: m.total)
    return f"per rank min: {fmt(low)} | max: {fmt(high)}"


# ---- rank 0's console -------------------------------------------------------------


class Reporter:
    """Rank 0's view of the run; on the other ranks every method does nothing."""

    enabled: bool
    console: Console
    metrics_path: Path
    _progress: Progress | None
    _task: Any

    def __init__(self, enabled: bool, out_dir: Path, show_progress: bool) -> None:
        self.enabled = enabled
        self.console = Console(file=sys.stdout, highlight=False)
        self.metrics_path = out_dir / "metrics.jsonl"
        self._show_progress = show_progress and enabled and self.console.is_terminal
        self._progress = None
        self._task = None
        if enabled:
            out_dir.mkdir(parents=True, exist_ok=True)

    def print(self, message: str) -> None:
        """A line above the progress bar (rank 0 only)."""
        if self.enabled:
            self.console.print(message, markup=False, soft_wrap=True)

    @contextlib.contextmanager
    def progress(self, total: int, completed: int) -> Iterator[None]:
        """The progress bar for the duration of training (only on a terminal)."""
        if not self._show_progress:
            yield
            return
        columns = (
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=self.console, transient=False) as bar:
            self._progress = bar
            self._task = bar.add_task("train", total=total, completed=completed, status="")
            try:
                yield
            finally:
                self._progress = None

    def advance(self, record: dict[str, Any]) -> None:
        """Move the bar one step and show the latest loss."""
        if self._progress is not None:
            status = f"loss {record['loss']:.3f} {record['tokens_per_s'] / 1e3:.1f}k tok/s"
            self._progress.update(self._task, advance=1, status=status)

    def write_history(self, history: Sequence[dict[str, Any]]) -> None:
        """Start metrics.jsonl afresh with the history so far (a resumed run's file
        holds the whole curve, not only its own steps)."""
        if self.enabled:
            with self.metrics_path.open("w") as f:
                f.writelines(json.dumps(r) + "\n" for r in history)

    def append_metrics(self, record: dict[str, Any]) -> None:
        """One line of metrics.jsonl per step (floats round-trip exactly)."""
        if self.enabled:
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")


# ---- the end of the run -----------------------------------------------------------


def summary_table(rows: Sequence[tuple[str, str]], title: str) -> Table:
    """A two-column table of what the run did and what it cost."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in rows:
        table.add_row(key, value)
    return table


def plot_history(history: Sequence[dict[str, Any]], val_loss: float | None, path: Path) -> Path:
    """Loss and throughput over steps as a PNG; dashed lines mark resumes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    fig, (ax_loss, ax_tps) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_loss.plot(steps, [r["loss"] for r in history], lw=1, label="train loss")
    if val_loss is not None and steps:
        ax_loss.scatter([steps[-1]], [val_loss], color="C3", zorder=3, label="val loss")
    ax_loss.set_ylabel("loss (nats / byte)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_tps.plot(steps, [r["tokens_per_s"] for r in history], lw=1, color="C1")
    ax_tps.set_ylabel("tokens / s (all ranks)")
    ax_tps.set_xlabel("step")
    ax_tps.grid(alpha=0.3)
    for prev, cur in itertools.pairwise(history):
        if cur["session"] != prev["session"]:
            for ax in (ax_loss, ax_tps):
                ax.axvline(cur["step"] - 0.5, color="gray", ls="--", lw=0.8)
    fig.suptitle("tinygpt: training loss and throughput")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
