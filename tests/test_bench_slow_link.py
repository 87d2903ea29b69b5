"""The slow-link benchmark's pure logic and its command line, without running it.

``python -m benchmarks slow-link`` runs for minutes; here are the parts that decide
what it measures and what it touches: rates and the token bucket, the commands it
builds (each names its own namespace and only that namespace's ``lo``), the byte
count read from ``/proc/net/dev``, the summary of the ranks' numbers, its flags and
its refusal without root or iproute2. One test creates and removes a real namespace
(a fraction of a second, root only): removed even when the body raises.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

import benchmarks.__main__ as cli
from benchmarks import bench_slow_link as sl
from benchmarks.common import Options


@pytest.mark.parametrize(
    ("text", "bits"),
    [("1gbit", 10**9), ("10gbit", 10**10), ("500mbit", 5 * 10**8), ("2.5GBit", 25 * 10**8)],
)
def test_parse_rate(text: str, bits: int) -> None:
    assert sl.parse_rate(text) == bits


@pytest.mark.parametrize(
    ("text", "says"),
    [("1gb", "kbit, mbit or gbit"), ("fast", "gbit"), ("10kbit", "below 100kbit")],
)
def test_parse_rate_refuses(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        sl.parse_rate(text)


def test_burst_covers_a_packet_and_a_millisecond() -> None:
    assert sl.burst_bytes(10**9) == sl.MIN_BURST_BYTES > 65536  # lo's MTU
    assert sl.burst_bytes(10**10) == 1_250_000  # 10 Gbit/s for 1 ms


def test_commands_touch_only_the_namespace_loopback() -> None:
    ns = "fsdp-slow-link-1-abc"
    add, up = sl.setup_commands(ns)
    assert add == ["ip", "netns", "add", ns]
    assert sl.teardown_command(ns) == ["ip", "netns", "delete", ns]
    rate = sl.rate_command(ns, 10**9)
    for cmd in (up, rate, sl.inside_command(ns, Path("/tmp/spec.pkl"))):
        assert cmd[:4] == ["ip", "netns", "exec", ns]  # never the launcher's namespace
    assert up[4:] == ["ip", "link", "set", "lo", "up"]
    assert rate[4:] == [
        "tc", "qdisc", "replace", "dev", "lo", "root", "tbf",
        "rate", "1000000000bit", "burst", "262144b", "latency", "50ms",
    ]  # fmt: skip
    assert sl.namespace_name().startswith(f"{sl.NETNS_PREFIX}{os.getpid()}-")
    assert sl.namespace_name() != sl.namespace_name()


PROC_NET_DEV = """\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
  eth0: 999 9 0 0 0 0 0 0 888 8 0 0 0 0 0 0
    lo:  123456     10    0    0    0     0          0         0   654321      11    0    0    0     0       0          0
