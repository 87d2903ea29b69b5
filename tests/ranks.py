"""Run one function on N ranks of a process group, fast, and never hang.

Every distributed test in this repository goes through :func:`run_ranks`::

    def _allreduce_rank() -> float:          # module level, so it pickles
        t = torch.ones(1) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return t.item()

    def test_allreduce() -> None:
        assert run_ranks(_allreduce_rank, 2) == [3.0, 3.0]

Each call forks ``world_size`` fresh rank processes, initialises a gloo process
group in each (``file://`` rendezvous in a fresh temporary folder, so no ports
clash), runs ``fn(*args, **kwargs)`` and hands the return values back in rank
order; the rank processes then end, and their process group with them. Any
rank that raises, exits or blocks turns into a :class:`RankFailure` in the
test, carrying every failing rank's traceback or stack. Each rank's
stdout/stderr (file descriptors 1 and 2, so C++ and faulthandler output too)
goes to a file that is printed into the test's captured output after a
failure.

Cost on a 2-core machine: the first call waits for the forkserver (2-4 s,
mostly ``import torch``); after that a trivial call costs about 40 ms at
world size 1, 60-80 ms at 2 and 110-170 ms at 4 (``test_harness_cost`` in
``tests/test_ranks.py`` prints it).

[Note: why a forkserver]
``import torch`` costs about 2.5 s, so a fresh interpreter per rank per test
would dominate the suite. The ranks are forked from a multiprocessing
forkserver that imported torch, torch.distributed and our packages once
(:data:`PRELOAD`); a fork of it is ready in milliseconds and still starts from
a clean state, unlike rank processes reused across tests, where one test's
leftovers (process group, RNG, monkeypatches, leaked threads) leak into the
next. The forkserver is started once per pytest process (in the background
as soon as collection shows that a test module imported this one, see
``tests/conftest.py``) and stopped at session end.

[Note: never hang, never orphan]
Three layers, outermost last:
1. The process group has ``timeout=timeout``, so a collective whose peer never
   comes raises in the rank instead of waiting forever.
2. The test process waits at most ``timeout`` seconds (counted once the ranks
   are forked) for all ranks, and at most ``GRACE_AFTER_FAILURE_S`` more once
   any rank has failed (its peers are then usually stuck in a collective). A
   rank still running then gets SIGUSR1 (faulthandler writes all its Python
   stacks to a file, which goes into the report) and SIGKILL. A ``finally``
   kills and reaps every rank also when the test is interrupted
   (pytest-timeout's SIGALRM, Ctrl-C).
3. If the test process dies outright (SIGKILL, or pytest-timeout's thread
   method calling ``os._exit``), the forkserver sees its "alive" pipe close and
   exits; every rank holds ``PR_SET_PDEATHSIG=SIGKILL`` towards the forkserver
   and dies with it. Each rank also arms a faulthandler watchdog that exits it
   ``WATCHDOG_EXTRA_S`` after its timeout, whatever else goes wrong.

Environment:
- ``RANKS_BACKEND``: the process-group backend (default ``gloo``; ``nccl`` also
  binds each rank to ``cuda:rank`` and needs a GPU per rank: on a one-GPU machine
  NCCL runs at world size 1 only). Every rank gets ``LOCAL_RANK=rank`` as under
  torchrun, whatever the backend; a test that runs several gloo ranks on one GPU
  must name ``cuda:0`` (``device_id=0``) itself, since ``cuda:LOCAL_RANK`` does
  not exist there (``tests/gpu/test_cuda.py``).
- ``RANKS_SHOW_OUTPUT=1``: print every rank's stdout/stderr after every call,
  not only after a failure.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import importlib
import importlib.util
import marshal
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, TypeVar

__all__ = [
    "BACKEND_ENV",
    "PRELOAD",
    "SHOW_OUTPUT_ENV",
    "RankFailure",
    "run_ranks",
    "shutdown",
    "warm_up",
]

T = TypeVar("T")

BACKEND_ENV = "RANKS_BACKEND"
SHOW_OUTPUT_ENV = "RANKS_SHOW_OUTPUT"

# Imported once in the forkserver, so that every rank starts with them loaded.
# Missing ones are skipped (e.g. a package not installed in this environment).
PRELOAD: tuple[str, ...] = (
    "torch",
    "torch.nn",
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.optim",
    "torch.distributed.checkpoint",
    "torch.distributed.algorithms.join",
    "torch.testing",
    "numpy",
    "pytest",
    "hypothesis",
    "flatparam",
    "zero_optim",
    "fsdp",
    "ckpt",
    "tests.ranks",
)

# After the first rank fails, how long its peers get to finish (usually they
# fail within milliseconds once gloo sees the failed rank's sockets close).
GRACE_AFTER_FAILURE_S = 3.0
# How long to wait for a stuck rank's faulthandler stack dump before SIGKILL.
DUMP_WAIT_S = 2.0
# A rank kills itself this long after its timeout if nobody else has.
WATCHDOG_EXTRA_S = 30.0
# How much of a rank's output goes into a failure message.
OUTPUT_TAIL_LINES = 40

_PR_SET_PDEATHSIG = 1
_lock = threading.Lock()


class RankFailure(AssertionError):  # noqa: N818  (the name other tests import)
    """One or more ranks raised, exited, or blocked.

    An ``AssertionError`` so that pytest reports a failed test, not an error in
    the harness. The message holds each failing rank's full traceback (or its
    exit code, or where it was stuck), the first failure first.
    """

    def __init__(self, message: str, failures: dict[int, str], stuck: tuple[int, ...]) -> None:
        super().__init__(message)
        # rank -> the report for that rank (traceback, exit status or stack dump)
        self.failures = failures
        # ranks that were still running when the harness gave up on them
        self.stuck = stuck

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.failures, self.stuck))


@dataclass(frozen=True)
class _RankJob:
    """Everything a rank process needs, sent to it through the forkserver."""

    rank: int
    world_size: int
    workdir: str  # per-call temporary folder: rendezvous, outputs, results
    payload: bytes  # pickle of (fn, args, kwargs)
    timeout: float  # seconds; process-group timeout and the watchdog's base
    backend: str
    env: dict[str, str]  # the test process's environment at the call
    # (module name, file, marshalled code) of fn's module with pytest's assert
    # rewriting, or None: see _rewritten_code
    rewritten: tuple[str, str, bytes] | None
    server_pid: int = 0  # the forkserver, our parent: we must die with it


@dataclass(frozen=True)
class _Outcome:
    """What one rank left behind, read by the test process after it ended."""

    rank: int
    status: str  # "ok" | "raised" | "exited" | "stuck"
    report: str  # the text that goes into RankFailure for this rank
    failed_at: float  # time.time() of the failure, inf if none; orders the report
    result: bytes = b""  # the pickled return value when status == "ok"


def warm_up() -> None:
    """Start the forkserver now, without waiting for it.

    The forkserver spends a few seconds importing :data:`PRELOAD`; starting it
    while pytest still collects and runs single-process tests hides that cost
    from the first distributed test.
    """
    with _lock:
        _context()
        multiprocessing.forkserver.ensure_running()


def shutdown() -> None:
    """Stop the forkserver; the next :func:`run_ranks` starts a new one.

    Called at the end of the pytest session so that no process outlives it.
    """
    with _lock:
        server = _server()
        pid = getattr(server, "_forkserver_pid", None)
        if pid is None:
            return
        # The forkserver would only exit once every holder of its "alive" pipe
        # closed it, and a process some test leaked may still hold one: end it
        # directly. Its remaining children, if any, die with it (PDEATHSIG).
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        server._stop()  # closes our pipe end, reaps it, removes its socket


def run_ranks(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    **kwargs: Any,
) -> list[T]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results in rank order.

    Each rank is a fresh process (forked from a forkserver with torch loaded)
    with an initialised default process group (``torch.distributed.get_rank()``
    works inside ``fn``) and ``torch.set_num_threads(1)``. ``fn``, the arguments
    and the return values must pickle; ``fn`` must live at module level of an
    importable module. ``timeout`` (seconds) bounds the ranks' run, counted
    once they are forked: rendezvous, every collective (it is the process
    group's timeout too) and ``fn`` itself. Nothing is seeded: every rank
    starts from torch's default seed, so seed in ``fn`` what must differ or
    match. Batch many sub-cases into one call: a call costs a fork and a
    rendezvous (tens of milliseconds), a sub-case inside it nothing extra.

    Raises :class:`RankFailure` when any rank raises, exits early, or is still
    running after ``timeout`` seconds; every rank process is gone by the time
    this returns or raises.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"run_ranks could not pickle {fn!r} with its arguments ({exc}); fn must be a "
            "module-level function of an importable module (not a lambda or a local "
            "function), and its arguments must pickle"
        ) from exc
    backend = os.environ.get(BACKEND_ENV, "gloo")
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    with _lock:
        ctx = _context()
        workdir = Path(tempfile.mkdtemp(prefix="ranks-"))
        try:
            rewritten = _rewritten_code(getattr(fn, "__module__", None))
            env = dict(os.environ)
            jobs = [
                _RankJob(rank, world_size, str(workdir), payload, timeout, backend, env, rewritten)
                for rank in range(world_size)
            ]
            outcomes = _launch_and_wait(ctx, jobs)
            _show_output(workdir, world_size, force=any(o.status != "ok" for o in outcomes))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    failed = [o for o in outcomes if o.status != "ok"]
    if failed:
        raise _failure(name, world_size, timeout, failed)
    results = []
    for o in outcomes:
        try:
            results.append(pickle.loads(o.result))
        except Exception as exc:
            raise TypeError(
                f"rank {o.rank}'s return value from {name} could not be unpickled in the test "
                f"process ({exc!r}); return plain data (numbers, lists, tensors) from a rank"
            ) from exc
    return results


_ROOT = str(Path(__file__).resolve().parents[1])  # the folder that holds the tests package


def _context() -> multiprocessing.context.BaseContext:
    """The forkserver context, with our preload list set for its next start."""
    # The forkserver and the ranks take sys.path from this process; with
    # pytest's importlib import mode the tests package is not on it, and they
    # could not import this module (or the tests) by name. Appended, so it
    # shadows nothing installed.
    if _ROOT not in sys.path:
        sys.path.append(_ROOT)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _server() -> Any:
    """multiprocessing's forkserver singleton (private fields used: pid, alive fd, _stop)."""
    return multiprocessing.forkserver._forkserver


