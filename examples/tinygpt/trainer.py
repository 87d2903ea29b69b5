"""The training loop: build, resume, step, checkpoint, evaluate, report, sample."""

from __future__ import annotations

import functools
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ckpt

from .checkpoint import (
    CheckpointError,
    checkpoint_state,
    load_checkpoint,
    load_snapshot,
    move_aside,
    remove_checkpoints,
    save_checkpoint,
    scan_checkpoints,
)
from .config import NEWEST, VOCAB_SIZE, TrainConfig
from .config_file import config_record, write_config_file
from .data import BatchSampler, Corpus, load_corpus, rank_slice, windows
from .distributed import DistEnv
from .model import GPT
from .parallel import (
    accumulating,
    autocast,
    build_optimizer,
    build_parallel,
    clip_grad_norm,
    set_lr,
)
from .report import (
    MemoryBytes,
    Reporter,
    flops_per_token,
    gather_memory,
    grad_bytes,
    human_bytes,
    human_flops,
    memory_line,
    optim_bytes,
    param_bytes,
    peak_rss_bytes,
    plot_history,
    resident_bytes,
    resident_kind,
    summary_table,
    timestamped,
)
from .resume import ResumePlan, choose_checkpoint
from .run_folder import CONFIG_NAME, Settled, settle_run
from .sample import generate
from .stopping import StopRequest


@dataclass(kw_only=True, slots=True)
class RunResult:
    """How one invocation of the program ended."""

    first_step: int  # the step this invocation started after (0: a fresh run)
    last_step: int  # the last step completed
    interrupted: bool  # stopped by a signal before reaching --steps
    stop_signal: int | None  # the signal that stopped it (SIGINT, SIGTERM); None: another rank's
    train_s: float  # wall time of the training loop, checkpoints included
    val_loss: float | None
    checkpoint: Path | None  # the newest checkpoint written


def _broadcast(value: Any) -> Any:
    """Rank 0's answer for everyone, so all ranks act on the same checkpoint."""
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def settle(cfg: TrainConfig, explicit: Set[str], env: DistEnv) -> TrainConfig:
    """This invocation's final configuration, the same on every rank: rank 0 finds the
    run folder (a resume with changed options continues the run they change, keeping
    its config.toml for everything else) and says what the resume changes; see
    [Note: resuming with changed options] in run_folder.py. Collective."""
    settled: Settled = _broadcast(settle_run(cfg, explicit) if env.is_main else None)
    if settled.error is not None:
        raise CheckpointError(settled.error)
    if env.is_main:
        for note in settled.notes:
            print(timestamped(note, sys.stdout.isatty()), flush=True)
    assert settled.values is not None
    return TrainConfig(**settled.values)


