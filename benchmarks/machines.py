"""Simulated machines on this one: namespaces joined by rate-limited links.

A benchmark about more than one machine needs what tells machines apart: each
its own hostname, its own network (ranks on one machine talk over a fast local
path, ranks on two cross a link of a few Gbit/s), and its own ``/dev/shm``,
gone with the machine. :class:`Cluster` makes that out of Linux namespaces:

* a *hub* network namespace holding a bridge, the switch every machine is cabled
  to (and a place for what a cluster keeps outside its workers, such as a
  rendezvous store);
* per machine a network namespace cabled to the bridge by a veth pair (``eth0``
  inside, ``10.213.0.<10+i>``), and a holder process that unshares a UTS and a
  mount namespace, sets the hostname, mounts a fresh tmpfs on ``/dev/shm`` and a
  hosts file naming every machine on ``/etc/hosts``, then sleeps. Commands run
  inside with ``nsenter`` on the holder, so they see the machine's hostname,
  network and memory;
* a token-bucket filter (``tc ... tbf``) on both ends of every veth: each machine's
  NIC gets the rate in each direction, while ranks of one machine reach each
  other over their own addresses without crossing it.

:meth:`Cluster.kill` ends a machine as a real loss does: every process in it is
SIGKILLed (the holder too, so its tmpfs, and everything in ``/dev/shm``, is gone)
and its cable is unplugged. By default the processes die first, so peers see their
connections reset (a crashed node whose kernel is still up); ``silent=True``
unplugs the cable first, so peers see nothing and learn of the loss only by their
own timeouts (a power cut).

Everything made is removed on the way out of the ``with`` block, also on Ctrl-C or
SIGTERM: the processes of every machine, the namespaces, and with them the veths,
the bridge, the filters and the tmpfs. It needs root and util-linux's ``unshare``
and ``nsenter`` beside iproute2's ``ip`` and ``tc``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = [
    "Cluster",
    "Machine",
    "burst_bytes",
    "cluster",
    "interface_bytes",
    "preflight",
]

SUBNET = "10.213.0"
HUB_ADDRESS = f"{SUBNET}.1"
NIC = "eth0"  # the machine's end of its cable
PREFIX = "shk-"  # every namespace this module makes starts with it
LATENCY = "100ms"  # how long tbf may queue a packet before dropping it
MIN_BURST_BYTES = 64 * 1024
_TOOLS = ("ip", "tc", "unshare", "nsenter")


def preflight(what: str) -> None:
    """Stop with the fix where simulated machines cannot be made (``what``: the caller)."""
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        raise SystemExit(
            f"{what}: {', '.join(missing)} not found on PATH: install iproute2 and "
            "util-linux (apt-get install iproute2 util-linux)"
        )
    if os.geteuid() != 0:
        raise SystemExit(
            f"{what}: simulated machines (network, UTS and mount namespaces, tc filters) "
            f"need root (uid {os.geteuid()} here): run it with sudo -E"
        )


def burst_bytes(bits: int) -> int:
    """The token bucket's size at ``bits`` per second: a millisecond of traffic, at least
    :data:`MIN_BURST_BYTES` (a bucket smaller than a packet never passes it)."""
    return max(MIN_BURST_BYTES, bits // 8 // 1000)


def interface_bytes(proc_net_dev: str, interface: str) -> tuple[int, int]:
    """(received, transmitted) bytes of ``interface`` in the text of ``/proc/net/dev``."""
    for line in proc_net_dev.splitlines():
        name, sep, counters = line.partition(":")
        if sep and name.strip() == interface:
            values = counters.split()
            return int(values[0]), int(values[8])  # 8 receive fields, then transmit
    raise RuntimeError(f"no {interface} line in /proc/net/dev")


def _check(cmd: Sequence[str]) -> str:
    done = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"machines: `{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}"
        )
    return done.stdout


def _net_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:  # gone, or a kernel thread
        return None


def _pids_in_net(ns: str) -> list[int]:
    """Every process whose network namespace is ``ns`` (as ``readlink`` spells it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _net_ns(int(entry)) == ns:
            found.append(int(entry))
    return found


@dataclass
class Machine:
    """One simulated machine: a hostname, an address on the cluster's network, and a
    holder process whose namespaces every command of this machine enters."""

    index: int
    hostname: str
    netns: str  # the named network namespace (``ip netns``)
    address: str  # on the cluster's network, ``eth0`` inside
    holder: subprocess.Popen[str] | None = field(default=None, repr=False)
    holder_pid: int = 0  # the process inside the UTS and mount namespaces
    net_id: str = ""  # ``readlink /proc/PID/ns/net`` of the machine's processes
    alive: bool = True

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this machine (its network, hostname and ``/dev/shm``)."""
        if not self.alive:
            raise RuntimeError(f"machine {self.hostname} was killed: nothing runs on it")
        target = str(self.holder_pid)
        return ["nsenter", "--target", target, "--net", "--uts", "--mount", "--", *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside this machine, in a session of its own."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(self, argv: Sequence[str]) -> str:
        """Run ``argv`` inside this machine to its end; its output (raises if it failed)."""
        return _check(self.command(argv))

    def link_bytes(self) -> tuple[int, int]:
        """(received, transmitted) bytes on this machine's cable so far."""
        return interface_bytes(self.run(["cat", "/proc/net/dev"]), NIC)

    def processes(self) -> list[int]:
        """Every process running on this machine, its holder included."""
        return _pids_in_net(self.net_id) if self.net_id else []


class Cluster:
    """Machines joined by a switch; see the module docstring. Use :func:`cluster`."""

    name: str
    hub: str  # the hub's network namespace
    machines: list[Machine]
    rate_bits: int | None
    _workdir: Path

    def __init__(self, count: int, *, shm_bytes: int, rate_bits: int | None) -> None:
        if count < 1:
            raise ValueError(f"a cluster needs at least one machine, got {count}")
        self.name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:5]}"
        self.hub = f"{self.name}-hub"
        self.machines = [
            Machine(i, f"node{i}", f"{self.name}-m{i}", f"{SUBNET}.{10 + i}") for i in range(count)
        ]
        self.rate_bits = rate_bits
        self._shm_bytes = shm_bytes
        self._workdir = Path(tempfile.mkdtemp(prefix="machines-"))
        self._made: list[str] = []  # namespaces created, for the cleanup

    # ---- making it

    def _up(self) -> None:
        hosts = self._workdir / "hosts"
        hosts.write_text(
            "127.0.0.1 localhost\n"
            + "".join(f"{m.address} {m.hostname}\n" for m in self.machines)
            + f"{HUB_ADDRESS} hub\n"
        )
        _check(["ip", "netns", "add", self.hub])
        self._made.append(self.hub)
        hub = ["ip", "-n", self.hub]
        _check([*hub, "link", "set", "lo", "up"])
        _check([*hub, "link", "add", "br0", "type", "bridge"])
        _check([*hub, "addr", "add", f"{HUB_ADDRESS}/24", "dev", "br0"])
        _check([*hub, "link", "set", "br0", "up"])
        for m in self.machines:
            _check(["ip", "netns", "add", m.netns])
            self._made.append(m.netns)
            port = f"m{m.index}"
            _check([*hub, "link", "add", port, "type", "veth", "peer", "name", NIC,
                    "netns", m.netns])  # fmt: skip
            _check([*hub, "link", "set", port, "master", "br0"])
            _check([*hub, "link", "set", port, "up"])
            inside = ["ip", "-n", m.netns]
            _check([*inside, "link", "set", "lo", "up"])
            _check([*inside, "addr", "add", f"{m.address}/24", "dev", NIC])
            _check([*inside, "link", "set", NIC, "up"])
            self._start_holder(m, hosts)
        if self.rate_bits is not None:
            self.set_rate(self.rate_bits)

    def _start_holder(self, m: Machine, hosts: Path) -> None:
        script = (
            f"hostname {m.hostname} && "
            f"mount -t tmpfs -o size={self._shm_bytes} tmpfs /dev/shm && "
            f"mount --bind {hosts} /etc/hosts && "
            'echo "ready $$" && exec sleep infinity'
        )
        m.holder = subprocess.Popen(
            ["ip", "netns", "exec", m.netns,
             "unshare", "--uts", "--mount", "--propagation", "private", "--fork",
             "sh", "-c", script],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        assert m.holder.stdout is not None
        line = m.holder.stdout.readline().split()
        if len(line) != 2 or line[0] != "ready":
            err = m.holder.stderr.read() if m.holder.stderr else ""
            raise RuntimeError(f"machines: machine {m.hostname} did not start: {err.strip()}")
        m.holder_pid = int(line[1])
        m.net_id = _net_ns(m.holder_pid) or ""

    def set_rate(self, bits: int) -> None:
        """Every machine's cable at ``bits`` per second in each direction."""
        tbf = ["tbf", "rate", f"{bits}bit", "burst", f"{burst_bytes(bits)}b", "latency", LATENCY]
        for m in self.machines:
            if not m.alive:
                continue
            _check(["ip", "netns", "exec", m.netns, "tc", "qdisc", "replace", "dev", NIC,
                    "root", *tbf])  # fmt: skip
            _check(["ip", "netns", "exec", self.hub, "tc", "qdisc", "replace", "dev",
                    f"m{m.index}", "root", *tbf])  # fmt: skip
        self.rate_bits = bits

    # ---- using it

    def hub_command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in the hub's network (reaches every machine; has no ``/dev/shm``
        of a machine)."""
        return ["ip", "netns", "exec", self.hub, *argv]

    def unplug(self, machine: Machine) -> None:
        """Cut ``machine``'s cable: its packets go nowhere, nothing tells its peers."""
        _check(["ip", "-n", self.hub, "link", "set", f"m{machine.index}", "down"])

    def kill(self, machine: Machine, *, silent: bool = False) -> float:
        """End ``machine``: its processes, its memory, its cable (see the module
        docstring); returns ``time.monotonic()`` at the kill."""
        if silent:
            self.unplug(machine)
        at = time.monotonic()
        self._kill_processes(machine)
        if not silent:
            self.unplug(machine)
        machine.alive = False
        return at

    def _kill_processes(self, machine: Machine, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            pids = machine.processes()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"machines: processes {pids} of {machine.hostname} survive SIGKILL"
                )
            time.sleep(0.01)
        if machine.holder is not None:
            machine.holder.wait()

    def _down(self) -> None:
        problems = []
        for m in self.machines:
            try:
                self._kill_processes(m)
            except RuntimeError as e:
                problems.append(str(e))
        for ns in reversed(self._made):
            done = subprocess.run(
                ["ip", "netns", "delete", ns], capture_output=True, text=True, check=False
            )
            if done.returncode != 0:
                problems.append(
                    f"could not remove network namespace {ns}: {done.stderr.strip()}; "
                    f"remove it with `ip netns delete {ns}`"
                )
        shutil.rmtree(self._workdir, ignore_errors=True)
        for problem in problems:
            print(f"machines: {problem}", file=sys.stderr)


@contextlib.contextmanager
def cluster(count: int, *, rate: int | None = None, shm_bytes: int = 2 << 30) -> Iterator[Cluster]:
    """``count`` simulated machines, each NIC at ``rate`` bits per second (None: no
    filter), each with a ``/dev/shm`` of ``shm_bytes``; all removed on the way out.

    SIGTERM is turned into ``KeyboardInterrupt`` meanwhile (as Ctrl-C), so a killed
    run still reaches the cleanup.
    """

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_term)
    made = Cluster(count, shm_bytes=shm_bytes, rate_bits=rate)
    try:
        made._up()
        yield made
    finally:
        try:
            made._down()
        finally:
            signal.signal(signal.SIGTERM, previous)
