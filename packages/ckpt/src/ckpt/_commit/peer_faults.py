"""A peer that dies or hangs inside a save or load, named like one in training.

[Note: naming a fault inside a checkpoint]
DCP's collectives (the plan's gather and scatter, the gather of the write results,
the broadcast of the commit's outcome, the gather after reading) raise the backend's
bare text when a peer is gone or late: ``Timed out waiting 20000ms for send operation
to complete``, from ``gather_object``. Training's collectives say which rank, which
operation and which phase (:class:`~flatparam.CollectiveError`); a checkpoint's say:

* the step of the save or load it was in (``agreement``, ``preparing``, ``planning``,
  ``writing``, ``commit``, ``verifying``, ``reading``): the transaction records where
  it is as DCP calls back into ckpt's writer and reader; a rank that waits for rank
  0's commit (DCP's broadcast after the write gather) is in ``commit``;
* the rank that did not arrive, when this host can tell: every rank's process
  (host, pid, start time) is gathered once per process group (:func:`peers`, at the
  first save or load on it), and on a failure each peer on this host is looked at:
  gone (killed, exited) or stopped (SIGSTOP, a debugger). A peer on another host, or
  one that runs but is stuck (a filesystem read that never returns), cannot be told
  apart from a slow one, and the message says so;
* what became of the checkpoint (nothing committed, the previous one intact, the
  partial directory removed by rank 0) and the fix.

Only errors raised inside ``torch.distributed``'s collectives are renamed (see
:func:`is_backend_failure`); a ``RuntimeError`` of the user's code passes unchanged.
No collective runs on the failure path: the group is broken.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from ckpt._comm import Comm
from ckpt._errors import CheckpointCollectiveError, CheckpointError
from ckpt._format.processes import ProcessId, state
from flatparam import CollectiveError

__all__ = ["is_backend_failure", "name_fault", "named_faults", "peers", "waited_for_commit"]

_C10D_FILE = "distributed_c10d.py"
# torch's object collectives, as DCP calls them: the frame names the operation.
_OPERATIONS = (
    "gather_object",
    "scatter_object_list",
    "broadcast_object_list",
    "all_gather_object",
    "all_gather",
    "gather",
    "broadcast",
    "barrier",
    "all_to_all_single",
)

_STEP_WORDS = {
    "agreement": "the agreement on the call",
    "preparing": "preparing",
    "planning": "planning",
    "writing": "writing",
    "commit": "the commit",
    "verifying": "verifying the files",
    "reading": "reading",
}

_tables: weakref.WeakKeyDictionary[dist.ProcessGroup, list[ProcessId]] = weakref.WeakKeyDictionary()


def _key(comm: Comm) -> dist.ProcessGroup | None:
    return comm.group if comm.group is not None else dist.group.WORLD


def peers(comm: Comm) -> list[ProcessId] | None:
    """Every rank's process, by group rank; gathered once per group (one all-gather at
    the group's first save or load). None without a process group."""
    if not comm.distributed:
        return None
    key = _key(comm)
    table = _tables.get(key) if key is not None else None
    if table is None:
        table = comm.all_gather(ProcessId.this())
        if key is not None:
            _tables[key] = table
    return table


def _known_table(comm: Comm) -> list[ProcessId] | None:
    key = _key(comm)
    return _tables.get(key) if key is not None else None


def _frames(error: BaseException) -> Iterator[tuple[str, str]]:
    """``(file, function)`` of every frame ``error`` and its causes passed through."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            yield code.co_filename, code.co_name
            tb = tb.tb_next
        current = current.__cause__ or current.__context__


def is_backend_failure(error: BaseException) -> bool:
    """Whether ``error`` came out of a ``torch.distributed`` collective (or is already
    a named one), not out of the user's code."""
    if isinstance(error, CollectiveError):
        return True
    return isinstance(error, RuntimeError) and any(
        f.endswith(_C10D_FILE) for f, _ in _frames(error)
    )


def _operation(error: BaseException) -> str:
    if isinstance(error, CollectiveError):
        return error.operation
    names = [n for f, n in _frames(error) if f.endswith(_C10D_FILE) and n in _OPERATIONS]
    return names[0] if names else "a collective"


def waited_for_commit(error: BaseException) -> bool:
    """Whether the failed collective was DCP's broadcast of the commit's outcome."""
    return any(n == "broadcast_object_list" for _, n in _frames(error))


