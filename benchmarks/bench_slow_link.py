"""Ours vs torch's FSDP1 and FSDP2 over a slow link: a rate-limited loopback in a network namespace.

On plain loopback a gather costs a memory copy, so the other benchmarks never
see the regime where the link decides the step time (machines joined by 1-100
Gbit/s Ethernet). Here the benchmark makes such a link: it creates a network
namespace of its own (``ip netns add``), brings its loopback up, puts a
token-bucket filter on that loopback (``tc qdisc ... tbf rate 1gbit``) and
starts the gloo ranks inside it (``ip netns exec NAME python ...``, ``file://``
rendezvous, ``127.0.0.1``), so every byte the ranks exchange crosses the
filter. It touches no interface but that namespace's ``lo`` (every ``tc`` and
``ip link`` command names the namespace) and removes the namespace when it
ends, also on Ctrl-C or SIGTERM. It needs root and iproute2 (``ip``, ``tc``).

For every size (~30M and ~60M parameters, ``bench_scale``'s GPT) and world
size (2 and 4 ranks), one launch holds seven variants and steps them in turns
at every link rate (1 and 10 Gbit/s) in turns: each round sets a rate (rank 0
runs ``tc`` on the namespace, the ranks lined up by barriers) and steps each
variant once, then the next rate; so load from elsewhere on the machine hits
every variant and rate alike. The warm-up steps run at the fastest rate. The
variants: ours ``FullyShardedDataParallel`` (FULL_SHARD, one unit per block
plus the root), ours ``fully_shard`` (each block, then the root), torch's
FSDP1 and FSDP2 built the same way, and a compute-only step (the same forward
and backward on the full model, AdamW on this rank's 1/N of the parameters,
no collective), and ours twice more with ``fsdp.QuantizedCommPolicy()``
(``, int8 comm``: weights gathered and gradients reduced as int8 blocks of
64 elements, one fp32 scale each; exact fp32 master parameters). AdamW,
fp32, gloo/CPU. Before the steps, rank 0 sends 16 MiB to rank 1 at each rate:
the rate the ranks actually get (in the notes).
Columns:

* step: median wall time of a training step, each step as long as its slowest
  rank; vs FSDP2: over torch's ``fully_shard`` at the same configuration;
* comm wait/rank: the wall time a rank spends blocked in ``Work.wait()`` (every
  collective of ``torch.distributed``, synchronous ones included, waits through
  it): the communication the computation did not hide; mean over the ranks,
  median over the steps;
* step - compute: the step minus the compute-only step of the same round: the
  whole cost of sharding (exposed communication and the wrapper's own work);
* sent/rank: bytes the namespace's ``lo`` transmitted during the step (read
  from ``/proc/net/dev`` inside the namespace, TCP/IP headers included, a
  barrier's bytes taken off) divided by the number of ranks;
* link time: all ranks' bytes over the link rate. The filter sits on the one
  loopback every rank shares, so the ranks share one link of that rate (N
  machines with a NIC each would each have their own): the link time is the
  least time the step's traffic needs, and ``step`` can approach it only when
  the computation hides behind the communication.

Flags (``python -m benchmarks slow-link --help`` lists them): ``--sizes``,
``--world-sizes``, ``--rates``, ``--steps``, ``--warmup``, ``--batch``.
``--quick`` runs a tiny model at 2 ranks over 1 Gbit/s, for a smoke test.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks.bench_scale import SIZES as SCALE_SIZES
from benchmarks.common import Options, Table, fmt_bytes, fmt_ms, launch, ratio

DESCRIPTION = "ours vs torch FSDP1 / FSDP2 over a 1 and 10 Gbit/s link (network namespace, root)"

SIZES = {label: SCALE_SIZES[label] for label in ("30M", "60M")}
QUICK_SIZES = {"tiny": {"vocab": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}}
WORLD_SIZES = (2, 4)
RATES = ("1gbit", "10gbit")
BATCH = 2  # sequences per rank: small, so that the link, not this CPU, dominates
WARMUP = 1
STEPS = 2
LR = 1e-3
LATENCY = "50ms"  # the longest a packet may queue in the filter (sets its queue length)
MIN_BURST_BYTES = 256 * 1024  # above lo's 64 KiB MTU: a bucket smaller than a packet stalls
LAUNCH_TIMEOUT_S = 1800.0
NETNS_PREFIX = "fsdp-slow-link-"
LINK_CHECK_BYTES = 16 * 2**20

TORCH_FSDP2 = "torch fully_shard (FSDP2)"
TORCH_FSDP1 = "torch FSDP1"
OURS_FSDP1 = "ours FullyShardedDataParallel"
OURS_FSDP2 = "ours fully_shard"
OURS_FSDP1_INT8 = "ours FullyShardedDataParallel, int8 comm"
OURS_FSDP2_INT8 = "ours fully_shard, int8 comm"
COMPUTE = "compute only"
VARIANTS = (
    TORCH_FSDP2, TORCH_FSDP1, OURS_FSDP1, OURS_FSDP2, OURS_FSDP1_INT8, OURS_FSDP2_INT8, COMPUTE
)  # fmt: skip
QUANTIZED = (OURS_FSDP1_INT8, OURS_FSDP2_INT8)

# ------------------------------------------------------------ flags and rates

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)bit$")
_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9}


def parse_rate(text: str) -> int:
    """A link rate as tc spells it (``1gbit``, ``500mbit``, ``2.5gbit``) in bits per second."""
    match = _RATE.match(text.strip().lower())
    if match is None:
        raise ValueError(
            f"link rate {text!r}: write a number and kbit, mbit or gbit (1gbit, 500mbit)"
        )
    bits = round(float(match.group(1)) * _UNITS[match.group(2)])
    if bits < 10**5:
        raise ValueError(f"link rate {text!r} is below 100kbit: a step would take hours")
    return bits


def fmt_rate(bits: int) -> str:
    """Bits per second as ``1 Gbit/s`` or ``500 Mbit/s``."""
    if bits >= 10**9:
        return f"{bits / 10**9:g} Gbit/s"
    return f"{bits / 10**6:g} Mbit/s"


def burst_bytes(bits: int) -> int:
    """The token bucket's size for ``bits`` per second: a millisecond of traffic, at least
    :data:`MIN_BURST_BYTES` (the filter cannot pass a packet larger than its bucket, and a
    tiny bucket caps the rate below the one asked for on a busy machine's timers)."""
    return max(MIN_BURST_BYTES, bits // 8 // 1000)


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError("give at least one value")
        return values

    return parse


def _size(label: str) -> str:
    if label not in SIZES:
        raise argparse.ArgumentTypeError(f"unknown size {label!r}; choose from {list(SIZES)}")
    return label


def _world(text: str) -> int:
    world = int(text)
    if world < 2:
        raise argparse.ArgumentTypeError(f"world size {world}: a link needs at least 2 ranks")
    return world


def _rate(text: str) -> str:
    try:
        parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip().lower()


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 0")
    return value


def add_arguments(group: argparse._ArgumentGroup) -> list[argparse.Action]:
    """This benchmark's flags (``python -m benchmarks`` adds them with no defaults: an
    absent flag is absent from ``Options.flags``, and :class:`Plan` fills it in)."""
    return [
        group.add_argument(
            "--sizes",
            type=_csv(_size),
            help=f"model sizes, comma-separated (default: {','.join(SIZES)})",
        ),
        group.add_argument(
            "--world-sizes",
            type=_csv(_world),
            help=f"ranks per launch (default: {','.join(map(str, WORLD_SIZES))})",
        ),
        group.add_argument(
            "--rates",
            type=_csv(_rate),
            help=f"link rates as tc spells them (default: {','.join(RATES)})",
        ),
        group.add_argument(
            "--steps", type=_positive, help=f"timed steps per variant (default: {STEPS})"
        ),
        group.add_argument(
            "--warmup", type=_non_negative, help=f"untimed steps first (default: {WARMUP})"
        ),
        group.add_argument(
            "--batch", type=_positive, help=f"sequences per rank per step (default: {BATCH})"
        ),
    ]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What one run measures: every size x world size (a launch each) x rate."""

    sizes: dict[str, dict[str, int]]
    world_sizes: list[int]
    rates: list[str]
    steps: int
    warmup: int
    batch: int

    @classmethod
    def from_options(cls, options: Options) -> Plan:
        """The flags given, the defaults (or ``--quick``'s) for the others."""
        flags = dict(options.flags)
        if options.quick:
            sizes: dict[str, dict[str, int]] = dict(QUICK_SIZES)
            defaults: dict[str, Any] = {"world_sizes": [2], "rates": ["1gbit"], "steps": 1}
        else:
            sizes = {label: SIZES[label] for label in flags.get("sizes", list(SIZES))}
            defaults = {"world_sizes": list(WORLD_SIZES), "rates": list(RATES), "steps": STEPS}
        return cls(
            sizes=sizes,
            world_sizes=flags.get("world_sizes", defaults["world_sizes"]),
            rates=flags.get("rates", defaults["rates"]),
            steps=flags.get("steps", defaults["steps"]) * options.repeats,
            warmup=flags.get("warmup", WARMUP),
            batch=flags.get("batch", BATCH),
        )

    def configurations(self) -> Iterator[tuple[str, int]]:
        """(size label, world size) in the order they launch; each launch takes every rate
        in turns (see :func:`_timing_rank`)."""
        for label in self.sizes:
            for world in self.world_sizes:
                yield label, world


# ------------------------------------------------------------- the namespace


def preflight(options: Options) -> None:
    """Stop before anything runs, with the fix, where the slow link cannot be made."""
    del options
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(
            f"slow_link: {' and '.join(missing)} not found on PATH: install iproute2 "
            "(apt-get install iproute2), or leave slow-link out of the benchmarks run"
        )
    if os.geteuid() != 0:
        raise SystemExit(
            "slow_link: creating a network namespace and a tc filter needs root (uid "
            f"{os.geteuid()} here): run `sudo -E python -m benchmarks slow-link`, or leave "
            "slow-link out of the benchmarks run"
        )


def namespace_name() -> str:
    """A fresh name with this benchmark's prefix, the process id and a random part."""
    return f"{NETNS_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}"


def setup_commands(netns: str) -> list[list[str]]:
    """Create the namespace and bring its loopback up (its only interface)."""
    return [
        ["ip", "netns", "add", netns],
        ["ip", "netns", "exec", netns, "ip", "link", "set", "lo", "up"],
    ]


def rate_command(netns: str, bits: int) -> list[str]:
    """Set (or replace) the token-bucket filter on the namespace's loopback."""
    return [
        "ip", "netns", "exec", netns,
        "tc", "qdisc", "replace", "dev", "lo", "root", "tbf",
        "rate", f"{bits}bit", "burst", f"{burst_bytes(bits)}b", "latency", LATENCY,
    ]  # fmt: skip


def teardown_command(netns: str) -> list[str]:
    """Remove the namespace (its loopback and filter go with it)."""
    return ["ip", "netns", "delete", netns]


def inside_command(netns: str, spec_path: Path) -> list[str]:
    """Run :func:`_inside` on ``spec_path`` in a fresh interpreter inside the namespace."""
    code = "import sys; from benchmarks.bench_slow_link import _inside; _inside(sys.argv[1])"
    return ["ip", "netns", "exec", netns, sys.executable, "-c", code, str(spec_path)]


def _check(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"slow_link: `{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}"
        )


@contextmanager
def slow_link_namespace() -> Iterator[str]:
    """A network namespace with its loopback up, removed on the way out whatever happens.

    SIGTERM is turned into ``KeyboardInterrupt`` meanwhile (as Ctrl-C), so a killed
    run still reaches the ``finally`` that removes the namespace.
    """
    netns = namespace_name()

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_term)
    created = False
    try:
        add, up = setup_commands(netns)
        _check(add)
        created = True
        _check(up)
        yield netns
    finally:
        try:
            if created:
                done = subprocess.run(
                    teardown_command(netns), capture_output=True, text=True, check=False
                )
                if done.returncode != 0:
                    print(
                        f"slow_link: could not remove network namespace {netns}: "
                        f"{done.stderr.strip()}; remove it with `ip netns delete {netns}`",
                        file=sys.stderr,
                    )
        finally:
            signal.signal(signal.SIGTERM, previous)


def _run_inside(netns: str, spec: dict[str, Any], timeout: float) -> Any:
    """One launch of the ranks inside ``netns``; their results.

    The interpreter runs in a session of its own, so that on any way out (error,
    timeout, Ctrl-C here) the whole group, ranks included, is killed, not left in
    the namespace.
    """
    with tempfile.TemporaryDirectory(prefix="slow-link-") as folder:
        spec_path = Path(folder) / "spec.pkl"
        spec_path.write_bytes(pickle.dumps(spec))
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(inside_command(netns, spec_path), env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out = spec_path.with_suffix(".out")
        if code != 0 or not out.exists():
            raise RuntimeError(f"slow_link: the launch inside {netns} exited with {code}")
        return pickle.loads(out.read_bytes())


def _inside(spec_path: str) -> None:
    """Inside the namespace: launch the ranks, write their results beside the spec."""
    spec = pickle.loads(Path(spec_path).read_bytes())
    if os.readlink("/proc/self/ns/net") == spec["launcher_netns"]:
        raise SystemExit(
            "slow_link: _inside runs only inside the benchmark's network namespace, "
            "not the launcher's (it would measure the host's loopback)"
        )
    ranks = launch(_timing_rank, spec["world"], spec["job"], timeout=spec["timeout"])
    Path(spec_path).with_suffix(".out").write_bytes(pickle.dumps(ranks))


# ------------------------------------------------------------------ the ranks


def lo_tx_bytes(proc_net_dev: str) -> int:
    """Bytes transmitted by ``lo``, from the text of ``/proc/net/dev``."""
    for line in proc_net_dev.splitlines():
        name, sep, counters = line.partition(":")
        if sep and name.strip() == "lo":
            return int(counters.split()[8])  # 8 receive fields, then transmit bytes
    raise RuntimeError("no lo line in /proc/net/dev")


def _tx() -> int:
    with open("/proc/net/dev") as f:
        return lo_tx_bytes(f.read())


class _WaitClock:
    """Wall time spent in ``torch.distributed.Work.wait`` since the last :meth:`take`.

    Every collective waits through ``Work.wait``: an asynchronous one when its
    caller waits, a synchronous one inside ``torch.distributed`` before it
    returns; so the total is the time the rank was blocked on communication.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        self.total = 0.0
        original = dist.Work.wait

        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(work, *args, **kwargs)
            finally:
                self.total += time.perf_counter() - start

        dist.Work.wait = wait  # type: ignore[method-assign,assignment]

    def take(self) -> float:
        """The time since the last call, and start again from zero."""
        total, self.total = self.total, 0.0
        return total


class _Trainer:
    """One variant on this rank: GPT, its wrapper, AdamW, its own data stream."""

    def __init__(self, variant: str, model_kwargs: dict[str, int], batch: int) -> None:
        import torch
        import torch.distributed as dist

        from benchmarks.gpt import GPT, Block

        torch.manual_seed(0)
        self.model = GPT(**model_kwargs)
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.batch = batch
        self.step_index = 0
        self.wrapped: Any = self.model
        if variant == COMPUTE:
            params = list(self.model.parameters())
            self.opt = torch.optim.AdamW(params[dist.get_rank() :: dist.get_world_size()], lr=LR)
            return
        import fsdp

        comm: dict[str, Any] = {}
        if variant in QUANTIZED:
            comm["comm_policy"] = fsdp.QuantizedCommPolicy(weights="int8", gradients="int8")
        if variant in (OURS_FSDP2, OURS_FSDP2_INT8):
            for block in self.model.blocks:
                fsdp.fully_shard(block, **comm)
            fsdp.fully_shard(self.model, **comm)
        elif variant == TORCH_FSDP2:
            import torch.distributed.fsdp as torch_fsdp

            for block in self.model.blocks:
                torch_fsdp.fully_shard(block)
            torch_fsdp.fully_shard(self.model)
        elif variant in (OURS_FSDP1, OURS_FSDP1_INT8):
            import fsdp.wrap

            self.wrapped = fsdp.FullyShardedDataParallel(
                self.model,
                auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({Block}),
                device_id=torch.device("cpu"),
                **comm,
            )
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy

            self.wrapped = FullyShardedDataParallel(
                self.model,
                auto_wrap_policy=ModuleWrapPolicy({Block}),
                device_id=torch.device("cpu"),
            )
        self.opt = torch.optim.AdamW(self.wrapped.parameters(), lr=LR)

    def step(self) -> None:
        """One training step on this variant's next batch (the same batches for all)."""
        import torch.distributed as dist

        from benchmarks.gpt import lm_loss, random_tokens

        seed = 1000 * self.step_index + dist.get_rank()
        self.step_index += 1
        tokens = random_tokens(self.model.config, self.batch, seed=seed)
        self.opt.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)  # the compute-only optimizer holds 1/N
        lm_loss(self.wrapped, tokens).backward()
        self.opt.step()


def _link_check() -> dict[str, float]:
    """Rank 0 sends :data:`LINK_CHECK_BYTES` to rank 1 twice: the faster time and the
    bytes ``lo`` carried for it (the link as the ranks see it)."""
    import torch
    import torch.distributed as dist

    buffer = torch.zeros(LINK_CHECK_BYTES // 4)
    best = float("inf")
    carried = 0
    for _ in range(2):
        dist.barrier()
        before = _tx()
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(buffer, 1)
        elif dist.get_rank() == 1:
            dist.recv(buffer, 0)
        dist.barrier()
        best = min(best, time.perf_counter() - start)
        carried = _tx() - before
    return {"seconds": best, "bytes": carried}


@dataclass(frozen=True, kw_only=True)
class Job:
    """One launch: what every rank of it runs (pickled into the ranks)."""

    model: dict[str, int]
    batch: int
    warmup: int
    steps: int
    netns: str
    rates: list[int]  # bits per second, in the order of the first round


def _timing_rank(job: Job) -> dict[str, Any]:
    """Every variant on this rank, stepped in turns at every rate in turns; per step:
    time, wait, lo's bytes. Rank 0 sets the rate between rounds, the ranks lined up."""
    import torch.distributed as dist

    model, batch, warmup, steps, netns, rates = (
        job.model, job.batch, job.warmup, job.steps, job.netns, job.rates
    )  # fmt: skip

    def set_rate(bits: int) -> None:
        dist.barrier()
        if dist.get_rank() == 0:
            _check(rate_command(netns, bits))  # names the namespace, as the launcher's
        dist.barrier()

    clock = _WaitClock()
    links = {}
    for bits in rates:
        set_rate(bits)
        links[bits] = _link_check()
    dist.barrier()
    before = _tx()
    dist.barrier()
    barrier_bytes = _tx() - before  # what the barrier closing each step adds
    trainers = {v: _Trainer(v, model, batch) for v in VARIANTS}
    set_rate(max(rates))  # warm up at the fastest: the untimed steps cost least there
    for trainer in trainers.values():
        for _ in range(warmup):
            trainer.step()
    record: dict[int, dict[str, dict[str, list[float]]]] = {
        bits: {v: {"times": [], "waits": [], "bytes": []} for v in VARIANTS} for bits in rates
    }
    names = list(VARIANTS)
    for i in range(steps):
        for bits in rates[i % len(rates) :] + rates[: i % len(rates)]:
            set_rate(bits)
            shift = i % len(names)
            for v in names[shift:] + names[:shift]:
                dist.barrier()
                before = _tx()
                clock.take()
                start = time.perf_counter()
                trainers[v].step()
                record[bits][v]["times"].append(time.perf_counter() - start)
                record[bits][v]["waits"].append(clock.take())
                dist.barrier()  # every rank's sends of this step are on the wire
                record[bits][v]["bytes"].append(_tx() - before - barrier_bytes)
    return {
        "rates": {bits: {"variants": record[bits], "link": links[bits]} for bits in rates},
        "param_bytes": trainers[COMPUTE].param_bytes,
    }


# ------------------------------------------------------------------ reporting


@dataclass(frozen=True)
class Row:
    """One variant's numbers at one configuration (seconds, bytes)."""

    step_s: float
    wait_s: float
    over_compute_s: float
    sent_per_rank: float
    link_s: float


def summarize(ranks: Sequence[dict[str, Any]], bits: int) -> dict[str, Row]:
    """Each variant's :class:`Row` from every rank's :func:`_timing_rank` result.

    A step lasts as long as its slowest rank; waits are averaged over the ranks;
    lo's bytes are the whole namespace's (every rank reads the same counter),
    split evenly for the per-rank figure.
    """
    world = len(ranks)
    per_step = {
        v: [max(ts) for ts in zip(*(r["variants"][v]["times"] for r in ranks), strict=True)]
        for v in VARIANTS
    }
    rows = {}
    for v in VARIANTS:
        waits = [
            statistics.fmean(ws)
            for ws in zip(*(r["variants"][v]["waits"] for r in ranks), strict=True)
        ]
        total = statistics.median(ranks[0]["variants"][v]["bytes"])
        rows[v] = Row(
            step_s=statistics.median(per_step[v]),
            wait_s=statistics.median(waits),
            over_compute_s=statistics.median(
                a - b for a, b in zip(per_step[v], per_step[COMPUTE], strict=True)
            ),
            sent_per_rank=total / world,
            link_s=total * 8 / bits,
        )
    return rows


def achieved_bits(ranks: Sequence[dict[str, Any]]) -> float:
    """The link check's rate in bits per second: lo's bytes over the send's time."""
    link = ranks[0]["link"]
    return float(link["bytes"] * 8 / link["seconds"])


COLUMNS = [
    "params",
    "N",
    "link",
    "variant",
    "step",
    "vs FSDP2",
    "comm wait/rank",
    "step - compute",
    "sent/rank",
    "link time",
]


def table_rows(
    label: str, world: int, bits: int, psi: int, rows: dict[str, Row]
) -> list[list[str]]:
    """The table's cells for one configuration, one list per variant."""
    base = rows[TORCH_FSDP2].step_s
    out = []
    for v in VARIANTS:
        row = rows[v]
        comm = v != COMPUTE
        out.append(
            [
                f"{psi / 4 / 1e6:.1f}M ({label})",
                str(world),
                fmt_rate(bits),
                v,
                fmt_ms(row.step_s),
                ratio(row.step_s, base) if comm else "-",
                fmt_ms(row.wait_s) if comm else "-",
                fmt_ms(row.over_compute_s) if comm else "-",
                fmt_bytes(row.sent_per_rank) if comm else "-",
                fmt_ms(row.link_s) if comm else "-",
            ]
        )
    return out


def quantized_note(label: str, world: int, bits: int, rows: dict[str, Row]) -> str:
    """The int8 variants against ours unquantized at one configuration: step and bytes."""
    pairs = ((OURS_FSDP1_INT8, OURS_FSDP1, "FSDP1"), (OURS_FSDP2_INT8, OURS_FSDP2, "fully_shard"))
    parts = [
        f"{name} step {rows[q].step_s / rows[exact].step_s:.2f}x, "
        f"bytes {rows[q].sent_per_rank / rows[exact].sent_per_rank:.2f}x"
        for q, exact, name in pairs
    ]
    return f"int8 comm vs exact, {label} N={world} {fmt_rate(bits)}: " + "; ".join(parts)


def run(options: Options) -> list[Table]:
    """Create the namespace, run every configuration in it, remove it; one table."""
    plan = Plan.from_options(options)
    rates = [parse_rate(rate) for rate in plan.rates]
    table = Table(
        f"over a rate-limited loopback in a network namespace: GPT, batch {plan.batch} per rank, "
        f"gloo/CPU, AdamW fp32: median of {plan.steps} steps after {plan.warmup} warm-up",
        COLUMNS,
    )
    checks: dict[int, list[float]] = {bits: [] for bits in rates}
    quantized: list[str] = []
    with slow_link_namespace() as netns:
        print(f"(network namespace {netns}; removed at the end)", flush=True)
        for label, world in plan.configurations():
            spec = {
                "world": world,
                "job": Job(
                    model=plan.sizes[label],
                    batch=plan.batch,
                    warmup=plan.warmup,
                    steps=plan.steps,
                    netns=netns,
                    rates=rates,
                ),
                "timeout": LAUNCH_TIMEOUT_S,
                "launcher_netns": os.readlink("/proc/self/ns/net"),
            }
            ranks = _run_inside(netns, spec, timeout=LAUNCH_TIMEOUT_S + 60)
            psi = ranks[0]["param_bytes"]
            cells = []
            for bits in rates:
                at_rate = [r["rates"][bits] for r in ranks]
                checks[bits].append(achieved_bits(at_rate))
                rows = summarize(at_rate, bits)
                cells += table_rows(label, world, bits, psi, rows)
                quantized.append(quantized_note(label, world, bits, rows))
            for row in cells:
                table.add(*row)
            print("\n".join(table.render().splitlines()[-len(cells) :]), flush=True)
    table.notes += [
        "link check, a 16 MiB send from rank 0 to rank 1 (the faster of two): "
        + "; ".join(
            f"{fmt_rate(bits)}: {statistics.median(v) / 1e9:.2f} Gbit/s achieved"
            for bits, v in checks.items()
        ),
        "comm wait/rank: time blocked in Work.wait (mean over ranks); step - compute: over the "
        "compute-only step of the same round (no collective, AdamW on 1/N)",
        "sent/rank: lo's transmitted bytes in the namespace / N; link time: all ranks' bytes / "
        "rate (one shared link)",
        "rates in turns: each round steps every variant at one rate, then at the next",
        *quantized,
    ]
    return [table]
