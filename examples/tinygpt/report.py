"""What the run shows the user: bytes per rank, the progress bar and log lines, the
files of the run folder, the summary table and the plot.

Only rank 0 prints or writes files; the one collective here (``gather_memory``) is
called by every rank at the same steps.

The run folder holds, besides checkpoints: ``config.toml`` (the resolved options),
``metrics.jsonl`` (one record per step: loss, lr, tokens/s, FLOP/s, and memory per
rank at log steps), ``val.jsonl`` (the validation loss of each invocation that
reached the end), ``samples.txt`` (the samples, under the step they were drawn at),
``summary.json`` (the summary table's figures) and ``train.png``; with TensorBoard
installed, ``tensorboard/`` too (``tensorboard --logdir runs``). Lines printed off a
terminal (a log file, a scheduler's output) start with the time.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
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
    """Bytes one rank holds for training state (its local tensors only), and what the
    process holds in all: device memory allocated on CUDA, resident memory on CPU."""

    params: int
    grads: int
    optim: int
    resident: int = 0

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
    local = torch.tensor(
        [mine.params, mine.grads, mine.optim, mine.resident], dtype=torch.int64, device=device
    )
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return [MemoryBytes(*(int(v) for v in part.tolist())) for part in parts]


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_bytes(device: torch.device) -> int:
    """What this rank holds now: CUDA memory allocated on a GPU, else the process's
    resident set (``/proc/self/statm``; the peak where that file does not exist)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        pages = int(open("/proc/self/statm").read().split()[1])  # noqa: SIM115
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()
    return pages * os.sysconf("SC_PAGE_SIZE")


def resident_kind(device: torch.device) -> str:
    """How ``resident_bytes`` is labelled: ``cuda`` or ``rss``."""
    return "cuda" if device.type == "cuda" else "rss"


def flops_per_token(num_params: int, n_layer: int, d_model: int, seq_len: int) -> int:
    """Training FLOPs per token: 6N for the matrix products forward and backward, plus
    12·L·d·T for attention (the estimate of Kaplan et al. and PaLM's appendix)."""
    return 6 * num_params + 12 * n_layer * d_model * seq_len


def human_flops(n: float) -> str:
    """2.5e9 -> '2.50 GFLOP/s'."""
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP/s"


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def memory_line(per_rank: Sequence[MemoryBytes], kind: str = "rss") -> str:
    """'params 1.2 MiB grads ... optim ... rss ...' for each rank (min..max beyond 4
    ranks); ``kind`` labels the resident figure (``resident_kind``)."""

    def fmt(m: MemoryBytes) -> str:
        return (
            f"params {human_bytes(m.params)} grads {human_bytes(m.grads)} "
            f"optim {human_bytes(m.optim)} {kind} {human_bytes(m.resident)}"
        )

    if len(per_rank) == 1:
        return f"1 rank: {fmt(per_rank[0])}"
    if len(per_rank) <= 4:
        return " | ".join(f"rank{r}: {fmt(m)}" for r, m in enumerate(per_rank))
    low = min(per_rank, key=lambda m: m.resident)
    high = max(per_rank, key=lambda m: m.resident)
    return f"per rank min: {fmt(low)} | max: {fmt(high)}"


def timestamped(text: str, terminal: bool) -> str:
    """``text`` with the local time in front, unless it goes to a terminal (where the
    user watches it happen); a multi-line message is one entry, stamped once."""
    if terminal:
        return text
    return f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}"


WriterFactory = Callable[[Path], Any]  # log dir -> a SummaryWriter-like object