# module name -> (name, file, marshalled code); None where rewriting does not apply
_rewritten_cache: dict[str, tuple[str, str, bytes] | None] = {}


def _rewritten_code(module_name: str | None) -> tuple[str, str, bytes] | None:
    """fn's module compiled with pytest's assert rewriting, if pytest rewrote it here.

    The ranks import fn's module afresh, and a plain import would give their
    ``assert a == b`` a bare ``AssertionError``. When pytest rewrote the module
    in this process, the ranks get the same rewritten code and their failures
    read ``assert 2 == 3``. Compiled once per module; any problem (another
    pytest version, no pytest) falls back to a plain import in the ranks.
    """
    if module_name is None:
        return None
    if module_name in _rewritten_cache:
        return _rewritten_cache[module_name]
    entry = None
    module = sys.modules.get(module_name)
    loader = getattr(module, "__loader__", None)
    filename = getattr(module, "__file__", None)
    if type(loader).__name__ == "AssertionRewritingHook" and filename is not None:
        try:
            import ast

            from _pytest.assertion.rewrite import rewrite_asserts

            source = Path(filename).read_bytes()
            tree = ast.parse(source, filename=filename)
            rewrite_asserts(tree, source, filename, getattr(loader, "config", None))
            code = compile(tree, filename, "exec", dont_inherit=True)
            entry = (module_name, filename, marshal.dumps(code))
        except Exception:
            entry = None
    _rewritten_cache[module_name] = entry
    return entry


