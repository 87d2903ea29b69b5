"""A lost worker or machine: steps lost and seconds back, with memory snapshots or disk alone.

The job is the project's main one, ``examples/train.py`` (a 2-layer byte-level GPT,
our FSDP), launched as a user launches it across machines: one ``torchrun`` agent per
machine, meeting at a c10d rendezvous on the first machine, ``--nnodes 1:N`` so the
job re-forms with the machines left, ``--max-restarts 3``. The machines are simulated
(``benchmarks/machines.py``): each its own hostname, network and ``/dev/shm``, cabled to
a switch at ``--rate``; killing one kills its processes and empties its memory, as a
real loss does (its peers see their connections reset, as from a crashed node).

Cases, each run twice: ``disk`` (a checkpoint every 25 steps, as the issue's
measurement) and ``memory`` (``--snapshot-every 1`` beside it):

* ``worker``: one machine, 2 ranks (``--standalone``); rank 1 is SIGKILLed;
* ``machine 2x1`` / ``machine 2x2``: two machines of 1 or 2 ranks; the second machine
  is killed, and the job re-forms on the first;
* ``mid-snapshot 2x1``: as ``machine 2x1`` with a larger model (11M parameters) and the
  link at a tenth of ``--rate``, so a snapshot's replica takes longer than a step, and
  the kill lands in one.

The kill comes once rank 0 has printed step ``--kill-at``. Columns: the step reached (the
last step printed before the kill), the step resumed from and where from, the steps lost
between them, and the seconds from the kill until the job is back at the step reached:
until it says it resumed there, or (resumed from an earlier step) until rank 0 prints
the step reached again. ``FAILOVER_LOG=1`` prints rank 0's agent's output, timed from
the kill.

Then the cost of snapshots on the step (``--overhead``): GPT at 30M parameters
(``bench_scale``'s) under our ``fully_shard``, AdamW, 2 ranks: on two machines of one
rank each (each snapshot replicated across the link), and on one machine of two (no
replica: the cost of the copy alone); in one set of processes, blocks of 10 steps of
each variant in turns: nothing, a snapshot every step, every 10 steps, and a disk
checkpoint (``ckpt.CheckpointManager.save``) every step and every 10 steps. The saves
come before a block's steps (every step's, or the first's), so that each replica has the
steps after it to overlap with, as in a training loop. A block lasts as long as its
slowest rank and ends once the last snapshot's replica is in; per step, median over the
rounds. Also: what a rank's ``save`` blocks training for, and a
snapshot's bytes per rank.

Needs root (namespaces, tc); removes everything it makes.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import machines
from benchmarks.bench_scale import SIZES as SCALE_SIZES
from benchmarks.bench_slow_link import fmt_rate, parse_rate
from benchmarks.common import Options, Table, fmt_bytes, fmt_ms, ratio

DESCRIPTION = "a lost worker or machine: in-memory snapshots vs disk checkpoints (root)"

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"
PORT = 29400
STEP_LINE = re.compile(r"step\s+(\d+)/\d+ \|")
RESUMED = re.compile(
    r"resumed step (\d+) from (memory|disk)|resumed from .* at step (\d+)"
    r"|before the first checkpoint: from step (0)"
)
# Fast re-forming (see examples/README.md): a round closes a second after the minimum
# number of agents joined, and an agent that stopped sending keep-alives is dropped
# after 2 s.
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=120"


@dataclass(frozen=True)
class Case:
    name: str
    machines: int
    per_machine: int
    kill: str  # "worker" or "machine"
    rate_divisor: int = 1  # the link at rate / this
    model: tuple[str, ...] = ()  # train.py's model options, beside its defaults


# A model whose snapshot (about 60 MiB per rank) takes half a second to replicate at
# 1 Gbit/s, longer than its step: the kill after a step always lands in its replication.
_MID_SNAPSHOT_MODEL = ("--d-model", "384", "--n-layer", "6", "--n-head", "6")
CASES = {
    "worker": Case("worker", 1, 2, "worker"),
    "machine-2x1": Case("machine 2x1", 2, 1, "machine"),
    "machine-2x2": Case("machine 2x2", 2, 2, "machine"),
    "mid-snapshot-2x1": Case(
        "mid-snapshot 2x1", 2, 1, "machine", rate_divisor=10, model=_MID_SNAPSHOT_MODEL
    ),
}
TIERS = {
    "disk": ["--checkpoint-every", "25"],
    "memory": ["--checkpoint-every", "25", "--snapshot-every", "1"],
}
OVERHEAD_VARIANTS = ("none", "memory every 1", "memory every 10", "disk every 1", "disk every 10")


def add_arguments(group: argparse._ArgumentGroup) -> list[argparse.Action]:
    return [
        group.add_argument(
            "--cases",
            type=lambda s: [c.strip() for c in s.split(",") if c.strip()],
            help=f"failover cases (default: {','.join(CASES)}; 'none' skips them)",
        ),
        group.add_argument("--kill-at", type=int, help="kill after this step (default 40)"),
        group.add_argument(
            "--rate", type=parse_rate, help="the machines' link rate (default 10gbit)"
        ),
        group.add_argument(
            "--overhead",
            type=lambda s: s.strip(),
            help="model size of the overhead table: 30M, 60M or none (default 30M)",
        ),
        group.add_argument("--rounds", type=int, help="overhead rounds (default 5)"),
    ]


def preflight(options: Options) -> None:
    del options
    machines.preflight("failover")


# ------------------------------------------------------------------ failover cases


@dataclass
class _Output:
    """An agent's output lines as they come, with the time each arrived."""

    proc: subprocess.Popen[str]
    lines: list[tuple[float, str]] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def start(self) -> None:
        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                with self.cond:
                    self.lines.append((time.monotonic(), line.rstrip("\n")))
                    self.cond.notify_all()
            with self.cond:
                self.cond.notify_all()

        threading.Thread(target=read, daemon=True).start()

    def wait_for(self, pattern: re.Pattern[str], test: Any, after: float, timeout: float) -> Any:
        """The first match (time, match) after ``after`` for which ``test(match)``."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self.cond:
            while True:
                for at, line in self.lines[seen:]:
                    m = pattern.search(line)
                    if m is not None and at >= after and test(m):
                        return at, m
                seen = len(self.lines)
                if self.proc.poll() is not None and seen == len(self.lines):
                    raise RuntimeError("failover: the agent exited:\n" + self.tail())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"failover: no {pattern.pattern!r} in time:\n" + self.tail())
                self.cond.wait(min(left, 1.0))

    def tail(self, n: int = 40) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["GLOO_SOCKET_IFNAME"] = machines.NIC
    return env


def _agent_command(case: Case, node: int, address: str, train_args: list[str]) -> list[str]:
    run = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "3"]
    if case.machines == 1:
        run += ["--standalone", "--nproc-per-node", str(case.per_machine)]
    else:
        run += [
            "--nnodes", f"1:{case.machines}", "--nproc-per-node", str(case.per_machine),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"node0:{PORT}",
            "--rdzv-id", "failover", "--local-addr", address,
            "--rdzv-conf", f"is_host={int(node == 0)},{RDZV_CONF}",
        ]  # fmt: skip
    return [*run, str(TRAIN), *train_args]


@dataclass(frozen=True)
class Outcome:
    reached: int
    resumed: int
    source: str
    seconds: float
    line: str


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found.extend(int(t) for t in text)
    return found


def run_case(case: Case, tier: str, kill_at: int, bits: int, workdir: Path) -> Outcome:
    """One failover run (see the module docstring)."""
    out_dir = workdir / f"{case.name.replace(' ', '-')}-{tier}"
    train_args = [
        "--out-dir", str(out_dir), "--steps", str(kill_at + 40), "--log-every", "1",
        "--no-progress", "--eval-windows", "0", "--sample-lines", "0", *TIERS[tier],
        *case.model,
    ]  # fmt: skip
    rate = max(bits // case.rate_divisor, 10**6)
    with machines.cluster(case.machines, rate=rate, shm_bytes=1 << 30) as cluster:
        agents = []
        for node, machine in enumerate(cluster.machines):
            cmd = _agent_command(case, node, machine.address, train_args)
            proc = machine.popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env=_env(), cwd=str(ROOT),
            )  # fmt: skip
            agents.append(_Output(proc))
            agents[-1].start()
        lead = agents[0]
        lead.wait_for(STEP_LINE, lambda m: int(m[1]) >= kill_at, 0.0, 600)
        if case.kill == "worker":
            workers = sorted(_children(lead.proc.pid))
            at = time.monotonic()
            os.kill(workers[-1], 9)
        else:
            at = cluster.kill(cluster.machines[-1])
        with lead.cond:
            reached = max(int(m[1]) for t, line in lead.lines if t <= at
                          for m in [STEP_LINE.search(line)] if m is not None)  # fmt: skip
        said_at, said = lead.wait_for(RESUMED, lambda m: True, at, 600)
        resumed = int(said[1] or said[3] or said[4])
        source = said[2] or "disk"
        back = said_at  # resumed at the step reached: back as soon as it says so
        if resumed < reached:  # then once it has trained up to it again
            back, _ = lead.wait_for(STEP_LINE, lambda m: int(m[1]) >= reached, at, 600)
        if os.environ.get("FAILOVER_LOG"):
            with lead.cond:
                print("\n".join(f"{t - at:8.2f} {line}" for t, line in lead.lines), flush=True)
    return Outcome(reached, resumed, source, back - at, said[0])


# ------------------------------------------------------------------ the overhead


def _overhead_main() -> None:
    """One rank of the overhead measurement, inside a simulated machine."""
    spec = pickle.loads(Path(sys.argv[1]).read_bytes())
    out = Path(sys.argv[1]).with_suffix(f".rank{os.environ['RANK']}")
    out.write_bytes(pickle.dumps(_overhead_rank(spec)))


def _overhead_rank(spec: dict[str, Any]) -> dict[str, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import ckpt
    import fsdp
    from benchmarks.gpt import GPT, lm_loss, random_tokens

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(**spec["model"])
    for block in model.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": opt}
    disk = ckpt.CheckpointManager(spec["disk"], keep_last=2)
    memory = ckpt.MemorySnapshots(disk)
    step_index = [0]

    def train_step() -> None:
        tokens = random_tokens(model.config, spec["batch"], seed=1000 * step_index[0] + rank)
        step_index[0] += 1
        opt.zero_grad(set_to_none=True)
        lm_loss(model, tokens).backward()
        opt.step()

    blocked: dict[str, list[float]] = {v: [] for v in OVERHEAD_VARIANTS}

    def block(variant: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        kind, _, every = variant.partition(" every ")
        for i in range(10):
            # The save comes before the step: the snapshot of the state the last step left
            # (the same bytes as one taken after it), so that every snapshot's replica has
            # the steps after it to overlap with, as in a training loop, instead of the
            # last one of the block waiting alone in ``memory.wait()`` below.
            if kind != "none" and (every == "1" or i == 0):
                t = time.perf_counter()
                if kind == "memory":
                    memory.save(step_index[0], state)
                else:
                    disk.save(step_index[0], state)
                blocked[variant].append(time.perf_counter() - t)
            train_step()
        memory.wait()  # a replica slower than the step after it shows here
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took) / 10

    for _ in range(2):
        train_step()
    memory.save(step_index[0], state)
    disk.save(step_index[0], state)
    memory.wait()
    times: dict[str, list[float]] = {v: [] for v in OVERHEAD_VARIANTS}
    for r in range(spec["rounds"]):
        order = OVERHEAD_VARIANTS[r % 5 :] + OVERHEAD_VARIANTS[: r % 5]
        for variant in order:
            times[variant].append(block(variant))
    mine = [c for c in memory.folder.copies() if c.header.rank == rank and not c.replica]
    size = max(c.header.data_bytes for c in mine)
    memory.close()
    dist.destroy_process_group()
    return {"times": times, "blocked": blocked, "snapshot_bytes": size}


def run_overhead(
    label: str, bits: int, rounds: int, workdir: Path, layout: tuple[int, int]
) -> list[dict[str, Any]]:
    """The overhead ranks on ``layout`` = (machines, ranks per machine); their results."""
    count, per_machine = layout
    world = count * per_machine
    spec = {
        "model": SCALE_SIZES.get(label, _QUICK_MODEL),
        "batch": 4,
        "rounds": rounds,
        "disk": str(workdir / f"overhead-disk-{count}x{per_machine}"),
    }
    spec_path = workdir / f"overhead-{count}x{per_machine}.spec"
    spec_path.write_bytes(pickle.dumps(spec))
    code = "from benchmarks.bench_failover import _overhead_main; _overhead_main()"
    with machines.cluster(count, rate=bits, shm_bytes=4 << 30) as cluster:
        procs = []
        for rank in range(world):
            machine = cluster.machines[rank // per_machine]
            env = _env()
            env.update(
                RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_machine),
                MASTER_ADDR=cluster.machines[0].address, MASTER_PORT=str(PORT),
            )  # fmt: skip
            procs.append(
                machine.popen([sys.executable, "-c", code, str(spec_path)], env=env, cwd=ROOT)
            )
        codes = [p.wait(timeout=3600) for p in procs]
    if any(codes):
        raise RuntimeError(f"failover: the overhead ranks exited with {codes}")
    return [pickle.loads(spec_path.with_suffix(f".rank{r}").read_bytes()) for r in range(world)]


_QUICK_MODEL = {"vocab": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}


# ------------------------------------------------------------------ tables


def _failover_table(outcomes: dict[tuple[str, str], Outcome], kill_at: int, bits: int) -> Table:
    rows = []
    for (case, tier), o in outcomes.items():
        rows.append([
            case, tier, str(o.reached), f"{o.resumed} ({o.source})", str(o.reached - o.resumed),
            f"{o.seconds:.1f} s",
        ])  # fmt: skip
    return Table(
        title=f"failover: examples/train.py, kill after step {kill_at}, link {fmt_rate(bits)}",
        columns=["case", "tier", "reached", "resumed from", "steps lost", "kill -> back"],
        rows=rows,
    )


def _overhead_table(
    label: str, bits: int, ranks: list[dict[str, Any]], layout: tuple[int, int]
) -> Table:
    times = ranks[0]["times"]  # already the slowest rank's (all-reduced)
    where = "replicas across the link" if layout[0] > 1 else "no replica"
    base = statistics.median(times["none"])
    rows = []
    for variant in OVERHEAD_VARIANTS:
        step = statistics.median(times[variant])
        blocked = [b for r in ranks for b in r["blocked"][variant]]
        rows.append([
            variant, fmt_ms(step), ratio(step, base) if variant != "none" else "-",
            fmt_ms(statistics.median(blocked)) if blocked else "-",
        ])  # fmt: skip
    return Table(
        title=(
            f"snapshot overhead: GPT {label} under our fully_shard, {layout[0]} machine(s) x "
            f"{layout[1]} rank(s) ({where}), link {fmt_rate(bits)}; a snapshot holds "
            f"{fmt_bytes(ranks[0]['snapshot_bytes'])} per rank"
        ),
        columns=["variant", "step", "vs none", "save blocks training"],
        rows=rows,
    )


def run(options: Options) -> list[Table]:
    flags = options.flags
    kill_at = int(flags.get("kill_at") or (6 if options.quick else 40))
    bits = int(flags.get("rate") or 10**10)
    cases = flags.get("cases") or (["worker", "machine-2x1"] if options.quick else list(CASES))
    if cases == ["none"]:
        cases = []
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"failover: no case {unknown}; choose from {', '.join(CASES)}")
    overhead = flags.get("overhead") or ("quick" if options.quick else "30M")
    rounds = int(flags.get("rounds") or (1 if options.quick else 5))
    tables = []
    with tempfile.TemporaryDirectory(prefix="failover-") as tmp:
        workdir = Path(tmp)
        outcomes: dict[tuple[str, str], Outcome] = {}
        for name in cases:
            for tier in TIERS:
                case = CASES[name]
                outcomes[(case.name, tier)] = run_case(case, tier, kill_at, bits, workdir)
                print(f"  {case.name}, {tier}: {outcomes[(case.name, tier)]}", flush=True)
        if outcomes:
            tables.append(_failover_table(outcomes, kill_at, bits))
        if overhead != "none":
            for layout in ((2, 1), (1, 2)):
                ranks = run_overhead(overhead, bits, rounds, workdir, layout)
                tables.append(_overhead_table(overhead, bits, ranks, layout))
    return tables
