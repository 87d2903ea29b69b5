"""Starting the ranks ourselves (``train.py --nproc-per-node N``): torch's elastic
launcher, the one torchrun runs, called in this process so that the exit status and
what is printed at the end are ours to decide.

[Note: one voice at the end of a run]
Under torchrun, any rank that exits non-zero becomes a ~35-line ``ChildFailedError``
dump after the message the rank already printed, and a Ctrl-C becomes a
``SignalException`` traceback, even when the ranks stopped cleanly with a checkpoint.
Here the ranks' exit codes are read instead: 2 (a usage or configuration error, which
rank 0 has already explained) ends the launch with 2 and nothing more; 130 or 143
(stopped by Ctrl-C or SIGTERM, after a checkpoint) with that status, the shell's code
for the signal; anything else with one line per failed rank and status 1. The agent's own log lines
are silenced for the same reason.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

EXIT_USAGE = 2  # argparse's status for a usage error; ours for any configuration error
EXIT_INTERRUPTED = 130  # the shell's status for "stopped by Ctrl-C" (128 + SIGINT)
EXIT_TERMINATED = 143  # 128 + SIGTERM: what a scheduler's preemption ends with


def strip_option(args: Sequence[str], flag: str) -> list[str]:
    """``args`` without ``flag VALUE`` / ``flag=VALUE`` (the parser allows no
    abbreviations, so these are the only spellings)."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(f"{flag}="):
            out.append(arg)
    return out


def _describe(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with status {exitcode}"


def _quiet_agent() -> None:
    """Silence the agent's loggers (each has its own level, set when torch creates it):
    what they would say is said by rank 0 or by the lines ``launch`` prints."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(nproc: int, script: Path, args: Sequence[str]) -> int:
    """Run ``script args`` as ``nproc`` ranks on this machine (a c10d rendezvous on a
    free local port, as ``torchrun --standalone``) and return the launch's exit status
    (see [Note: one voice at the end of a run])."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: ranks share the cores
    _quiet_agent()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
    )
    try:
        elastic_launch(config, sys.executable)("-u", str(script), *args)
    except ChildFailedError as exc:
        _, first = exc.get_first_failure()
        if first.exitcode in (EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED):
            return first.exitcode  # explained by rank 0 already
        for rank, failure in sorted(exc.failures.items()):
            print(f"train.py: rank {rank} {_describe(failure.exitcode)}", file=sys.stderr)
        return 1
    except SignalException as exc:
        # Ctrl-C or SIGTERM reached this process: the agent passed the signal on to the
        # ranks and waited for them to checkpoint and exit.
        return 128 + int(exc.sigval)  # 130 for SIGINT, 143 for SIGTERM
    return 0