def _launch_and_wait(
    ctx: multiprocessing.context.BaseContext, jobs: list[_RankJob]
) -> list[_Outcome]:
    """Start the ranks, wait for them within the deadlines, and always reap them."""
    procs: list[Any] = []  # multiprocessing.Process of the forkserver context
    world_size = len(jobs)
    timeout = jobs[0].timeout
    workdir = Path(jobs[0].workdir)
    try:
        multiprocessing.forkserver.ensure_running()
        server_pid = _server()._forkserver_pid
        for job in jobs:
            proc = ctx.Process(  # type: ignore[attr-defined]
                target=_rank_main,
                args=(replace(job, server_pid=server_pid),),
                name=f"rank{job.rank}",
                daemon=True,
            )
            proc.start()  # returns once forked: waits for a (re)starting forkserver
            procs.append(proc)
        # The timeout counts from here, so a forkserver still importing torch
        # does not eat into the first test's time.
        deadline = time.monotonic() + timeout

        outcomes: dict[int, _Outcome] = {}
        first_failure: float | None = None
        while len(outcomes) < world_size:
            limit = deadline
            if first_failure is not None:
                limit = min(deadline, first_failure + GRACE_AFTER_FAILURE_S)
            left = limit - time.monotonic()
            if left <= 0:
                break
            running = {p.sentinel: r for r, p in enumerate(procs) if r not in outcomes}
            for sentinel in multiprocessing.connection.wait(list(running), timeout=left):
                rank = running[sentinel]
                procs[rank].join()
                outcomes[rank] = _read_outcome(workdir, rank, procs[rank].exitcode)
                if outcomes[rank].status != "ok" and first_failure is None:
                    first_failure = time.monotonic()

        # A rank that wrote its outcome but has not exited waits in the exit
        # barrier for a failed or stuck peer: its own outcome stands.
        for r in range(world_size):
            if r not in outcomes and (workdir / f"rank{r}.result").exists():
                procs[r].kill()
                procs[r].join()
                outcomes[r] = _read_outcome(workdir, r, None)
        stuck = [r for r in range(world_size) if r not in outcomes]
        if stuck:
            why = (
                f"still running {timeout:g} s after start (the timeout)"
                if first_failure is None
                else f"still running {GRACE_AFTER_FAILURE_S:g} s after another rank failed"
            )
            stacks = _dump_stacks(workdir, {r: procs[r].pid for r in stuck})
            for r in stuck:
                procs[r].kill()
                procs[r].join()
                outcomes[r] = _Outcome(
                    r,
                    "stuck",
                    f"rank {r} was {why}; killed. Its Python stacks at that moment:\n"
                    + (stacks.get(r) or "(no stack dump arrived)"),
                    float("inf"),
                )
        return [outcomes[r] for r in range(world_size)]
    finally:
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in procs:
            proc.join(5.0)
            if proc.exitcode is not None:
                proc.close()


