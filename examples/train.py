"""Train a small byte-level GPT across processes with our sharded data-parallel stack.

    python examples/train.py --nproc-per-node 2   # 2 ranks, our FSDP, FULL_SHARD
    nox -s train                  # the same, with the stack installed
    torchrun --nnodes 2 --nproc-per-node 8 ... examples/train.py   # one rank per process

Parse the config (--config FILE, then the command line), check it, then either start
the ranks (--nproc-per-node, see tinygpt/launch.py) or be one: settle the run folder,
build, train, report, and whatever happens, leave the process group. The pieces live
in ``examples/tinygpt/``; ``--help`` lists every option.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Set
from pathlib import Path

import torch.distributed
from tinygpt.checkpoint import latest_checkpoint
from tinygpt.config import TrainConfig, parse_command_line
from tinygpt.distributed import destroy_distributed, init_distributed, is_peer_failure
from tinygpt.launch import EXIT_INTERRUPTED, EXIT_USAGE, launch, strip_option
from tinygpt.parallel import WrapperNotAvailableError, check_available
from tinygpt.trainer import Trainer, settle

import ckpt


def main(argv: list[str] | None = None) -> int:
    """Run the program; returns the process exit code (0, 2 usage or configuration
    error, 130 or 143 stopped by SIGINT or SIGTERM, 1 anything else)."""
    args = sys.argv[1:] if argv is None else list(argv)
    command = parse_command_line(args)
    cfg, nproc = command.config, command.nproc
    if "RANK" not in os.environ:  # not started by a launcher: check before spawning
        try:
            check_available(cfg)
            cfg.check_world_size(nproc or 1)
        except (WrapperNotAvailableError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return EXIT_USAGE
        if nproc is not None:
            return launch(nproc, Path(__file__), strip_option(args, "--nproc-per-node"))
    return run_rank(cfg, command.explicit)


def run_rank(cfg: TrainConfig, explicit: Set[str] = frozenset()) -> int:
    """Be one rank of the job: train, report, sample; the exit code of this rank.
    ``explicit``: the options this invocation sets itself (a resume changes those)."""
    rank = "?"
    trainer: Trainer | None = None
    try:
        check_available(cfg)  # before any process exists to wait for us
        env = init_distributed(cfg)
        rank = str(env.rank)
        cfg = settle(cfg, explicit, env)  # [Note: resuming with changed options]
        trainer = Trainer(cfg, env)
        if not trainer.start():
            return 0  # a finished run: start() said so
        result = trainer.fit()
        trainer.summarize(result)
        if result.interrupted:
            # Wait for rank 0's report: torchrun stops the others when one exits non-zero.
            torch.distributed.barrier()
            return 128 + result.stop_signal if result.stop_signal else EXIT_INTERRUPTED
        trainer.sample()
        return 0
    except (WrapperNotAvailableError, ckpt.CheckpointError, ValueError) as exc:
        # ckpt.CheckpointError: also tinygpt's own (a subclass), e.g. a checkpoint of
        # another model, and ckpt's (a corrupt file, a missing key), raised on every rank.
        if rank in ("?", "0"):  # the same mistake on every rank: say it once
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except Exception as exc:
        if not is_peer_failure(exc):
            raise
        latest = latest_checkpoint(cfg.checkpoints)
        where = f" in step {trainer.step + 1}" if trainer is not None else ""
        print(
            f"[rank {rank}] stopping: a collective failed{where}, most likely because another "
            f"rank died or stopped responding (see its error above; this rank waited at "
            f"most --pg-timeout {cfg.pg_timeout:g} s).\n"
            f"  {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}\n"
            f"  newest checkpoint: {latest or 'none'}"
            + (
                " (continue with --resume; under torchrun --max-restarts the job resumes "
                "from it by itself)"
                if latest
                else ""
            )
            + (
                f"\n  snapshots in memory every {cfg.snapshot_every} step(s): a restart by "
                "torchrun resumes from the newest complete one when it is newer"
                if cfg.snapshot_every
                else ""
            ),
            file=sys.stderr,
            flush=True,
        )
        return 1
    finally:
        trainer = None  # before the process group: [Note: who destroys the process group]
        destroy_distributed()


def _exit_now(code: int) -> None:
    """End the process without interpreter teardown, once everything is flushed.

    [Note: leaving without teardown]
    By this point the ranks have finished, checkpoints are committed (the example
    saves synchronously) and the process group is destroyed. What interpreter teardown still
    does is destroy torch's C++ objects, and on torch 2.13 with gloo that sometimes
    aborts the process (``terminate called without an active exception``, exit 134)
    although all work is done: rare for one process, but a multi-node run has several
    and a launcher then reports the whole job failed. Flushing the streams and
    logging, then ``os._exit``, keeps the exit status the program's own.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