"""  # noqa: E501


def test_lo_tx_bytes() -> None:
    assert sl.lo_tx_bytes(PROC_NET_DEV) == 654321
    with pytest.raises(RuntimeError, match="no lo"):
        sl.lo_tx_bytes(PROC_NET_DEV.replace("lo:", "l0:"))


def _rank(times: list[float], waits: list[float], nbytes: list[int]) -> dict[str, Any]:
    variants = {v: {"times": times, "waits": waits, "bytes": nbytes} for v in sl.VARIANTS}
    return {"variants": variants, "param_bytes": 400, "link": {"seconds": 0.5, "bytes": 5 * 10**7}}


def test_summarize() -> None:
    ranks = [
        _rank([1.0, 2.0, 3.0], [0.1, 0.2, 0.3], [8000, 9000, 10000]),
        _rank([1.5, 1.0, 4.0], [0.3, 0.4, 0.5], [0, 0, 0]),  # lo's count is read on rank 0
    ]
    ranks[0]["variants"][sl.COMPUTE] = {
        "times": [0.5, 0.5, 1.0],
        "waits": [0.0] * 3,
        "bytes": [0] * 3,
    }
    rows = sl.summarize(ranks, bits=8000)
    row = rows[sl.OURS_FSDP1]
    assert row.step_s == 2.0  # slowest rank per step: 1.5, 2.0, 4.0
    assert row.wait_s == pytest.approx(0.3)  # mean over ranks per step: 0.2, 0.3, 0.4
    # the compute-only step, slowest rank per round: 1.5, 1.0, 4.0
    assert row.over_compute_s == pytest.approx(0.0)  # 0.0, 1.0, 0.0
    assert row.sent_per_rank == 4500  # lo's 9000 B shared by 2 ranks
    assert row.link_s == 9.0  # 9000 B x 8 / 8000 bit/s
    assert sl.achieved_bits(ranks) == 8 * 10**8
    cells = sl.table_rows("30M", 2, 10**9, 4 * 10**6, rows)
    assert [c[3] for c in cells] == list(sl.VARIANTS)
    assert cells[0][:3] == ["1.0M (30M)", "2", "1 Gbit/s"]
    assert cells[-1][5:] == ["-"] * 5  # the compute-only row has no communication


def test_plan() -> None:
    plan = sl.Plan.from_options(Options())
    assert list(plan.sizes) == ["30M", "60M"]
    assert (plan.world_sizes, plan.rates) == ([2, 4], ["1gbit", "10gbit"])
    assert (plan.steps, plan.warmup, plan.batch) == (sl.STEPS, sl.WARMUP, sl.BATCH)
    assert list(plan.configurations()) == [("30M", 2), ("30M", 4), ("60M", 2), ("60M", 4)]
    flags = {"sizes": ["60M"], "world_sizes": [4], "rates": ["500mbit"], "steps": 3, "batch": 1}
    plan = sl.Plan.from_options(Options(repeats=2, flags=flags))
    assert (list(plan.configurations()), plan.rates) == ([("60M", 4)], ["500mbit"])
    assert (plan.steps, plan.warmup, plan.batch) == (6, sl.WARMUP, 1)
    quick = sl.Plan.from_options(Options(quick=True))
    assert (list(quick.configurations()), quick.rates) == ([("tiny", 2)], ["1gbit"])


def test_cli_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "bench_slow_link flags" in out and "--world-sizes" in out and "--rates" in out


def test_cli_passes_flags_and_runs_preflight(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, Options]] = []
    monkeypatch.setattr(sl, "preflight", lambda options: seen.append(("preflight", options)))
    monkeypatch.setattr(sl, "run", lambda options: seen.append(("run", options)) or [])
    assert cli.main(["slow-link", "--rates", "1gbit,10gbit", "--steps", "3", "--quick"]) == 0
    assert [s[0] for s in seen] == ["preflight", "run"]
    options = seen[1][1]
    assert options.quick and dict(options.flags) == {"rates": ["1gbit", "10gbit"], "steps": 3}
    assert cli.module_name("slow-link") == cli.module_name("bench_slow_link") == "bench_slow_link"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["zero", "--rates", "1gbit"], "--rates is a flag of bench_slow_link"),
        (["slow-link", "--rates", "1gbyte"], "kbit, mbit or gbit"),
        (["slow-link", "--world-sizes", "1"], "at least 2 ranks"),
        (["slow-link", "--sizes", "7M"], "unknown size '7M'"),
    ],
)
def test_cli_refuses(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def test_preflight_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match=r"needs root \(uid 1000 here\).*sudo"):
        sl.preflight(Options())
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(SystemExit, match=r"ip and tc not found.*iproute2"):
        sl.preflight(Options())


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="creating a network namespace needs root and iproute2",
)
def test_namespace_is_removed_even_when_the_body_raises() -> None:
    def namespaces() -> str:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
        return listed.stdout

    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyError, match="inside"), sl.slow_link_namespace() as ns:
        assert ns in namespaces()
        subprocess.run(sl.rate_command(ns, 10**9), check=True)
        shown = subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", "lo"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert "tbf" in shown and "rate 1Gbit" in shown
        assert signal.getsignal(signal.SIGTERM) is not handler  # SIGTERM reaches finally
        raise KeyError("inside")
    assert ns not in namespaces()
    assert signal.getsignal(signal.SIGTERM) is handler


def test_add_arguments_have_no_defaults() -> None:
    parser = argparse.ArgumentParser()
    group = parser.add_argument_group("x", argument_default=argparse.SUPPRESS)
    actions = sl.add_arguments(group)
    assert {a.dest for a in actions} == {
        "sizes",
        "world_sizes",
        "rates",
        "steps",
        "warmup",
        "batch",
    }
    assert vars(parser.parse_args([])) == {}


def test_quantized_note_compares_with_ours_exact() -> None:
    row = sl.Row(step_s=2.0, wait_s=0.0, over_compute_s=0.0, sent_per_rank=400.0, link_s=0.0)
    rows = {v: row for v in sl.VARIANTS}
    rows[sl.OURS_FSDP1_INT8] = sl.Row(1.0, 0.0, 0.0, 100.0, 0.0)
    rows[sl.OURS_FSDP2_INT8] = sl.Row(1.5, 0.0, 0.0, 110.0, 0.0)
    note = sl.quantized_note("30M", 2, 10**9, rows)
    assert note == (
        "int8 comm vs exact, 30M N=2 1 Gbit/s: FSDP1 step 0.50x, bytes 0.25x; "
        "fully_shard step 0.75x, bytes 0.28x"
    )
