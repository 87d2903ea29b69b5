"""The failover benchmark's parts, and the simulated machines it runs on.

``python -m benchmarks failover`` takes minutes; here: what it reads from train.py's
output, the torchrun commands it builds (the fast re-forming settings the examples
README shows), and, as root, the simulated machines themselves: two machines with
their own hostname, address and ``/dev/shm``, a process on one reaching the other, and
a kill that ends the machine's processes and memory, everything removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_failover as fo
from benchmarks import machines

EXAMPLES_README = Path(__file__).resolve().parent.parent / "examples" / "README.md"


def test_step_and_resume_lines_are_read() -> None:
    line = "2026-11-29 03:55:12 step    41/80 | loss 4.8145 | lr 6.00e-04 | 8.1k tok/s"
    match = fo.STEP_LINE.search(line)
    assert match is not None and match[1] == "41"
    for text, step, source in [
        ("resumed step 40 from memory (2 ranks -> 1, 1 shard from a replica)", 40, "memory"),
        ("resumed step 25 from disk (memory holds no snapshot)", 25, "disk"),
        ("resumed from /tmp/run/checkpoints/step_00000025 at step 25", 25, None),
        ("restarted by the launcher before the first checkpoint: from step 0", 0, None),
    ]:
        m = fo.RESUMED.search(text)
        assert m is not None, text
        assert int(m[1] or m[3] or m[4]) == step and m[2] == source


def test_agent_commands() -> None:
    one = fo._agent_command(fo.CASES["worker"], 0, "10.213.0.10", ["--steps", "3"])
    assert "--standalone" in one and one[-2:] == ["--steps", "3"]
    two = fo._agent_command(fo.CASES["machine-2x2"], 1, "10.213.0.11", [])
    joined = " ".join(two)
    assert "--nnodes 1:2 --nproc-per-node 2" in joined
    assert "--local-addr 10.213.0.11" in joined
    assert f"is_host=0,{fo.RDZV_CONF}" in joined
    # The settings the benchmark measures are the ones the examples README shows.
    assert fo.RDZV_CONF in EXAMPLES_README.read_text()


def test_interface_bytes() -> None:
    text = (
        "Inter-|   Receive                    |  Transmit\n"
        " face |bytes    packets errs drop fifo frame compressed multicast|bytes packets\n"
        "    lo:     100       1    0    0    0     0          0         0      100 1\n"
        "  eth0:    5000      10    0    0    0     0          0         0     7000 12\n"
    )
    assert machines.interface_bytes(text, "eth0") == (5000, 7000)
    with pytest.raises(RuntimeError, match="no wlan0"):
        machines.interface_bytes(text, "wlan0")


def test_preflight_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="need root"):
        machines.preflight("failover")


@pytest.mark.skipif(
    os.geteuid() != 0 or any(shutil.which(t) is None for t in ("ip", "tc", "nsenter")),
    reason="simulated machines need root, iproute2 and util-linux",
)
def test_two_machines_have_their_own_name_memory_and_address() -> None:
    with machines.cluster(2, rate=10**9, shm_bytes=16 << 20) as cluster:
        a, b = cluster.machines
        assert a.run(["hostname"]).strip() == "node0"
        assert b.run(["hostname"]).strip() == "node1"
        a.run(["sh", "-c", "echo a > /dev/shm/mine"])
        assert a.run(["ls", "/dev/shm"]).split() == ["mine"]
        assert b.run(["ls", "/dev/shm"]).split() == []  # its own memory
        code = (
            "import socket; s = socket.create_connection(('node1', 5123)); "
            "s.sendall(b'x' * 100000); s.close()"
        )
        server = b.popen(
            [sys.executable, "-c", "import socket; s = socket.socket(); "
             "s.bind(('0.0.0.0', 5123)); s.listen(); c, _ = s.accept(); n = 0\n"
             "while (d := c.recv(65536)): n += len(d)\nprint(n)"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        a.run([sys.executable, "-c", f"import time\nfor _ in range(100):\n try:\n  {code}\n"
               "  break\n except ConnectionRefusedError: time.sleep(0.05)"])  # fmt: skip
        assert server.communicate(timeout=30)[0].strip() == "100000"
        sent = a.link_bytes()[1]
        assert sent >= 100000  # it crossed a's cable
        holder = a.holder_pid
        cluster.kill(a)
        assert not a.alive and a.processes() == []
        status = Path(f"/proc/{holder}/status")
        assert not status.exists() or "State:\tZ" in status.read_text()  # dead (or a zombie)
        names = [m.netns for m in cluster.machines] + [cluster.hub]
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    listed = done.stdout
    assert not any(name in listed for name in names)
