"""Destroy the default process group at interpreter exit, before C++ teardown does.

[Note: clean exit]
A process that leaves its gloo process group to Python's finalization sometimes
dies at exit with ``terminate called without an active exception`` (SIGABRT,
exit code 134) after it did all its work, more often after a collective failed
(a timeout leaves a gloo operation pending): the group's C++ objects are then
torn down in no defined order while its threads still run. Destroying the group
from an ``atexit`` hook, while the interpreter is intact, exits cleanly (measured
over repeated 2-rank runs: 1 in 6 aborted without it, none with it). Non-daemon
threads (an asynchronous checkpoint) have been joined by then; destroying a gloo
group is local and closes its sockets, which makes any peer still waiting on
this rank fail at once instead of at its timeout. fsdp and zero_optim each
register the hook on import; it does nothing when no group is left.
"""

from __future__ import annotations

import atexit
import contextlib

import torch.distributed as dist

__all__ = ["register_clean_exit"]


def _destroy_default_group() -> None:
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def register_clean_exit() -> None:
    """Register the exit hook once per process (see [Note: clean exit])."""
    atexit.unregister(_destroy_default_group)  # at most once, whoever registered it before
    atexit.register(_destroy_default_group)