def tensorboard_writer(log_dir: Path) -> Any:
    """torch's SummaryWriter when TensorBoard is installed, else None (it is optional)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch.utils.tensorboard needs the tensorboard package
        return None
    return SummaryWriter(log_dir=str(log_dir))


# ---- rank 0's console -------------------------------------------------------------


class Reporter:
    """Rank 0's view of the run; on the other ranks every method does nothing.

    Nothing is written before ``open()``, which the trainer calls once it knows the
    run goes ahead (a resume that fails leaves no folder behind)."""

    enabled: bool
    console: Console
    out_dir: Path
    metrics_path: Path
    _progress: Progress | None
    _task: Any
    _writer: Any  # TensorBoard's SummaryWriter, or None
    _writer_factory: WriterFactory

    def __init__(
        self,
        enabled: bool,
        out_dir: Path,
        show_progress: bool,
        writer_factory: WriterFactory = tensorboard_writer,
    ) -> None:
        self.enabled = enabled
        self.console = Console(file=sys.stdout, highlight=False)
        self.out_dir = out_dir
        self.metrics_path = out_dir / "metrics.jsonl"
        self._show_progress = show_progress and enabled and self.console.is_terminal
        self._progress = None
        self._task = None
        self._writer = None
        self._writer_factory = writer_factory

    def open(self) -> None:
        """Create the run folder and, when TensorBoard is installed, its event files."""
        if self.enabled:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._writer = self._writer_factory(self.out_dir / "tensorboard")

    def close(self) -> None:
        """Flush and close the TensorBoard writer."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def print(self, message: str) -> None:
        """A line above the progress bar (rank 0 only), timestamped off a terminal."""
        if self.enabled:
            text = timestamped(message, self.console.is_terminal)
            self.console.print(text, markup=False, soft_wrap=True)

    @contextlib.contextmanager
    def progress(self, total: int, completed: int, what: str = "train") -> Iterator[None]:
        """A progress bar for the duration of the block (only on a terminal)."""
        if not self._show_progress:
            yield
            return
        columns = (
            TextColumn(f"[bold]{what}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=self.console, transient=what != "train") as bar:
            self._progress = bar
            self._task = bar.add_task(what, total=total, completed=completed, status="")
            try:
                yield
            finally:
                self._progress = None

    def advance(self, record: dict[str, Any] | None = None, status: str = "") -> None:
        """Move the bar one unit and show the latest loss (or ``status``)."""
        if self._progress is not None:
            if record is not None:
                status = f"loss {record['loss']:.3f} {record['tokens_per_s'] / 1e3:.1f}k tok/s"
            self._progress.update(self._task, advance=1, status=status)

    def write_history(self, history: Sequence[dict[str, Any]]) -> None:
        """Start metrics.jsonl afresh with the history so far (a resumed run's file
        holds the whole curve, not only its own steps)."""
        if self.enabled:
            with self.metrics_path.open("w") as f:
                f.writelines(json.dumps(r) + "\n" for r in history)

    def append_metrics(self, record: dict[str, Any]) -> None:
        """One line of metrics.jsonl per step (floats round-trip exactly), and the
        step's scalars in TensorBoard."""
        if not self.enabled:
            return
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "flop_per_s"):
                if key in record:
                    self._writer.add_scalar(f"train/{key}", record[key], record["step"])

    def write_eval(self, step: int, val_loss: float, session: int) -> None:
        """val.jsonl gets one line per evaluation (and TensorBoard the scalar)."""
        if not self.enabled:
            return
        entry = {"step": step, "val_loss": val_loss, "session": session, "time": time.time()}
        with (self.out_dir / "val.jsonl").open("a") as f:
            f.write(json.dumps(entry) + "\n")
        if self._writer is not None:
            self._writer.add_scalar("val/loss", val_loss, step)

    def write_samples(self, step: int, prompt: str, texts: Sequence[str]) -> None:
        """samples.txt gets this invocation's samples under a header naming the step."""
        if not self.enabled or not texts:
            return
        header = f"=== step {step}, prompt {prompt!r}, {time.strftime('%Y-%m-%d %H:%M:%S')} ==="
        body = "".join(f"--- sample {i + 1} ---\n{text}\n" for i, text in enumerate(texts))
        with (self.out_dir / "samples.txt").open("a", encoding="utf-8") as f:
            f.write(f"{header}\n{body}\n")
        if self._writer is not None:
            for i, text in enumerate(texts):
                self._writer.add_text(f"samples/{i + 1}", text, step)

    def write_summary(self, summary: dict[str, Any]) -> Path | None:
        """summary.json: the summary table's figures, as numbers."""
        if not self.enabled:
            return None
        path = self.out_dir / "summary.json"
        path.write_text(json.dumps(summary, indent=1) + "\n")
        return path


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
