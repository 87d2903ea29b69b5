"""The training configuration: one dataclass, its checks, and the command line built
from it.

Every field's docstring is also its ``--help`` text (read from this file's source), so
the two never drift apart.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Wrapper = Literal["fsdp", "ddp-zero", "ddp"]
Impl = Literal["ours", "torch"]
Precision = Literal["fp32", "bf16"]
Device = Literal["auto", "cpu", "cuda"]

# The sharding strategies of the seed's ShardingStrategy enum, by name.
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "data" / "corpus.txt"
VOCAB_SIZE = 256  # byte-level: every byte value is a token


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything one training run needs; checked on construction so a bad value fails
    before any process group or model exists."""

    # ---- parallelism --------------------------------------------------------------
    wrapper: Wrapper = "fsdp"
    """How the model is distributed: fsdp (our FullyShardedDataParallel), ddp-zero
    (DDP with our ZeroRedundancyOptimizer) or ddp (torch's DDP, plain AdamW)."""
    impl: Impl = "ours"
    """Whose FSDP / ZeroRedundancyOptimizer to use: ours (this repo's packages) or
    torch (PyTorch's own, the reference we are measured against)."""
    strategy: str | None = None
    """FSDP sharding strategy (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD,
    _HYBRID_SHARD_ZERO2); only with --wrapper fsdp, which defaults to FULL_SHARD."""
    mixed_precision: Precision = "fp32"
    """bf16: compute in bfloat16 (FSDP MixedPrecision with fp32 gradient reduction, or
    autocast under DDP) while parameters and optimizer state stay fp32."""
    cpu_offload: bool = False
    """Keep FSDP's sharded parameters and gradients on the CPU between uses (FSDP
    only)."""
    device: Device = "auto"
    """auto: each rank takes the GPU of its local rank when CUDA is present, else the
    CPU (gloo)."""
    pg_timeout: float = 60.0
    """Seconds a collective may wait for the other ranks before this rank gives up,
    so a rank that dies or hangs makes the others exit instead of waiting forever."""

    # ---- model --------------------------------------------------------------------
    n_layer: int = 4
    """Transformer blocks (each one FSDP unit under the default wrap policy)."""
    n_head: int = 4
    """Attention heads per block; must divide d_model."""
    d_model: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability; above 0 the per-rank RNG streams matter, and a resume at
    another world size can no longer reproduce them (same world size: exact)."""

    # ---- data and optimization ----------------------------------------------------
    data: Path = DEFAULT_CORPUS
    """A text file, read as bytes; the last --val-fraction of it is held out."""
    val_fraction: float = 0.05
    """Fraction of the corpus kept for the validation loss."""
    seq_len: int = 128
    """Bytes per training sequence (the model's context length)."""
    batch_size: int = 32
    """Sequences per optimizer step across all ranks (the global batch); each rank
    takes batch_size / world_size of them, so the data does not depend on the world
    size."""
    grad_accum: int = 2
    """Micro-batches per rank per optimizer step (gradient accumulation)."""
    steps: int = 300
    """Optimizer steps in total (a resumed run continues up to this number)."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    warmup_steps: int = 20
    """Steps of linear warm-up before the cosine decay to lr / 10."""
    weight_decay: float = 0.1
    """AdamW weight decay (one parameter group: FSDP's flat parameters hold matrices and
    norms together)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    seed: int = 1234
    """Seed of the model's initialization, the data order and the sampling."""

    # ---- checkpoints --------------------------------------------------------------
    checkpoint_dir: Path | None = None
    """Where step-numbered checkpoints go (default: OUT_DIR/checkpoints)."""
    checkpoint_every: int = 100
    """Save a checkpoint every this many steps, at the end and on Ctrl-C (0: never)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    resume: bool = False
    """Continue from the newest checkpoint in --checkpoint-dir (any world size)."""
    overwrite: bool = False
    """Start from scratch even if --checkpoint-dir holds checkpoints (deletes them)."""

    # ---- reporting ----------------------------------------------------------------
    out_dir: Path = Path("runs/train")
    """Where metrics.jsonl, the plot (train.png) and, by default, checkpoints go."""
    log_every: int = 10
    """Print a log line (loss, tokens/s, bytes per rank) every this many steps."""
    progress: bool = True
    """Show a progress bar on rank 0 (only when its output is a terminal)."""
    eval_windows: int = 64
    """Held-out sequences for the validation loss at the end (0 skips it)."""

    # ---- sampling -----------------------------------------------------------------
    prompt: str = "Once upon a time"
    """Text the samples after training start from."""
    sample_lines: int = 3
    """Number of samples to print after training (0 skips sampling)."""
    sample_chars: int = 240
    """Bytes generated per sample."""
    temperature: float = 0.8
    """Sampling temperature (lower: more conservative text)."""

    # ---- fault injection, for tests -----------------------------------------------
    inject_sigint_at_step: int | None = None
    """Test hook: rank --inject-rank sends itself SIGINT (as Ctrl-C would) during this
    step."""
    inject_crash_at_step: int | None = None
    """Test hook: rank --inject-rank dies abruptly (os._exit(3)) during this step."""
    inject_rank: int = 0
    """The rank the fault-injection hooks act on."""

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"--{_flag(name)} must be positive, got {value}")

        for name in ("n_layer", "n_head", "d_model", "seq_len", "batch_size", "grad_accum"):
            positive(name)
        for name in ("steps", "lr", "keep_checkpoints", "log_every"):
            positive(name)
        for name in ("pg_timeout", "sample_chars", "temperature"):
            positive(name)
        for name in (
            "warmup_steps",
            "weight_decay",
            "clip_grad",
            "eval_windows",
            "checkpoint_every",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.sample_lines < 0:
            raise ValueError(f"--sample-lines must be >= 0, got {self.sample_lines}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"--d-model({self.d_model}) % --n-head({self.n_head}) = "
                f"{self.d_model % self.n_head} != 0: every head needs the same width"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"--val-fraction must be in (0, 0.5), got {self.val_fraction}")
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"--batch-size({self.batch_size}) % --grad-accum({self.grad_accum}) != 0: "
                "every micro-batch must hold the same number of sequences"
            )
        if self.wrapper != "fsdp":
            for name in ("strategy", "cpu_offload"):
                if getattr(self, name):
                    raise ValueError(
                        f"--{_flag(name)} applies to --wrapper fsdp only "
                        f"(got --wrapper {self.wrapper})"
                    )
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ValueError(f"--strategy {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.resume and not self.checkpoint_every:
            raise ValueError("--resume needs checkpoints: --checkpoint-every is 0")
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other: pick one")
        if self.inject_rank < 0:
            raise ValueError(f"--inject-rank must be >= 0, got {self.inject_rank}")
        for name in ("inject_sigint_at_step", "inject_crash_at_step"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{_flag(name)} must be >= 1 (steps count from 1)")
        if not self.data.is_file():
            raise ValueError(f"--data {self.data} is not a file")

    @property
    def sharding_strategy(self) -> str:
        """The FSDP strategy name in effect (FULL_SHARD unless --strategy says)."""
        return self.strategy or "FULL_SHARD"

    @property
    def checkpoints(self) -> Path:
        """The checkpoint folder in effect."""
        return self.checkpoint_dir or self.out_dir / "checkpoints"

    def check_world_size(self, world_size: int) -> None:
        """The checks that need the launcher's world size, with their arithmetic shown."""
        per_step = world_size * self.grad_accum
        if self.batch_size % per_step:
            raise ValueError(
                f"--batch-size({self.batch_size}) % (WORLD_SIZE({world_size}) * "
                f"--grad-accum({self.grad_accum})) = {self.batch_size % per_step} != 0: "
                "each rank's micro-batches must be equal; pick a batch size divisible by "
                f"{per_step}"
            )
        injecting = self.inject_sigint_at_step or self.inject_crash_at_step
        if injecting and self.inject_rank >= world_size:
            raise ValueError(f"--inject-rank({self.inject_rank}) >= WORLD_SIZE({world_size})")

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (1-based): linear warm-up, then a
        cosine decay to a tenth. A pure function of the step, so a resumed run needs
        nothing but the step number to continue the schedule."""
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))

    def model_shape(self) -> dict[str, int]:
        """The fields a checkpoint's model must share with this run to load into it."""
        return {
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "d_model": self.d_model,
            "seq_len": self.seq_len,
            "vocab_size": VOCAB_SIZE,
        }

    def data_order(self) -> dict[str, int]:
        """The fields that decide which sequences each step sees."""
        return {"seq_len": self.seq_len, "batch_size": self.batch_size, "seed": self.seed}


# ---- the command line -------------------------------------------------------------

HELP_EPILOG = """\
The number of ranks is torchrun's, not ours:
  torchrun --standalone --nproc-per-node 2 examples/train.py --wrapper ddp
  nox -s train -- --nproc-per-node 4 --steps 100      (nox passes it on to torchrun)
Without torchrun the program runs as a single rank.
"""


def _flag(name: str) -> str:
    return name.replace("_", "-")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source, so the
    help text is written once, where the field is."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for node, after in zip(body.body, body.body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _unwrap_optional(tp: Any) -> Any:
    """``X | None`` -> ``X``; anything else unchanged."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def build_parser() -> argparse.ArgumentParser:
    """One option per TrainConfig field, typed and documented from the field."""
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Train a small byte-level GPT on the bundled corpus with our "
        "sharded data-parallel stack.",
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    hints = typing.get_type_hints(TrainConfig)
    docs = field_docs(TrainConfig)
    for field in dataclasses.fields(TrainConfig):
        tp = _unwrap_optional(hints[field.name])
        default = field.default
        help_text = f"{docs.get(field.name, '')} (default: {default})"
        flag = f"--{_flag(field.name)}"
        if tp is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        elif typing.get_origin(tp) is Literal:
            choices = typing.get_args(tp)
            parser.add_argument(flag, choices=choices, default=default, help=help_text)
        else:
            parser.add_argument(flag, type=tp, default=default, help=help_text)
    return parser


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """The command line as a checked TrainConfig; argparse-style exit on errors."""
    parser = build_parser()
    args = sys.argv[1:] if argv is None else list(argv)
    if any(a.split("=")[0] == "--nproc-per-node" for a in args):
        parser.error(
            "--nproc-per-node is torchrun's option, not train.py's: "
            "torchrun --standalone --nproc-per-node N examples/train.py ..."
        )
    namespace = parser.parse_args(args)
    try:
        return TrainConfig(**vars(namespace))
    except ValueError as exc:
        parser.error(str(exc))