def _dump_stacks(workdir: Path, pids: dict[int, int | None]) -> dict[int, str]:
    """Ask stuck ranks for their Python stacks (faulthandler on SIGUSR1) and read them."""
    for pid in pids.values():
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
    stacks: dict[int, str] = {}
    deadline = time.monotonic() + DUMP_WAIT_S
    sizes: dict[int, int] = {}
    while len(stacks) < len(pids) and time.monotonic() < deadline:
        for rank in pids:
            if rank in stacks:
                continue
            path = workdir / f"rank{rank}.stack"
            size = path.stat().st_size if path.exists() else 0
            # faulthandler writes from inside the signal handler; a size that
            # stopped growing means the dump is complete.
            if size and sizes.get(rank) == size:
                stacks[rank] = _without_harness_frames(path.read_text(errors="replace"))
            sizes[rank] = size
        time.sleep(0.02)
    return stacks


def _without_harness_frames(dump: str) -> str:
    """Drop the frames below ``_rank_main`` (multiprocessing's bootstrap) from a stack dump.

    faulthandler lists the innermost frame first, so each thread's frames from
    ``_rank_main`` down to the end of its block are the harness, not the test.
    """
    kept: list[str] = []
    skipping = False
    for line in dump.splitlines():
        if not line.startswith("  File "):
            skipping = False  # a thread header or a blank line starts a new block
        elif skipping:
            continue
        elif line.endswith(" in _rank_main"):
            skipping = True
            continue
        kept.append(line)
    return "\n".join(kept)


