"""The rank harness itself: results, failures, hangs, cleanup, and its cost.

Rank functions live at module level so that they pickle into the rank
processes; each test checks what the test process sees.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.ranks import BACKEND_ENV, SHOW_OUTPUT_ENV, RankFailure, run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (read from /proc, no psutil)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    # the state follows the parenthesised command name: "pid (comm) S ..."
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _read_pids(folder: Path, world_size: int) -> list[int]:
    return [int((folder / f"pid{r}").read_text()) for r in range(world_size)]


def _write_pid(folder: str) -> None:
    # Written beside and renamed, so a reader never sees a half-written file.
    path = Path(folder) / f"pid{dist.get_rank()}"
    path.with_suffix(".tmp").write_text(str(os.getpid()))
    path.with_suffix(".tmp").rename(path)


# ---------------------------------------------------------------- rank functions


def _rank_report(scale: float, *, offset: float) -> tuple[int, int, float, int, int]:
    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)]) * scale + offset
    dist.all_reduce(t)
    return rank, dist.get_world_size(), t.item(), os.getpid(), torch.get_num_threads()


def _return_tensor(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64) + dist.get_rank()


def _raise_on_rank_one() -> int:
    print(f"hello from rank {dist.get_rank()}")
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1: 2 != 3")
    return 0


def _assert_on_rank_one_then_collective() -> None:
    if dist.get_rank() == 1:
        value = 2
        assert value == 3, f"rank 1 saw {value}, wanted 3"
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that is gone


def _exit_on_rank_one(code: int) -> int:
    # Both ranks finish connecting first: a rank 1 that exits while rank 0 is still
    # inside gloo's connectFullMesh makes rank 0 fail too (seen under load).
    dist.barrier()
    if dist.get_rank() == 1:
        sys.stdout.flush()
        os._exit(code)
    return dist.get_rank()


def _segfault_on_rank_one() -> int:
    if dist.get_rank() == 1:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return dist.get_rank()


def _block_forever_on_rank_one(folder: str) -> int:
    _write_pid(folder)
    if dist.get_rank() == 1:
        threading.Event().wait()  # never set: a Python-level hang, not a collective
    return dist.get_rank()


def _collective_without_peer(folder: str) -> int:
    _write_pid(folder)
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins, but stays alive
    else:
        threading.Event().wait()
    return dist.get_rank()


def _block_all(folder: str) -> None:
    _write_pid(folder)
    threading.Event().wait()


def _bare_assert_on_rank_one() -> None:
    value = dist.get_rank() + 1
    if dist.get_rank() == 1:
        assert value == 3


def _read_env(name: str) -> str | None:
    return os.environ.get(name)


def _leave_a_thread_running() -> int:
    threading.Thread(target=threading.Event().wait, daemon=False).start()
    return dist.get_rank()


def _return_unpicklable() -> object:
    return threading.Lock()


def _trivial() -> int:
    return dist.get_rank()


# ------------------------------------------------------------------------ tests


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size: int) -> None:
    results = run_ranks(_rank_report, world_size, 2.0, offset=1.0)
    expected_sum = sum(2.0 * (r + 1) + 1.0 for r in range(world_size))
    assert [r[0] for r in results] == list(range(world_size))
    assert all(r[1] == world_size for r in results)
    assert all(r[2] == expected_sum for r in results)
    pids = [r[3] for r in results]
    assert len(set(pids)) == world_size and os.getpid() not in pids
    assert all(r[4] == 1 for r in results)  # torch.set_num_threads(1) in every rank
    assert not any(_alive(pid) for pid in pids)


def test_tensors_round_trip() -> None:
    results = run_ranks(_return_tensor, 2, 1000)
    for rank, t in enumerate(results):
        torch.testing.assert_close(t, torch.arange(1000, dtype=torch.float64) + rank)


def test_rank_that_raises_fails_with_its_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank_one, 2)
    message = str(info.value)
    assert "rank 1 raised" in message
    assert "ValueError: boom from rank 1: 2 != 3" in message
    assert "rank 1 raised in fn:" in message
    assert "in _raise_on_rank_one" in message  # the traceback, not only the message
    assert "rank 0" not in message  # rank 0 returned normally
    assert set(info.value.failures) == {1}
    assert isinstance(info.value, AssertionError)  # pytest reports a failure, not an error
    # every rank's output is shown after a failure
    out = capsys.readouterr().out
    assert "----- rank 1 stdout/stderr -----\nhello from rank 1" in out
    assert "hello from rank 0" in out


def test_first_failure_is_reported_first() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_assert_on_rank_one_then_collective, 2, timeout=20)
    message = str(info.value)
    assert "AssertionError: rank 1 saw 2, wanted 3" in message
    assert 1 in info.value.failures
    # rank 0 fails too (its peer vanished mid-collective), but after rank 1
    assert message.index("===== rank 1") < message.index("===== rank 0")


def test_bare_assert_in_a_rank_shows_its_values() -> None:
    """Ranks run fn's module with pytest's assert rewriting, as the test process does."""
    with pytest.raises(RankFailure) as info:
        run_ranks(_bare_assert_on_rank_one, 2)
    assert "assert 2 == 3" in str(info.value)


def test_rank_that_exits_is_reported_with_its_code() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_exit_on_rank_one, 2, 3)
    assert "rank 1 exited with code 3" in str(info.value)
    assert set(info.value.failures) == {1}


def test_rank_that_segfaults_is_reported_with_the_signal_and_stack() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_segfault_on_rank_one, 2)
    message = str(info.value)
    assert "rank 1 was killed by signal SIGSEGV" in message
    assert "_segfault_on_rank_one" in message  # faulthandler's dump, from the rank's output


def test_rank_that_blocks_fails_within_the_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_block_forever_on_rank_one, 2, str(tmp_path), timeout=2.0)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert info.value.stuck == (1,)
    assert "rank 1 was still running 2 s after start (the timeout); killed" in message
    assert "_block_forever_on_rank_one" in message  # where it was stuck
    assert elapsed < 15  # the timeout plus the stack dump (generous for a loaded box), not forever
    assert not any(_alive(pid) for pid in _read_pids(tmp_path, 2))


def test_collective_whose_peer_never_joins_times_out(tmp_path: Path) -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_collective_without_peer, 2, str(tmp_path), timeout=2.0)
    message = str(info.value)
    # rank 0 gives up through the process-group timeout or is killed; rank 1 is killed
    assert "rank 0" in message and "rank 1" in message
    assert "all_reduce" in message
    assert not any(_alive(pid) for pid in _read_pids(tmp_path, 2))


def test_interrupted_call_kills_its_ranks(tmp_path: Path) -> None:
    """What pytest-timeout's signal method does: an exception raised mid-wait."""

    class InterruptError(Exception):
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise InterruptError

    def interrupt_once_ranks_run(done: threading.Event) -> None:
        # Interrupt only once both ranks wrote their pid (a fixed delay raced rank
        # start-up on a loaded machine); give up with the call's own timeout.
        deadline = time.monotonic() + 60
        while not done.wait(0.01) and time.monotonic() < deadline:
            if all((tmp_path / f"pid{r}").exists() for r in range(2)):
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGALRM)
                return

    old = signal.signal(signal.SIGALRM, interrupt)
    done = threading.Event()
    watcher = threading.Thread(target=interrupt_once_ranks_run, args=(done,), daemon=True)
    try:
        watcher.start()
        with pytest.raises(InterruptError):
            run_ranks(_block_all, 2, str(tmp_path), timeout=60)
    finally:
        done.set()
        watcher.join()
        signal.signal(signal.SIGALRM, old)
    assert not any(_alive(pid) for pid in _read_pids(tmp_path, 2))
    assert run_ranks(_trivial, 2) == [0, 1]  # the harness still works afterwards