def plural(count: int, noun: str) -> str:
    """'1 rank', '2 ranks'."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


class Trainer:
    """Owns the wrapped model, the optimizer, the data position and the history."""

    cfg: TrainConfig
    env: DistEnv
    model: nn.Module  # wrapped: FSDP or DDP
    optimizer: torch.optim.Optimizer
    corpus: Corpus
    sampler: BatchSampler
    reporter: Reporter
    num_params: int  # of the unwrapped model
    flops_per_token: int  # training FLOPs per token (report.flops_per_token)
    step: int  # optimizer steps completed, over all sessions
    session: int  # 0 for a fresh run, +1 per resume
    history: list[dict[str, Any]]  # one record per step, over all sessions
    memory: list[MemoryBytes]  # per rank, at the latest log step
    _memory: MemoryBytes  # this rank's, measured inside the latest log step
    last_checkpoint: Path | None
    snapshots: ckpt.MemorySnapshots | None  # --snapshot-every: the host-memory tier
    schedule_steps: int  # the --steps the run started with: [Note: the schedule of a resumed run]

    def __init__(self, cfg: TrainConfig, env: DistEnv) -> None:
        self.cfg, self.env = cfg, env
        self.reporter = Reporter(env.is_main, cfg.run_dir, cfg.progress)
        # Same seed on every rank: identical replicas before wrapping.
        torch.manual_seed(cfg.seed)
        model = GPT(
            vocab_size=VOCAB_SIZE,
            seq_len=cfg.seq_len,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            d_model=cfg.d_model,
            dropout=cfg.dropout,
        )
        self.num_params = sum(p.numel() for p in model.parameters())
        self.flops_per_token = flops_per_token(
            self.num_params, cfg.n_layer, cfg.d_model, cfg.seq_len
        )
        self.model = build_parallel(model, cfg, env)
        self.optimizer = build_optimizer(self.model, cfg)
        torch.manual_seed(self._rank_seed(0))  # each rank its own stream (dropout)
        self.corpus = load_corpus(cfg.data, cfg.val_fraction, cfg.seq_len)
        self.sampler = BatchSampler(len(self.corpus.train), cfg.seq_len, cfg.seed)
        self.step, self.session, self.history = 0, 0, []
        self.memory, self.last_checkpoint = [], None
        self.schedule_steps = cfg.steps
        self.snapshots = None
        if cfg.snapshot_every:
            disk = ckpt.CheckpointManager(cfg.checkpoints)
            self.snapshots = ckpt.MemorySnapshots(disk, root=cfg.snapshot_dir)

    def _rank_seed(self, step: int) -> int:
        return (self.cfg.seed * 1_000_003 + step) * 1_009 + self.env.rank + 1

    # ---- start or resume ------------------------------------------------------------

    def start(self) -> bool:
        """Resume (--resume, or by itself when torchrun restarted the job), or refuse to
        mix a fresh run into a folder of old checkpoints unless --overwrite says to clear
        it. Returns False when the resumed run has nothing left to do."""
        cfg, root = self.cfg, self.cfg.checkpoints
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        resume = cfg.resume if cfg.resume is not None or restart == 0 else NEWEST
        if resume is not None:
            if restart and cfg.resume is None:
                self.reporter.print(
                    f"restarted by the launcher (restart {restart}): resuming from the newest "
                    "checkpoint"
                )
            if not self._resume_chosen(resume, restarted=restart > 0):
                return False
        else:
            found = _broadcast(scan_checkpoints(root) if self.env.is_main else None)
            if found and cfg.checkpoint_every:
                if not cfg.overwrite:
                    raise CheckpointError(
                        f"{root} already holds checkpoints (newest: {found[0].path.name}): "
                        "pass --resume to continue that run, or --overwrite to delete them "
                        "and start again (or choose another --out-dir)"
                    )
                if self.env.is_main:
                    remove_checkpoints(root)
                dist.barrier()
        self._open_run_folder()
        return True

    def _open_run_folder(self) -> None:
        """The run goes ahead: create its folder, write the resolved options to
        config.toml, and start metrics.jsonl from the history so far (rank 0)."""
        self.reporter.open()
        if self.env.is_main:
            write_config_file(
                self.cfg,
                self.cfg.run_dir / CONFIG_NAME,
                f"The options of this run as train.py resolved them "
                f"({time.strftime('%Y-%m-%d %H:%M:%S')}, {plural(self.env.world_size, 'rank')}"
                f", session {self.session}).",
            )
        self.reporter.write_history(self.history)

    def _resume_chosen(self, resume: str, *, restarted: bool) -> bool:
        """Load the checkpoint rank 0 chooses (choose_checkpoint); a damaged one found
        while loading is moved aside (--move-aside-damaged) and the next tried. With
        --snapshot-every, the newest step comes from memory when memory holds it."""
        cfg = self.cfg
        if self.snapshots is not None and resume == NEWEST:
            found = self.snapshots.find_latest()
            if found.source == "memory":
                state = load_snapshot(
                    self.snapshots, found, self.model, self.optimizer, cfg.model_shape()
                )
                self.reporter.print(found.line)
                self._resumed(state, None)  # found.line said where from
                return self._left_to_train(f"the snapshot of step {self.step}")
            self.reporter.print(found.line)
        while True:
            plan: ResumePlan = _broadcast(
                choose_checkpoint(
                    cfg.checkpoints, resume, move_damaged=cfg.move_aside_damaged,
                    restarted=restarted,
                ) if self.env.is_main else None
            )  # fmt: skip
            for note in plan.notes:
                self.reporter.print(note)
            if plan.error is not None:
                raise CheckpointError(plan.error)
            if plan.path is None:
                return True
            try:
                self._resume(plan.path)
            except ckpt.CorruptCheckpointError as exc:
                if resume != NEWEST:
                    raise CheckpointError(
                        f"{exc}\n--resume {resume}: choose another checkpoint (--resume STEP)"
                    ) from exc
                if not cfg.move_aside_damaged:
                    raise CheckpointError(
                        f"{exc}\n--resume: pass --move-aside-damaged to rename "
                        f"{plan.path.name} to {plan.path.name}.damaged and resume from the "
                        "newest good checkpoint before it, or --resume STEP to choose one"
                    ) from exc
                if self.env.is_main:
                    moved = move_aside(plan.path)
                    self.reporter.print(
                        f"moved {plan.path.name} aside to {moved.name}: it failed verification"
                    )
                dist.barrier()
                continue
            return self._left_to_train(str(plan.path))

    def _left_to_train(self, where: str) -> bool:
        """Whether the resumed run has steps left; says so when it has none."""
        cfg = self.cfg
        if self.step >= cfg.steps:
            self.reporter.print(
                f"{where} is the end of a finished run (step {self.step}, "
                f"--steps {cfg.steps}): nothing to train. Pass --steps N with N > "
                f"{self.step} to train on (the learning rate stays on the schedule of "
                f"--steps {self.schedule_steps}, see --help), or --overwrite to start "
                "again"
            )
            return False
        return True

    def _resume(self, path: Path) -> None:
        state = load_checkpoint(path, self.model, self.optimizer, self.cfg.model_shape())
        self.last_checkpoint = path
        self._resumed(state, str(path))

    def _resumed(self, state: dict[str, Any], where: str | None) -> None:
        """Take the trainer state a checkpoint or snapshot held; say where it came from
        (``where``: None when said already)."""
        self.step, self.history = state["step"], state["history"]
        self.session = state["session"] + 1
        self.schedule_steps = state.get("schedule_steps", self.cfg.steps)
        self.sampler.load_state_dict(state["sampler"])
        if not state["rng_restored"]:
            torch.manual_seed(self._rank_seed(self.step))
        note = ""
        if state["world_size"] != self.env.world_size:
            note = f" (saved by {plural(state['world_size'], 'rank')}, now {self.env.world_size})"
        if where is not None:
            self.reporter.print(f"resumed from {where} at step {self.step}{note}")
        if state["data_order"] != self.cfg.data_order():
            self.reporter.print(
                f"warning: data options changed since the checkpoint "
                f"({state['data_order']} -> {self.cfg.data_order()}): the continued loss "
                "curve will not match an uninterrupted run"
            )

    def trainer_state(self) -> dict[str, Any]:
        """What a checkpoint needs beyond model and optimizer (JSON-serializable)."""
        return {
            "step": self.step,
            "session": self.session,
            "sampler": self.sampler.state_dict(),
            "history": self.history,
            "world_size": self.env.world_size,
            "schedule_steps": self.schedule_steps,
            "model_shape": self.cfg.model_shape(),
            "data_order": self.cfg.data_order(),
            "config": config_record(self.cfg),  # what config.toml holds, at this step
        }

    def snapshot(self) -> None:
        """A snapshot of the current step into host memory (collective; training waits
        only for this rank's copy, the replica goes in the background)."""
        assert self.snapshots is not None
        state = checkpoint_state(self.model, self.optimizer, self.trainer_state())
        self.snapshots.save(self.step, state)

    def save(self) -> Path:
        """A checkpoint of the current step (collective)."""
        path = save_checkpoint(
            self.cfg.checkpoints,
            self.step,
            model=self.model,
            optimizer=self.optimizer,
            trainer_state=self.trainer_state(),
            keep=self.cfg.keep_checkpoints,
        )
        self.last_checkpoint = path
        return path

    # ---- the loop -------------------------------------------------------------------

    def fit(self) -> RunResult:
        """Train up to --steps, checkpointing every --checkpoint-every steps; on SIGINT
        or SIGTERM stop after the current step with a checkpoint (see [Note: stopping
        together] in stopping.py)."""
        cfg = self.cfg
        first_step = self.step
        interrupted = False
        stop_signal: int | None = None
        t0 = time.perf_counter()
        with (
            StopRequest(label=f"[rank {self.env.rank}] ") as stop,
            self.reporter.progress(cfg.steps, self.step),
        ):
            while self.step < cfg.steps:
                step = self.step + 1
                self._inject_faults(step)
                log_now = step % cfg.log_every == 0 or step == first_step + 1
                record, stop_now = self.train_step(step, stop.requested, measure=log_now)
                self.step = step
                if log_now:
                    self.memory = gather_memory(self._memory, self.env.device)
                    record[f"{resident_kind(self.env.device)}_bytes"] = [
                        m.resident for m in self.memory
                    ]
                self.history.append(record)
                if cfg.snapshot_every and step % cfg.snapshot_every == 0:
                    self.snapshot()  # with its record, before it is printed: a printed step is kept
                self.reporter.append_metrics(record)
                self.reporter.advance(record)
                if log_now:
                    self._log(record)
                if cfg.checkpoint_every and (
                    stop_now or step % cfg.checkpoint_every == 0 or step == cfg.steps
                ):
                    self.save()
                if stop_now:
                    # Every rank exits with the same status: the signal some rank got.
                    agreed = torch.tensor(stop.signum or 0, device=self.env.device)
                    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
                    stop_signal = int(agreed) or None
                if stop_now:
                    cause = (
                            f"{stop.signal_name} received" if stop.requested
                            else "another rank was asked to stop"
                        )  # fmt: skip
                    saved = (
                        f"checkpoint {self.last_checkpoint}; continue with --resume"
                        if cfg.checkpoint_every
                        else "no checkpoint (--checkpoint-every 0)"
                    )
                    self.reporter.print(f"stopped after step {step} ({cause}): {saved}")
                    interrupted = True
                    break
        if self.snapshots is not None:
            self.snapshots.close()  # the last replica is in before the run ends
        train_s = time.perf_counter() - t0
        val_loss = None if interrupted else self.evaluate()
        if val_loss is not None:
            self.reporter.write_eval(self.step, val_loss, self.session)
        return RunResult(
            first_step=first_step,
            last_step=self.step,
            interrupted=interrupted,
            stop_signal=stop_signal,
            train_s=train_s,
            val_loss=val_loss,
            checkpoint=self.last_checkpoint,
        )

    def train_step(
        self, step: int, stop_requested: bool, *, measure: bool
    ) -> tuple[dict[str, Any], bool]:
        """One optimizer step over the global batch; returns its metrics record and
        whether any rank asked to stop."""
        cfg, env = self.cfg, self.env
        t0 = time.perf_counter()
        lr = cfg.lr_at(step, self.schedule_steps)
        set_lr(self.optimizer, lr)
        mine = rank_slice(self.sampler.next_batch(cfg.batch_size), env.rank, env.world_size)
        loss_sum = torch.zeros((), device=env.device)
        self.model.train()
        # [Note: uneven shares] When world_size * grad_accum does not divide the batch,
        # ranks and micro-batches hold different numbers of sequences (never zero: the
        # config checks batch_size >= world_size * grad_accum). Weighting each
        # micro-batch's mean loss by its share of the global batch, times world_size
        # because DDP and FSDP average gradients over ranks, makes the gradient the
        # global batch's mean whatever the split.
        micro_batches = mine.tensor_split(cfg.grad_accum)
        for i, starts in enumerate(micro_batches):
            x, y = windows(self.corpus.train, starts, cfg.seq_len)
            x, y = x.to(env.device), y.to(env.device)
            weight = len(starts) * env.world_size / cfg.batch_size
            with accumulating(self.model, i == len(micro_batches) - 1), autocast(cfg, env):
                logits = self.model(x)
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                (loss * weight).backward()
            loss_sum += loss.detach() * len(starts)
        if measure:
            params, grads = param_bytes(self.model), grad_bytes(self.model)
        grad_norm = clip_grad_norm(self.model, cfg.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if measure:
            self._memory = MemoryBytes(
                params, grads, optim_bytes(self.optimizer), resident_bytes(env.device)
            )
        # One small all-reduce per step: the mean loss, and whether anyone must stop.
        stats = torch.stack([loss_sum, torch.tensor(float(stop_requested), device=env.device)])
        dist.all_reduce(stats)
        loss_total, stops = stats.tolist()
        step_s = time.perf_counter() - t0
        record = {
            "step": step,
            "loss": loss_total / cfg.batch_size,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "step_s": step_s,
            "tokens_per_s": cfg.batch_size * cfg.seq_len / step_s,
            "flop_per_s": self.flops_per_token * cfg.batch_size * cfg.seq_len / step_s,
            "world_size": env.world_size,
            "session": self.session,
        }
        return record, stops > 0

    def _inject_faults(self, step: int) -> None:
        """The test hooks of --inject-*: act as Ctrl-C, or as a crashing rank."""
        cfg = self.cfg
        if self.env.rank != cfg.inject_rank:
            return
        if step == cfg.inject_sigint_at_step:
            os.kill(os.getpid(), signal.SIGINT)
        if step == cfg.inject_crash_at_step:
            print(f"[rank {self.env.rank}] --inject-crash-at-step {step}: dying", flush=True)
            os._exit(3)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if step == cfg.inject_hang_at_step and restart == "0":
            print(
                f"[rank {self.env.rank}] --inject-hang-at-step {step}: waiting to be killed "
                f"(pid {os.getpid()})",
                flush=True,
            )
            while True:
                signal.pause()

    def _log(self, record: dict[str, Any]) -> None:
        window = self.history[-self.cfg.log_every :]
        tokens = self.cfg.batch_size * self.cfg.seq_len * len(window)
        tps = tokens / sum(r["step_s"] for r in window)
        kind = resident_kind(self.env.device)
        self.reporter.print(
            f"step {record['step']:>5}/{self.cfg.steps} | loss {record['loss']:.4f} | "
            f"lr {record['lr']:.2e} | {tps / 1e3:.1f}k tok/s "
            f"{human_flops(tps * self.flops_per_token)} | {memory_line(self.memory, kind)}"
        )

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss per byte on held-out windows, split across ranks (collective)."""
        cfg, env = self.cfg, self.env
        available = (len(self.corpus.val) - 1) // cfg.seq_len
        count = min(max(cfg.eval_windows, env.world_size), available)
        if cfg.eval_windows == 0 or count < env.world_size:
            return None
        starts = (torch.arange(count) * cfg.seq_len).tensor_split(env.world_size)[env.rank]
        x, y = windows(self.corpus.val, starts, cfg.seq_len)
        self.model.eval()
        with autocast(cfg, env):
            logits = self.model(x.to(env.device)).float()
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1), y.to(env.device).flatten(), reduction="sum"
        )
        stats = torch.stack([loss_sum, torch.tensor(float(y.numel()), device=env.device)])
        dist.all_reduce(stats)
        self.model.train()
        return float(stats[0] / stats[1])

    # ---- the end --------------------------------------------------------------------

    def summarize(self, result: RunResult) -> None:
        """The summary table, summary.json and the plot (collective for the memory)."""
        cfg, env = self.cfg, self.env
        peaks = torch.tensor([peak_rss_bytes(), self._peak_device()], dtype=torch.int64)
        peaks = peaks.to(env.device)
        all_peaks = [torch.empty_like(peaks) for _ in range(env.world_size)]
        dist.all_gather(all_peaks, peaks)
        if not env.is_main:
            return
        ran = [r for r in self.history if r["step"] > result.first_step]
        # The first step of an invocation pays for warm-up; leave it out of the rate.
        steady = ran[1:] or ran
        tps = (
            sum(cfg.batch_size * cfg.seq_len for _ in steady) / sum(r["step_s"] for r in steady)
            if steady
            else math.nan
        )
        tail = [r["loss"] for r in self.history[-cfg.log_every :]]
        median_ms = statistics.median(r["step_s"] for r in ran) * 1e3 if ran else math.nan
        wrapper: str = cfg.wrapper
        if cfg.wrapper == "fsdp":
            wrapper += f" {cfg.sharding_strategy}"
        if cfg.wrapper != "ddp":
            wrapper += f" ({cfg.impl})"
        kind = resident_kind(env.device)
        rows = [
            ("model", f"GPT {cfg.n_layer} layers x {cfg.d_model} wide, {cfg.n_head} heads, "
                      f"{self.num_params / 1e6:.2f}M parameters, byte-level"),
            ("parallelism", f"{wrapper}, {plural(env.world_size, 'rank')}, {env.device.type}/"
                            f"{env.backend}, {cfg.mixed_precision}"
                            + (", cpu offload" if cfg.cpu_offload else "")
                            + (f", {cfg.quantized_comm} comm" if cfg.quantized_comm != "none"
                               else "")),
            ("steps", f"{result.last_step} of {cfg.steps} (this run: {len(ran)}"
                      + (f", resumed at {result.first_step}" if result.first_step else "")
                      + (", interrupted" if result.interrupted else "") + ")"),
            ("batch", f"{cfg.batch_size} x {cfg.seq_len} bytes = "
                      f"{cfg.batch_size * cfg.seq_len:,} tokens/step, "
                      f"grad accum {cfg.grad_accum}"),
            ("training time", f"{result.train_s:.1f} s, median step {median_ms:.0f} ms"),
            ("throughput", f"{tps:,.0f} tokens/s (all ranks, first step excluded)"),
            ("compute", f"{human_flops(tps * self.flops_per_token)} achieved, all ranks "
                        f"({self.flops_per_token:,} FLOP/token: 6N + 12 x layers x width x "
                        "seq len)"),
            ("loss", f"{self.history[0]['loss']:.3f} at step 1 -> "
                     f"{statistics.fmean(tail):.3f} (mean of the last {len(tail)} steps)"
                     if self.history else "-"),
            ("val loss", "-" if result.val_loss is None else f"{result.val_loss:.3f}"),
        ]  # fmt: skip
        memory = []
        for rank, mem in enumerate(self.memory):
            rss, device_peak = (int(v) for v in all_peaks[rank].tolist())
            on_device = f", peak CUDA {human_bytes(device_peak)}" if kind == "cuda" else ""
            rows.append(
                (f"rank {rank} memory", f"params {human_bytes(mem.params)}, grads "
                 f"{human_bytes(mem.grads)}, optim {human_bytes(mem.optim)}; {kind} "
                 f"{human_bytes(mem.resident)}{on_device}, peak RSS {human_bytes(rss)}")
            )  # fmt: skip
            memory.append(
                {"params": mem.params, "grads": mem.grads, "optim": mem.optim,
                 f"{kind}": mem.resident, "peak_rss": rss, "peak_cuda": device_peak}
            )  # fmt: skip
        plot = plot_history(self.history, result.val_loss, cfg.run_dir / "train.png")
        summary = self.reporter.write_summary(
            {
                "steps": result.last_step,
                "steps_this_run": len(ran),
                "interrupted": result.interrupted,
                "world_size": env.world_size,
                "train_s": result.train_s,
                "tokens_per_s": tps,
                "flop_per_s": tps * self.flops_per_token,
                "flops_per_token": self.flops_per_token,
                "loss_first": self.history[0]["loss"] if self.history else None,
                "loss_last": statistics.fmean(tail) if tail else None,
                "val_loss": result.val_loss,
                "memory_per_rank": memory,
                "checkpoint": None if result.checkpoint is None else str(result.checkpoint),
            }
        )
        written = ["config.toml", "metrics.jsonl", "summary.json", plot.name]
        if result.val_loss is not None:
            written.append("val.jsonl")
        if cfg.sample_lines and not result.interrupted:
            written.append("samples.txt")
        if summary is not None and (summary.parent / "tensorboard").is_dir():
            written.append("tensorboard/")
        rows += [
            ("checkpoint", str(result.checkpoint)),
            ("run folder", f"{cfg.run_dir}: {', '.join(written)}"),
        ]
        self.reporter.console.print(summary_table(rows, "run summary"))
        if result.interrupted:
            self.reporter.close()

    def _peak_device(self) -> int:
        device = self.env.device
        return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0

    def sample(self) -> None:
        """A few continuations of --prompt (collective), shown as they are drawn and
        appended to samples.txt."""
        cfg = self.cfg
        texts: list[str] = []
        total = cfg.sample_lines * cfg.sample_chars
        if cfg.sample_lines:
            self.reporter.print(
                f"sampling {plural(cfg.sample_lines, 'continuation')} of {cfg.prompt!r}, "
                f"{cfg.sample_chars} bytes each"
            )
        with self.reporter.progress(total, 0, what="sample"):
            for i in range(cfg.sample_lines):
                text = generate(
                    self.model,
                    cfg.prompt.encode(),
                    new_bytes=cfg.sample_chars,
                    seq_len=cfg.seq_len,
                    temperature=cfg.temperature,
                    seed=cfg.seed + i,
                    device=self.env.device,
                    on_byte=functools.partial(self.reporter.advance, status=f"sample {i + 1}"),
                ).decode("utf-8", "replace")
                texts.append(text)
                self.reporter.print(f"--- sample {i + 1} ---\n{text}")
        self.reporter.write_samples(self.step, cfg.prompt, texts)
        self.reporter.close()
