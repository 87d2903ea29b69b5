"""The training configuration: one dataclass, its checks, and the command line built
from it.

Every field's docstring is also its ``--help`` text (read from this file's source), so
the two never drift apart.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import inspect
import math
import os
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

Wrapper = Literal["fsdp", "fully_shard", "ddp-zero", "ddp"]
Impl = Literal["ours", "torch"]
Precision = Literal["fp32", "bf16"]
QuantizedComm = Literal["none", "int8", "int8-bf16"]
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
    """How the model is distributed: fsdp (our FullyShardedDataParallel), fully_shard
    (FSDP2's API: our fully_shard), ddp-zero (DDP with our ZeroRedundancyOptimizer) or
    ddp (torch's DDP, plain AdamW)."""
    impl: Impl = "ours"
    """Whose FSDP / fully_shard / ZeroRedundancyOptimizer to use: ours (this repo's
    packages) or torch (PyTorch's own, the reference we are measured against)."""
    strategy: str | None = None
    """FSDP sharding strategy (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD,
    _HYBRID_SHARD_ZERO2); only with --wrapper fsdp, which defaults to FULL_SHARD."""
    mixed_precision: Precision = "fp32"
    """bf16: compute in bfloat16 (FSDP MixedPrecision with fp32 gradient reduction, or
    autocast under DDP) while parameters and optimizer state stay fp32."""
    quantized_comm: QuantizedComm = "none"
    """Quantized communication (our fsdp and fully_shard only, fsdp.QuantizedCommPolicy):
    int8 gathers weights and reduces gradients as int8 blocks (one fp32 scale per 64
    elements), int8-bf16 gathers int8 and reduces bf16; the sharded fp32 parameters
    stay exact. For slow links."""
    cpu_offload: bool = False
    """Keep FSDP's sharded parameters and gradients on the CPU between uses (fsdp and
    fully_shard only)."""
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
    snapshot_every: int = 0
    """Snapshot the training state into host memory every this many steps (0: never),
    replicated in another machine's memory: a job that torchrun restarts after a lost
    worker or machine resumes from the newest snapshot or checkpoint, whichever is
    newer, losing no completed step with 1 (see examples/README.md)."""
    snapshot_dir: Path | None = None
    """The host-memory folder (tmpfs) snapshots go to (default /dev/shm)."""
    resume: str | None = None
    """Continue from a checkpoint in --checkpoint-dir, at any world size: the newest
    (--resume alone), the one of a step (--resume 200) or a checkpoint folder (--resume
    PATH). A run restarted by torchrun (--max-restarts) resumes from the newest by
    itself."""
    move_aside_damaged: bool = False
    """With --resume: rename damaged checkpoints (no manifest, or files that fail
    verification) to NAME.damaged and resume from the newest good one, instead of
    stopping."""
    overwrite: bool = False
    """Start from scratch even if --checkpoint-dir holds checkpoints (deletes them)."""

    # ---- reporting ----------------------------------------------------------------
    out_dir: Path | None = None
    """Where metrics.jsonl, the plot (train.png) and, by default, checkpoints go;
    default runs/NAME, NAME naming the options changed from their defaults (see
    run_name), so each configuration has its own folder."""
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
    inject_hang_at_step: int | None = None
    """Test hook: rank --inject-rank prints its pid and blocks during this step (first
    attempt only), for a test to kill it."""
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
            "snapshot_every",
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
        if self.wrapper != "fsdp" and self.strategy:
            raise ValueError(
                f"--strategy applies to --wrapper fsdp only (got --wrapper {self.wrapper})"
            )
        if self.wrapper not in ("fsdp", "fully_shard") and self.cpu_offload:
            raise ValueError(
                f"--cpu-offload applies to --wrapper fsdp or fully_shard only "
                f"(got --wrapper {self.wrapper})"
            )
        if self.quantized_comm != "none" and (
            self.wrapper not in ("fsdp", "fully_shard") or self.impl != "ours"
        ):
            raise ValueError(
                f"--quantized-comm applies to our --wrapper fsdp or fully_shard only (got "
                f"--wrapper {self.wrapper} --impl {self.impl}; torch's FSDP has no such option)"
            )
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ValueError(f"--strategy {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.resume is not None and not self.checkpoint_every:
            raise ValueError("--resume needs checkpoints: --checkpoint-every is 0")
        if self.resume is not None and self.overwrite:
            raise ValueError("--resume and --overwrite contradict each other: pick one")
        if self.move_aside_damaged and self.resume is None:
            raise ValueError("--move-aside-damaged applies to --resume only")
        if self.inject_rank < 0:
            raise ValueError(f"--inject-rank must be >= 0, got {self.inject_rank}")
        for name in ("inject_sigint_at_step", "inject_crash_at_step", "inject_hang_at_step"):
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
    def run_dir(self) -> Path:
        """The output folder in effect: --out-dir, or runs/<run_name()>."""
        return self.out_dir if self.out_dir is not None else Path("runs") / self.run_name()

    def run_name(self) -> str:
        """The default run folder's name: the wrapper, then every option that shapes
        the run and differs from its default (``fsdp``, ``ddp-zero``, ``fsdp-bf16``,
        ``fsdp-torch``, ``fsdp-d_model=64``). --steps is left out, so a run continued
        with more steps stays in its folder; so are the reporting, checkpoint and test
        options."""
        parts: list[str] = [self.wrapper]
        for field in dataclasses.fields(TrainConfig):
            if field.name in _NAMED_FLAGS:
                value, default = getattr(self, field.name), field.default
                if value != default:
                    parts.append(_NAMED_FLAGS[field.name](value))
        return "-".join(parts)

    @property
    def checkpoints(self) -> Path:
        """The checkpoint folder in effect."""
        return self.checkpoint_dir or self.run_dir / "checkpoints"

    def check_world_size(self, world_size: int) -> None:
        """The checks that need the launcher's world size, with their arithmetic shown."""
        if self.batch_size < world_size * self.grad_accum:
            raise ValueError(
                f"--batch-size({self.batch_size}) < WORLD_SIZE({world_size}) * "
                f"--grad-accum({self.grad_accum}): every rank needs at least one sequence "
                f"per micro-batch; use --batch-size {world_size * self.grad_accum} or more, "
                "fewer ranks or a smaller --grad-accum"
            )
        injecting = (
            self.inject_sigint_at_step or self.inject_crash_at_step or self.inject_hang_at_step
        )
        if injecting and self.inject_rank >= world_size:
            raise ValueError(f"--inject-rank({self.inject_rank}) >= WORLD_SIZE({world_size})")

    def lr_at(self, step: int, total: int | None = None) -> float:
        """Learning rate of optimizer step ``step`` (1-based): linear warm-up, then a
        cosine decay to a tenth at step ``total``, a tenth after it.

        [Note: the schedule of a resumed run]
        ``total`` is the --steps the run was *started* with (kept in its checkpoints),
        not the current --steps: a pure function of the step and that total, so a run
        resumed with more steps continues the curve it was on (at lr / 10 past the
        original total) instead of jumping to a new cosine."""
        total = self.steps if total is None else total
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        span = max(1, total - self.warmup_steps)
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


def _value(name: str) -> typing.Callable[[Any], str]:
    return lambda value: f"{name}={value}"


# The options that name a run folder (run_name), each with how it is written there.
_NAMED_VALUES = (
    "n_layer", "n_head", "d_model", "dropout", "seq_len", "batch_size", "grad_accum", "lr",
    "warmup_steps", "weight_decay", "clip_grad", "seed", "val_fraction",
)  # fmt: skip
_NAMED_FLAGS: dict[str, typing.Callable[[Any], str]] = {
    "impl": str,
    "strategy": str,
    "mixed_precision": str,
    "quantized_comm": lambda value: f"q{value}",
    "cpu_offload": lambda _: "offload",
    "device": str,
    **{name: _value(name) for name in _NAMED_VALUES},
    "data": lambda path: f"data={Path(path).stem}",
}


def naming_fields() -> list[str]:
    """The options a default run folder's name is made of (see run_name)."""
    return ["wrapper", *_NAMED_FLAGS]


# ---- the command line -------------------------------------------------------------

HELP_EPILOG = """\
Ranks: --nproc-per-node N starts N local ranks (torch's elastic launcher, as
`torchrun --standalone` would); without it the program runs as one rank, or as one
of the ranks torchrun started (torchrun --nnodes ... for several machines):
  python examples/train.py --nproc-per-node 2 --wrapper ddp
  nox -s train -- --nproc-per-node 4 --steps 100
Config file: --config run.toml holds options under their names (lr = 0.001); the
command line overrides it. Every run writes its resolved options to RUN/config.toml.
Resume: --resume continues the run these options name; options given with it change
the run from there on (--resume --lr 0.001 continues runs/fsdp with a new lr).
Exit status: 0 done, 2 a usage or configuration error, 130 stopped by Ctrl-C, 143 by
SIGTERM (both after a checkpoint), 1 anything else.
"""

NEWEST = "newest"  # --resume without a value


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


_GROUP_COMMENT = re.compile(r"^\s*#\s*-{2,}\s*(.+?)\s*-{2,}\s*$")


def field_groups(cls: type) -> dict[str, list[str]]:
    """Group title -> field names, from the ``# ---- title ----`` comments between a
    dataclass's fields (so --help and config.toml follow the class's own sections)."""
    lines, first = inspect.getsourcelines(cls)
    titles: list[tuple[int, str]] = []
    for offset, text in enumerate(lines):
        match = _GROUP_COMMENT.match(text)
        if match is not None:
            titles.append((first + offset, match.group(1)))
    groups: dict[str, list[str]] = {}
    tree = ast.parse(textwrap.dedent("".join(lines)))
    body = tree.body[0]
    assert isinstance(body, ast.ClassDef)
    for node in body.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            line = first + node.lineno - 1
            title = next((t for at, t in reversed(titles) if at < line), "options")
            groups.setdefault(title, []).append(node.target.id)
    return groups


def _unwrap_optional(tp: Any) -> Any:
    """``X | None`` -> ``X``; anything else unchanged."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, with a one-line error instead of the 30-line usage before it."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n({self.prog} --help lists the options)\n")


# The group whose options are hidden from --help (still accepted): test hooks.
_HIDDEN_GROUP = "fault injection, for tests"


def build_parser(*, given_only: bool = False) -> argparse.ArgumentParser:
    """One option per TrainConfig field, typed and documented from the field and
    grouped as the class groups them, plus --config and --nproc-per-node.

    ``given_only``: every default is SUPPRESS, so a parse holds only the options the
    command line gives (which options a resume changes)."""
    parser = _Parser(
        prog="train.py",
        usage="%(prog)s [--nproc-per-node N] [--config FILE] [OPTION ...]",
        description="Train a small byte-level GPT on the bundled corpus with our "
        "sharded data-parallel stack.",
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # launch.strip_option finds --nproc-per-node by its full name
        argument_default=argparse.SUPPRESS if given_only else None,
    )

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if given_only else value

    run = parser.add_argument_group("launching")
    run.add_argument(
        "--nproc-per-node",
        type=_positive_int,
        default=default(None),
        metavar="N",
        help="start N ranks on this machine and wait for them (not under torchrun, "
        "which has its own --nproc-per-node)",
    )
    run.add_argument(
        "--config",
        type=Path,
        default=default(None),
        metavar="FILE",
        help='a TOML file of options (lr = 0.001, mixed_precision = "bf16", ...; a run '
        "folder's config.toml works); options on the command line override it",
    )
    hints = typing.get_type_hints(TrainConfig)
    docs = field_docs(TrainConfig)
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for title, names in field_groups(TrainConfig).items():
        hidden = title == _HIDDEN_GROUP
        group = parser.add_argument_group(None if hidden else title)
        for name in names:
            field = fields[name]
            tp = _unwrap_optional(hints[name])
            help_text = (
                argparse.SUPPRESS if hidden else f"{docs.get(name, '')} (default: {field.default})"
            )
            flag = f"--{_flag(name)}"
            if name == "resume":
                group.add_argument(
                    flag, nargs="?", const=NEWEST, default=default(None), metavar="STEP|PATH",
                    help=help_text,
                )  # fmt: skip
            elif tp is bool:
                group.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=default(field.default),
                    help=help_text,
                )  # fmt: skip
            elif typing.get_origin(tp) is Literal:
                choices = typing.get_args(tp)
                group.add_argument(
                    flag, choices=choices, default=default(field.default), help=help_text
                )
            else:
                group.add_argument(flag, type=tp, default=default(field.default), help=help_text)
    return parser


class CommandLine(NamedTuple):
    """What the command line asks for."""

    config: TrainConfig
    nproc: int | None  # --nproc-per-node; None: not given
    given: frozenset[str]  # the TrainConfig fields the command line sets itself
    config_file: Path | None  # --config
    from_file: frozenset[str]  # the fields --config's file sets

    @property
    def explicit(self) -> frozenset[str]:
        """What this invocation sets itself: the command line's and the file's fields."""
        return self.given | self.from_file


def parse_command_line(argv: list[str] | None = None) -> CommandLine:
    """The command line (over --config's file, over the defaults) as a checked
    TrainConfig, with --nproc-per-node and which options it gives; argparse-style exit
    (status 2, one line on stderr) on errors.

    Under a launcher every rank parses the same arguments; only rank 0 speaks, so help
    and usage errors are printed once (all ranks still exit with the same status)."""
    from .config_file import ConfigFileError, read_config_file

    parser = build_parser()
    args = sys.argv[1:] if argv is None else list(argv)
    quiet = os.environ.get("RANK", "0") != "0"
    with open(os.devnull, "w") as devnull, contextlib.ExitStack() as stack:
        if quiet:
            stack.enter_context(contextlib.redirect_stdout(devnull))
            stack.enter_context(contextlib.redirect_stderr(devnull))
        given = vars(build_parser(given_only=True).parse_args(args))
        config_file = given.get("config")
        from_file: dict[str, Any] = {}
        if config_file is not None:
            try:
                from_file = read_config_file(config_file)
            except ConfigFileError as exc:
                parser.error(str(exc))
            parser.set_defaults(**from_file)
        namespace = vars(parser.parse_args(args))
        nproc = namespace.pop("nproc_per_node")
        namespace.pop("config")
        if nproc is not None and "RANK" in os.environ:
            parser.error(
                "--nproc-per-node: this process is already one rank of a launched job "
                "(RANK is set); give the number of ranks to torchrun instead"
            )
        try:
            cfg = TrainConfig(**namespace)
        except ValueError as exc:
            parser.error(str(exc))
    fields = frozenset(given) - {"nproc_per_node", "config"}
    return CommandLine(cfg, nproc, fields, config_file, frozenset(from_file))


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """The command line as a checked TrainConfig (see parse_command_line)."""
    return parse_command_line(argv).config