def _children(pid: int) -> list[int]:
    """The direct children of ``pid``, from /proc (no psutil)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_shutdown_then_ranks_die_with_a_killed_test_process(tmp_path: Path) -> None:
    """shutdown() ends the forkserver; a test process killed outright leaves no rank.

    Runs in a stand-in test process, killed with SIGKILL as pytest-timeout's
    thread method or an OOM killer would. It imports neither torch nor this
    module, and its forkserver preloads only what a rank needs.
    """
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        import tests.ranks as ranks
        ranks.PRELOAD = ()  # a forkserver that starts in milliseconds
        ranks.warm_up()
        server = ranks._server()._forkserver_pid
        ranks.shutdown()
        Path({str(tmp_path / "first")!r}).write_text(str(server))
        ranks.PRELOAD = ("torch.distributed", "tests.ranks")
        ranks.run_ranks(time.sleep, 2, 600, timeout=600)
        """
    )
    # its per-call folder, which a killed process cannot remove, goes to tmp_path
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 60
        ranks: list[int] = []
        while len(ranks) < 2:  # the second forkserver's children are the blocked ranks
            assert child.poll() is None, "the stand-in test process died early"
            assert time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.05)
            if (tmp_path / "first").exists():
                ranks = [pid for server in _children(child.pid) for pid in _children(server)]
        assert not _alive(int((tmp_path / "first").read_text()))  # shutdown() ended it
    finally:
        child.kill()
        child.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in ranks)