def _missing(comm: Comm) -> tuple[list[tuple[int, ProcessId, str]], bool]:
    """The peers found gone or stopped, and whether every peer could be looked at."""
    table = _known_table(comm)
    if table is None:
        return [], False
    found: list[tuple[int, ProcessId, str]] = []
    all_seen = True
    for rank, process in enumerate(table):
        if rank == comm.rank:
            continue
        seen = state(process)
        if seen in ("gone", "stopped"):
            found.append((rank, process, seen))
        elif seen == "unknown":
            all_seen = False
    return found, all_seen


def _explain(backend: BaseException, comm: Comm) -> tuple[str, str, tuple[int, ...]]:
    """Why the collective failed and the fix, with the ranks that did not arrive."""
    missing, all_seen = _missing(comm)
    if missing:
        parts = []
        fixes = []
        for rank, process, seen in missing:
            if seen == "gone":
                parts.append(f"rank {rank} died ({process.describe()} is gone)")
                fixes.append(f"look at rank {rank}'s output for why it died")
            else:
                parts.append(
                    f"rank {rank} is stopped ({process.describe()}: SIGSTOP, a debugger "
                    "or a suspended job)"
                )
                fixes.append(f"resume it (kill -CONT {process.pid}) or end it")
        why = "; ".join(parts) + " and did not arrive"
        fix = "; ".join(fixes) + (
            ", then restart the job: it resumes from the last committed checkpoint"
        )
        return why, fix, tuple(r for r, _, _ in missing)
    text = str(backend).lower()
    unseen = "" if all_seen else " (peers on other hosts cannot be looked at from here)"
    if "timed out" in text or "timeout" in text:
        why = (
            "a rank did not arrive within the process group's timeout: it hangs (a stuck "
            "filesystem read, a wedged data loader) or is elsewhere in the program; which "
            f"one is not known{unseen}"
        )
    elif any(w in text for w in ("reset by peer", "closed by peer", "broken pipe", "closed")):
        why = f"a peer rank died or closed its connection; which one is not known{unseen}"
    else:
        why = "the backend failed"
    fix = (
        "find the rank without this error in the job's output (it is the one that did not "
        "arrive), then restart the job from the last committed checkpoint; if saving is "
        "slow rather than stuck, raise the process group's timeout"
    )
    return why, fix, ()


def name_fault(
    error: BaseException, *, call: str, step: str, path: Path, comm: Comm, aftermath: str
) -> CheckpointCollectiveError:
    """The named error for the backend failure ``error`` (chain it: ``from``)."""
    backend = error.backend_error if isinstance(error, CollectiveError) else error
    operation = _operation(error)
    if isinstance(error, CollectiveError) and error.target:
        target = f"{error.target} (checkpoint {str(path)!r})"
    else:
        target = f"checkpoint {str(path)!r}"
    why, fix, missing = _explain(backend, comm)
    first = str(backend).strip().splitlines()[0] if str(backend).strip() else repr(backend)
    rank = dist.get_rank() if dist.is_initialized() else comm.rank
    words = _STEP_WORDS.get(step, step or "an unknown step")
    message = (
        f"rank {rank}: {operation} of {target} failed during {call} ({words}): {why}. "
        f"{aftermath} Fix: {fix}. Backend error: {first}"
    )
    return CheckpointCollectiveError(
        message,
        rank=rank,
        operation=operation,
        target=target,
        phase=f"{call} ({step})" if step else call,
        path=path,
        step=step,
        missing_ranks=missing,
    )


@contextmanager
def named_faults(
    call: str,
    path: Path,
    comm: Comm,
    step: str | Callable[[BaseException], str],
    aftermath: Callable[[], str] = lambda: "",
) -> Iterator[None]:
    """Re-raise a collective's failure inside the block as a
    :class:`CheckpointCollectiveError` of ``call`` in ``step`` (a name, or a function
    of the error). ``aftermath`` cleans up locally (no collective: the group is
    broken) and says what became of the checkpoint."""
    try:
        yield
    except CheckpointError:
        raise
    except RuntimeError as e:
        if not comm.distributed or not is_backend_failure(e):
            raise
        where = step(e) if callable(step) else step
        named = name_fault(e, call=call, step=where, path=path, comm=comm, aftermath=aftermath())
        backend = e.backend_error if isinstance(e, CollectiveError) else e
        raise named from backend
