"""Train a small byte-level GPT across processes with our sharded data-parallel stack.

    torchrun --standalone --nproc-per-node 2 examples/train.py   # our FSDP, FULL_SHARD
    nox -s train                  # the same, with the stack installed, 2 ranks on CPU

Parse the config, build, train, report; whatever happens, leave the process group.
The pieces live in ``examples/tinygpt/``; ``--help`` lists every option.
"""

from __future__ import annotations

import sys

import torch.distributed
from tinygpt.checkpoint import latest_checkpoint
from tinygpt.config import parse_config
from tinygpt.distributed import destroy_distributed, init_distributed, is_peer_failure
from tinygpt.parallel import WrapperNotAvailableError, check_available
from tinygpt.trainer import Trainer

import ckpt

EXIT_INTERRUPTED = 130  # the shell's code for "stopped by Ctrl-C"


def main(argv: list[str] | None = None) -> int:
    """Run the program; returns the process exit code."""
    cfg = parse_config(argv)
    rank = "?"
    trainer: Trainer | None = None
    try:
        check_available(cfg)  # before any process exists to wait for us
        env = init_distributed(cfg)
        rank = str(env.rank)
        trainer = Trainer(cfg, env)
        trainer.start()
        result = trainer.fit()
        trainer.summarize(result)
        if result.interrupted:
            # Wait for rank 0's report: torchrun stops the others when one exits non-zero.
            torch.distributed.barrier()
            return EXIT_INTERRUPTED
        trainer.sample()
        return 0
    except (WrapperNotAvailableError, ckpt.CheckpointError, ValueError) as exc:
        # ckpt.CheckpointError: also tinygpt's own (a subclass), e.g. a checkpoint of
        # another model, and ckpt's (a corrupt file, a missing key), raised on every rank.
        if rank in ("?", "0"):  # the same mistake on every rank: say it once
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
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
            + (" (continue with --resume)" if latest else ""),
            file=sys.stderr,
            flush=True,
        )
        return 1
    finally:
        trainer = None  # before the process group: [Note: who destroys the process group]
        destroy_distributed()


if __name__ == "__main__":
    sys.exit(main())