def _read_outcome(workdir: Path, rank: int, exitcode: int | None) -> _Outcome:
    """Turn a finished rank's result file and exit code into an outcome."""
    path = workdir / f"rank{rank}.result"
    if path.exists():
        record = pickle.loads(path.read_bytes())
        if record[0] == "ok":
            return _Outcome(rank, "ok", "", float("inf"), record[1])
        _, phase, text, failed_at = record
        return _Outcome(rank, "raised", f"rank {rank} raised {phase}:\n{text}", failed_at)
    if exitcode is not None and exitcode < 0:
        try:
            how = f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode}"
    tail = _tail(workdir / f"rank{rank}.out")
    report = f"rank {rank} {how} before returning a result"
    if tail:
        report += f"; the end of its output:\n{tail}"
    return _Outcome(rank, "exited", report, time.time())


def _failure(name: str, world_size: int, timeout: float, failed: list[_Outcome]) -> RankFailure:
    """Build the exception: a summary line, then each failed rank, earliest first."""
    failed = sorted(failed, key=lambda o: (o.failed_at, o.rank))
    stuck = tuple(o.rank for o in failed if o.status == "stuck")
    summary = ", ".join(f"rank {o.rank} {o.status}" for o in failed)
    lines = [
        f"{len(failed)} of {world_size} ranks failed in {name} "
        f"(world_size={world_size}, timeout={timeout:g} s): {summary}"
    ]
    for o in failed:
        lines.append(f"\n===== rank {o.rank} ({o.status}) =====\n{o.report.rstrip()}")
    return RankFailure("\n".join(lines), {o.rank: o.report for o in failed}, stuck)


def _tail(path: Path) -> str:
    if not path.exists():
        return ""
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-OUTPUT_TAIL_LINES:])