def test_show_output_prints_every_rank_after_success(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_ranks(_raise_on_rank_one, 1) == [0]
    assert capsys.readouterr().out == ""  # quiet by default
    monkeypatch.setenv(SHOW_OUTPUT_ENV, "1")
    assert run_ranks(_raise_on_rank_one, 1) == [0]
    assert capsys.readouterr().out == "----- rank 0 stdout/stderr -----\nhello from rank 0\n"


def test_ranks_see_the_environment_of_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANKS_TEST_VALUE", "set by the test")
    assert run_ranks(_read_env, 2, "RANKS_TEST_VALUE") == ["set by the test"] * 2
    assert run_ranks(_read_env, 1, "LOCAL_RANK") == ["0"]


def test_thread_left_running_by_fn_does_not_hold_the_rank() -> None:
    start = time.monotonic()
    assert run_ranks(_leave_a_thread_running, 2, timeout=20) == [0, 1]
    assert time.monotonic() - start < 10  # returned, not killed at the timeout


def test_rank_failure_pickles() -> None:
    """pytest-xdist and multiprocessing move exceptions between processes."""
    failure = RankFailure("message", {1: "report"}, (1,))
    copy = pickle.loads(pickle.dumps(failure))
    assert (str(copy), copy.failures, copy.stuck) == ("message", {1: "report"}, (1,))


def test_unpicklable_function_is_refused_before_starting() -> None:
    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(lambda: 0, 2)


def test_unpicklable_result_names_the_problem() -> None:
    with pytest.raises(RankFailure, match="could not be pickled"):
        run_ranks(_return_unpicklable, 1)


@pytest.mark.parametrize("world_size", [0, -1, 2.0, True])
def test_bad_world_size_is_refused(world_size: int) -> None:
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        run_ranks(_trivial, world_size)


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), float("nan")])
def test_bad_timeout_is_refused(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout must be a positive, finite number"):
        run_ranks(_trivial, 1, timeout=timeout)


def test_backend_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "no-such-backend")
    with pytest.raises(RankFailure, match="no-such-backend") as info:
        run_ranks(_trivial, 1)
    assert "rank 0 raised setting up (before fn ran)" in str(info.value)


def test_harness_cost(capsys: pytest.CaptureFixture[str]) -> None:
    """Prints what a call costs; asserts only correctness (timings are not tested)."""
    lines = []
    for world_size, calls in ((1, 5), (2, 20), (4, 5)):
        start = time.perf_counter()
        for _ in range(calls):
            assert run_ranks(_trivial, world_size) == list(range(world_size))
        per_call = (time.perf_counter() - start) / calls
        lines.append(f"world_size={world_size}: {per_call * 1000:.0f} ms per call ({calls} calls)")
    with capsys.disabled():
        print("\nrun_ranks trivial call cost: " + "; ".join(lines))