def _show_output(workdir: Path, world_size: int, *, force: bool) -> None:
    """Print each rank's captured output into the test's stdout.

    pytest then shows it under "Captured stdout" of a failing test (or live
    with ``-s``). Printed after failures always, after successes only with
    ``RANKS_SHOW_OUTPUT=1``, so passing tests stay quiet.
    """
    if not (force or os.environ.get(SHOW_OUTPUT_ENV) == "1"):
        return
    for rank in range(world_size):
        path = workdir / f"rank{rank}.out"
        text = path.read_text(errors="replace") if path.exists() else ""
        if text:
            sys.stdout.write(f"----- rank {rank} stdout/stderr -----\n{text}")
            if not text.endswith("\n"):
                sys.stdout.write("\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------
# Everything below runs inside a rank process.
# --------------------------------------------------------------------------

# Kept referenced so that faulthandler's file descriptors stay open.
_rank_files: list[IO[Any]] = []


def _rank_main(job: _RankJob) -> None:
    """Body of a rank process: set up, run ``fn``, leave an outcome file, exit.

    Ends in ``os._exit`` so that nothing ``fn`` left behind (a non-daemon
    thread, an atexit hook, a process group's destructor) can keep the process
    alive after its result is out.
    """
    rank, world_size, timeout, backend = job.rank, job.world_size, job.timeout, job.backend
    workdir = Path(job.workdir)
    _die_with_forkserver(job.server_pid)
    out = _redirect_output(workdir / f"rank{rank}.out")
    stack = open(workdir / f"rank{rank}.stack", "w")  # noqa: SIM115  (lives until exit)
    _rank_files.extend([out, stack])
    faulthandler.enable(file=out, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
    faulthandler.dump_traceback_later(timeout + WATCHDOG_EXTRA_S, exit=True, file=out)

    record: tuple[Any, ...]
    phase = "setting up (before fn ran)"
    import torch
    import torch.distributed as dist

    try:
        # The environment of the test process now, not of the forkserver when
        # it started: a test's monkeypatch.setenv reaches its ranks.
        os.environ.clear()
        os.environ.update(job.env)
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        # Every rank is on this host: loopback works where hostname lookup may not.
        if (
            backend == "gloo"
            and "GLOO_SOCKET_IFNAME" not in os.environ
            and os.path.exists("/sys/class/net/lo")
        ):
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        torch.set_num_threads(1)
        if backend == "nccl":
            gpus = torch.cuda.device_count()
            if world_size > gpus:
                raise RuntimeError(
                    f"{BACKEND_ENV}=nccl at world size {world_size} needs a GPU per rank, "
                    f"this machine has {gpus}: NCCL refuses two ranks on one GPU; use "
                    "world size 1, or gloo with every rank on cuda:0"
                )
            torch.cuda.set_device(rank)
        if job.rewritten is not None:
            _import_rewritten(*job.rewritten)
        fn, args, kwargs = pickle.loads(job.payload)
        dist.init_process_group(
            backend,
            init_method=f"file://{workdir / 'rendezvous'}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        phase = "in fn"
        result = fn(*args, **kwargs)
        phase = "returning its result"
        try:
            record = ("ok", pickle.dumps(result))
        except Exception as exc:
            raise TypeError(
                f"the return value of {fn!r} could not be pickled: {exc}; return plain "
                "data (numbers, lists, tensors) from a rank"
            ) from exc
    except BaseException as exc:
        tb = exc.__traceback__
        if phase == "in fn" and tb is not None and tb.tb_next is not None:
            tb = tb.tb_next  # start the traceback at fn, not at this harness frame
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        record = ("error", phase, text, time.time())
    tmp = workdir / f"rank{rank}.result.tmp"
    tmp.write_bytes(pickle.dumps(record))
    os.replace(tmp, workdir / f"rank{rank}.result")
    if record[0] == "ok" and dist.is_initialized():
        # [Note: exit barrier] A rank must not close its sockets while a peer
        # still needs them: gloo lets a fast rank leave init_process_group (and
        # a trivial fn) while a slow peer is still connecting to it, and that
        # peer then fails with "Connection closed by peer". A rank that failed
        # skips this and closes at once, which is what makes its peers fail
        # fast. The result is already written, so an error or a kill here
        # changes nothing.
        with contextlib.suppress(Exception):
            dist.barrier()
    # [Note: no destroy_process_group] The process ends here, and with it the
    # process group: the kernel closes its sockets and frees its memory.
    # destroy_process_group would do the same in gloo's destructor, which
    # costs 10 ms per peer (half of a trivial 2-rank call).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _import_rewritten(name: str, filename: str, code: bytes) -> None:
    """Import test module ``name`` from its assert-rewritten code (see _rewritten_code)."""
    if name in sys.modules:
        return
    package, _, attr = name.rpartition(".")
    parent = importlib.import_module(package) if package else None
    spec = importlib.util.spec_from_file_location(name, filename)
    if spec is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        exec(marshal.loads(code), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    if parent is not None:
        setattr(parent, attr, module)


def _die_with_forkserver(server_pid: int) -> None:
    """Make this rank die with the forkserver, which dies with the test process.

    The forkserver exits once every holder of its "alive" pipe has closed it;
    we close our copy so that the test process is the only one left, and ask
    the kernel to SIGKILL us when our parent (the forkserver) exits.
    """
    server = _server()
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(alive_fd)
        server._forkserver_alive_fd = None
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != server_pid:  # the forkserver died before prctl took effect
            os._exit(1)


def _redirect_output(path: Path) -> IO[Any]:
    """Point file descriptors 1 and 2 (and sys.stdout/stderr) at one per-rank file.

    The file descriptors, not only the Python objects, so that output from C++
    (gloo warnings) and from faulthandler lands there too.
    """
    out = open(path, "w", buffering=1)  # noqa: SIM115  (lives until exit)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    return out
