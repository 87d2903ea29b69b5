"""Two machines, one slow link: FSDP over the world, HSDP and sharding across replicas.

Every byte of ``slow-link``'s benchmark crosses its filter, also the bytes between
ranks of one machine, which real machines move over NVLink or shared memory. Here
two simulated machines (``benchmarks/machines.py``: a network, UTS and mount
namespace each, cabled to a bridge by a veth pair whose both ends a token-bucket
filter limits to the link rate) run two gloo ranks each: ranks of one machine talk
over its own address (the kernel's loopback path, unlimited), ranks of two machines
cross the cable. The ranks rendezvous over TCP on the first machine's address and
bind gloo to ``eth0`` (``GLOO_SOCKET_IFNAME``).

At each size (~30M and ~60M parameters, ``bench_scale``'s GPT) and link rate (1 and
10 Gbit/s) two launches of 4 ranks (2 machines x 2), ours ``fully_shard`` variants
in the first, our FSDP1 ones and torch's HSDP in the second (all seven in one launch
do not fit in the memory of the 23 GiB machine at 60M), each stepping its variants
in turns (so load from elsewhere hits all alike); torch's FSDP over 4 ranks, the
reference, steps in both. Each block and the root are sharded or wrapped on their
own:

* FSDP over all 4 ranks: torch's ``fully_shard`` and ours, 1-D mesh;
* HSDP, a ``(replicate=2, shard=2)`` mesh whose rows are the machines: torch's
  ``fully_shard`` and ours, and our ``FullyShardedDataParallel`` ``HYBRID_SHARD``;
* sharding across replicas, the same mesh: ours ``fully_shard(...,
  shard_across_replicas=True)`` and ``FullyShardedDataParallel``
  ``HYBRID_SHARD_ACROSS_REPLICAS`` ([Note: sharding across replicas] in
  ``fsdp/_runtime/_replica_shard.py``).

AdamW, fp32, batch ``--batch`` sequences per rank. Columns:

* step: median wall time of a step, each step as long as its slowest rank;
  ``vs our HSDP`` over our HSDP's with the same front end (``fully_shard``'s, or
  ``HYBRID_SHARD``'s for the FSDP1 rows) and ``vs torch world`` over torch's
  ``fully_shard`` over 4 ranks (issue 40's targets for sharding across replicas at 1
  Gbit/s: at most 1.1x and 0.6x); torch's HSDP row against our FSDP1 HSDP, its launch's;
* across link/step: bytes each machine's cable transmitted during the step (read
  from ``eth0`` in ``/proc/net/dev``, headers included, the closing barrier's bytes
  taken off), the mean of the two machines;
* master/rank: bytes of what the optimizer steps on a rank (its sharded
  parameters); replica copy/rank: ours across replicas only, the replica shards a
  rank holds from its forward to its backward (the compute dtype); grads/rank:
  the sharded gradients after backward; optim/rank: AdamW's state after the step.
  Counted from the tensors (exact, independent of load), on the warm-up step; the
  gathered parameters of the unit computing (the same in every variant) are not.

Flags (``python -m benchmarks two-level --help``): ``--sizes``, ``--rates``,
``--steps``, ``--warmup``, ``--batch``. ``--quick``: a tiny model over 1 Gbit/s,
one step. Needs root, iproute2 and util-linux (``machines.preflight``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import multiprocessing
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import machines
from benchmarks.bench_scale import SIZES as SCALE_SIZES
from benchmarks.bench_slow_link import _csv, _non_negative, _positive, _rate, fmt_rate, parse_rate
from benchmarks.common import (
    Options,
    Table,
    fmt_bytes,
    fmt_ms,
    ratio,
    read_results,
    result_path,
    run_rank,
)

DESCRIPTION = (
    "FSDP over 4 ranks, HSDP and sharding across replicas on 2 simulated machines x 2 "
    "ranks joined by a 1 and 10 Gbit/s link (namespaces, root)"
)

SIZES = {label: SCALE_SIZES[label] for label in ("30M", "60M")}
QUICK_SIZES = {"tiny": {"vocab": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16}}
RATES = ("1gbit", "10gbit")
MACHINES = 2
RANKS_PER_MACHINE = 2
BATCH = 2
WARMUP = 1
STEPS = 3
LR = 1e-3
PORT = 29517
LAUNCH_TIMEOUT_S = 1800.0

TORCH_WORLD = "torch fully_shard, FSDP over 4"
OURS_WORLD = "ours fully_shard, FSDP over 4"
TORCH_HSDP = "torch fully_shard, HSDP 2x2"
OURS_HSDP = "ours fully_shard, HSDP 2x2"
OURS_ACROSS = "ours fully_shard, shard_across_replicas"
OURS1_HSDP = "ours FSDP1 HYBRID_SHARD"
OURS1_ACROSS = "ours FSDP1 HYBRID_SHARD_ACROSS_REPLICAS"
VARIANTS = (TORCH_WORLD, OURS_WORLD, TORCH_HSDP, OURS_HSDP, OURS_ACROSS, OURS1_HSDP, OURS1_ACROSS)
LAUNCHES = (  # the variants stepped together, in turns; each launch's rows in the table
    (TORCH_WORLD, OURS_WORLD, OURS_HSDP, OURS_ACROSS),
    (TORCH_WORLD, TORCH_HSDP, OURS1_HSDP, OURS1_ACROSS),
)
# The "vs our HSDP" baseline: the same front end's HSDP (torch's rows: the launch's)
OUR_HSDP = {v: OURS1_HSDP if "FSDP1" in v else OURS_HSDP for v in VARIANTS}
OUR_HSDP[TORCH_HSDP] = OURS1_HSDP


def add_arguments(group: argparse._ArgumentGroup) -> list[argparse.Action]:
    """This benchmark's flags (absent ones are filled in by :class:`Plan`)."""

    def size(label: str) -> str:
        if label not in SIZES:
            raise argparse.ArgumentTypeError(f"unknown size {label!r}; choose from {list(SIZES)}")
        return label

    return [
        group.add_argument("--sizes", type=_csv(size), help="model sizes (default: 30M,60M)"),
        group.add_argument(
            "--rates", type=_csv(_rate), help=f"link rates (default: {','.join(RATES)})"
        ),
        group.add_argument("--steps", type=_positive, help=f"timed steps (default: {STEPS})"),
        group.add_argument("--warmup", type=_non_negative, help=f"untimed (default: {WARMUP})"),
        group.add_argument(
            "--batch", type=_positive, help=f"sequences per rank per step (default: {BATCH})"
        ),
    ]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What one run measures: every size x rate, a launch each."""

    sizes: dict[str, dict[str, int]]
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
            rates, steps = ["1gbit"], 1
        else:
            sizes = {label: SIZES[label] for label in flags.get("sizes", list(SIZES))}
            rates, steps = list(RATES), STEPS
        return cls(
            sizes=sizes,
            rates=flags.get("rates", rates),
            steps=flags.get("steps", steps) * options.repeats,
            warmup=max(1, flags.get("warmup", WARMUP)),  # the first step counts the memory
            batch=flags.get("batch", BATCH),
        )


def preflight(options: Options) -> None:
    """Stop before anything runs where simulated machines cannot be made."""
    del options
    machines.preflight("two_level")


# ----------------------------------------------------------- ranks on machines


@dataclass(frozen=True)
class Launch:
    """What every rank of one launch needs (pickled to the machines)."""

    folder: str  # results: rank<r>.pkl
    master: str  # the first machine's address: the TCP rendezvous
    world: int
    per_machine: int
    timeout: float
    job: Job


def run_on_cluster(cluster: machines.Cluster, job: Job, timeout: float) -> list[Any]:
    """:func:`_timing_rank` on ``RANKS_PER_MACHINE`` ranks of every machine; rank-ordered
    results. One agent process per machine starts its ranks; every process runs in a
    session of its own and is killed on any way out."""
    with tempfile.TemporaryDirectory(prefix="two-level-") as folder:
        spec = Launch(
            folder=folder,
            master=cluster.machines[0].address,
            world=MACHINES * RANKS_PER_MACHINE,
            per_machine=RANKS_PER_MACHINE,
            timeout=timeout,
            job=job,
        )
        spec_path = Path(folder) / "launch.pkl"
        spec_path.write_bytes(pickle.dumps(spec))
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        code = "import sys; from benchmarks.bench_two_level import _agent; _agent(*sys.argv[1:])"
        agents = [
            m.popen([sys.executable, "-c", code, str(spec_path), str(m.index)], env=env)
            for m in cluster.machines
        ]
        deadline = time.monotonic() + timeout
        try:
            for agent in agents:
                agent.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"two_level: the ranks ran over {timeout:.0f} s") from None
        finally:
            for agent in agents:
                if agent.poll() is None:
                    os.killpg(agent.pid, signal.SIGKILL)
                    agent.wait()
        codes = [a.returncode for a in agents]
        return read_results(
            folder,
            spec.world,
            "of two_level",
            lambda rank: f"two_level: rank {rank} left no result (agents: {codes})",
        )


def _agent(spec_path: str, machine: str) -> None:
    """Inside one machine: start its ranks and wait for them."""
    spec: Launch = pickle.loads(Path(spec_path).read_bytes())
    ctx = multiprocessing.get_context("spawn")
    first = int(machine) * spec.per_machine
    procs = [
        ctx.Process(target=_rank_main, args=(spec, rank))
        for rank in range(first, first + spec.per_machine)
    ]
    for p in procs:
        p.start()
    for rank, p in enumerate(procs, start=first):
        p.join()
        result = result_path(spec.folder, rank)
        if p.exitcode != 0 and not result.exists():  # killed before it could say why
            why = f"rank {rank} exited with {p.exitcode}"
            if p.exitcode == -signal.SIGKILL:
                why += " (SIGKILL: the kernel's OOM killer? see dmesg)"
            result.write_bytes(pickle.dumps(("raised", why)))


def _rank_main(spec: Launch, rank: int) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    os.environ["GLOO_SOCKET_IFNAME"] = machines.NIC  # the machine's address, not lo
    init_method = f"tcp://{spec.master}:{PORT}"
    work = functools.partial(_timing_rank, spec.job)
    run_rank(spec.folder, rank, spec.world, work, init_method=init_method, timeout=spec.timeout)


# ------------------------------------------------------------------ the ranks


def _nic_tx() -> int:
    """Bytes this machine's cable has transmitted (the rank's network namespace)."""
    with open("/proc/net/dev") as f:
        return machines.interface_bytes(f.read(), machines.NIC)[1]


class _Trainer:
    """One variant on this rank: GPT sharded or wrapped per block and root, AdamW."""

    def __init__(self, variant: str, model_kwargs: dict[str, int], batch: int) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        from benchmarks.gpt import GPT, Block

        torch.manual_seed(0)
        self.model = GPT(**model_kwargs)
        self.batch = batch
        self.step_index = 0
        self.wrapped: Any = self.model
        world = "FSDP over 4" in variant
        shape = (4,) if world else (MACHINES, RANKS_PER_MACHINE)
        names = None if world else ("replicate", "shard")
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        if variant.startswith("torch"):
            from torch.distributed.fsdp import fully_shard as torch_fully_shard

            for block in self.model.blocks:
                torch_fully_shard(block, mesh=mesh)
            torch_fully_shard(self.model, mesh=mesh)
        elif "FSDP1" in variant:
            import fsdp
            import fsdp.wrap

            strategy = "HYBRID_SHARD_ACROSS_REPLICAS" if variant == OURS1_ACROSS else "HYBRID_SHARD"
            self.wrapped = fsdp.FullyShardedDataParallel(
                self.model,
                sharding_strategy=fsdp.ShardingStrategy[strategy],
                device_mesh=mesh,
                auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({Block}),
                device_id=torch.device("cpu"),
            )
        else:
            import fsdp

            across = variant == OURS_ACROSS
            for block in self.model.blocks:
                fsdp.fully_shard(block, mesh=mesh, shard_across_replicas=across)
            fsdp.fully_shard(self.model, mesh=mesh, shard_across_replicas=across)
        self.opt = torch.optim.AdamW(self.wrapped.parameters(), lr=LR)

    def step(self, count: bool = False) -> dict[str, int]:
        """One training step on this variant's next batch; with ``count``, the bytes of
        its state (see the module docstring)."""
        import torch.distributed as dist

        from benchmarks.gpt import lm_loss, random_tokens

        seed = 1000 * self.step_index + dist.get_rank()
        self.step_index += 1
        tokens = random_tokens(self.model.config, self.batch, seed=seed)
        self.opt.zero_grad(set_to_none=True)
        loss = lm_loss(self.wrapped, tokens)
        held = _replica_bytes(self.wrapped) if count else 0
        loss.backward()
        grads = _local_bytes(p.grad for p in self.wrapped.parameters()) if count else 0
        self.opt.step()
        if not count:
            return {}
        states = (t for s in self.opt.state.values() for t in s.values())
        return {
            "master": _local_bytes(self.wrapped.parameters()),
            "replica": held,
            "grads": grads,
            "optim": _local_bytes(t for t in states if getattr(t, "dim", lambda: 0)() > 0),
        }


def _local_bytes(tensors: Any) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def _replica_bytes(model: Any) -> int:
    """Bytes of replica shards our modules hold now (0 for torch's and other modes)."""
    from fsdp._fully_shard._state import state_of
    from fsdp._wrapper._fsdp_state import get_fsdp_state

    storages = []
    for m in model.modules():
        wrapper = get_fsdp_state(m)
        if wrapper is not None and wrapper.unit is not None:
            storages += [part.storage for part in wrapper.unit.parts()]
        shard = state_of(m) if hasattr(m, "unshard") else None
        if shard is not None and shard.group is not None:
            storages += shard.group.storages
    return sum(s.replica_shard.nbytes for s in storages if s.replica_shard is not None)


@dataclass(frozen=True, kw_only=True)
class Job:
    """One launch: the variants, the model and the schedule (pickled into the ranks)."""

    variants: tuple[str, ...]
    model: dict[str, int]
    batch: int
    warmup: int
    steps: int


def _timing_rank(job: Job) -> dict[str, Any]:
    """Every variant on this rank, in turns: per step its time and this machine's bytes."""
    import torch.distributed as dist

    from fsdp._runtime._host_memory import release_freed_host_memory

    dist.barrier()
    before = _nic_tx()
    dist.barrier()
    barrier_bytes = _nic_tx() - before  # what the barrier closing each step adds
    trainers = {v: _Trainer(v, job.model, job.batch) for v in job.variants}
    gc.collect()
    release_freed_host_memory()  # the full models the variants were built from
    memory = {}
    for v, trainer in trainers.items():
        memory[v] = trainer.step(count=True)
        for _ in range(job.warmup - 1):
            trainer.step()
    record: dict[str, dict[str, list[float]]] = {
        v: {"times": [], "bytes": []} for v in job.variants
    }
    names = list(job.variants)
    for i in range(job.steps):
        shift = i % len(names)
        for v in names[shift:] + names[:shift]:
            dist.barrier()
            before = _nic_tx()
            start = time.perf_counter()
            trainers[v].step()
            record[v]["times"].append(time.perf_counter() - start)
            dist.barrier()  # every rank's sends of this step are on the wire
            record[v]["bytes"].append(_nic_tx() - before - barrier_bytes)
    params = sum(p.numel() for p in trainers[TORCH_WORLD].model.parameters())
    return {"variants": record, "memory": memory, "params": params}


# ------------------------------------------------------------------ reporting


@dataclass(frozen=True)
class Row:
    """One variant at one size and rate."""

    step_s: float
    link_bytes: float  # per machine per step
    memory: dict[str, int]  # the largest over the ranks, per kind


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Row]:
    """Each variant's :class:`Row` from every rank's :func:`_timing_rank` result."""
    rows = {}
    firsts = range(0, len(ranks), RANKS_PER_MACHINE)  # one rank per machine reads its cable
    for v in ranks[0]["variants"]:
        times = [max(ts) for ts in zip(*(r["variants"][v]["times"] for r in ranks), strict=True)]
        sent = [statistics.median(ranks[i]["variants"][v]["bytes"]) for i in firsts]
        kinds = ranks[0]["memory"][v]
        rows[v] = Row(
            step_s=statistics.median(times),
            link_bytes=statistics.fmean(sent),
            memory={k: max(r["memory"][v][k] for r in ranks) for k in kinds},
        )
    return rows


COLUMNS = [
    "params",
    "link",
    "variant",
    "step",
    "vs our HSDP",
    "vs torch world",
    "across link/step",
    "vs our HSDP bytes",
    "master/rank",
    "replica copy/rank",
    "grads/rank",
    "optim/rank",
]


def table_rows(label: str, bits: int, params: int, rows: dict[str, Row]) -> list[list[str]]:
    """The table's cells at one size and rate, one list per variant."""
    world = rows[TORCH_WORLD]
    out = []
    for v, row in rows.items():
        hsdp = rows.get(OUR_HSDP[v])  # None: not in this launch
        mem = row.memory
        out.append(
            [
                f"{params / 1e6:.1f}M ({label})",
                fmt_rate(bits),
                v,
                fmt_ms(row.step_s),
                "-" if hsdp is None else ratio(row.step_s, hsdp.step_s),
                ratio(row.step_s, world.step_s),
                fmt_bytes(row.link_bytes),
                "-" if hsdp is None else ratio(row.link_bytes, hsdp.link_bytes),
                fmt_bytes(mem["master"]),
                fmt_bytes(mem["replica"]) if mem["replica"] else "-",
                fmt_bytes(mem["grads"]),
                fmt_bytes(mem["optim"]),
            ]
        )
    return out


def run(options: Options) -> list[Table]:
    """Make the machines, run every size and rate on them, remove them; one table."""
    plan = Plan.from_options(options)
    table = Table(
        f"2 simulated machines x 2 ranks joined by one link: GPT, batch {plan.batch} per rank, "
        f"gloo/CPU, AdamW fp32: median of {plan.steps} steps after {plan.warmup} warm-up",
        COLUMNS,
    )
    with machines.cluster(MACHINES) as cluster:
        for bits_text in plan.rates:
            bits = parse_rate(bits_text)
            cluster.set_rate(bits)
            for label, model in plan.sizes.items():
                for variants in LAUNCHES:
                    job = Job(
                        variants=variants,
                        model=model,
                        batch=plan.batch,
                        warmup=plan.warmup,
                        steps=plan.steps,
                    )
                    ranks = run_on_cluster(cluster, job, LAUNCH_TIMEOUT_S)
                    cells = table_rows(label, bits, ranks[0]["params"], summarize(ranks))
                    for row in cells:
                        table.add(*row)
                    print("\n".join(table.render().splitlines()[-len(cells) :]), flush=True)
    table.notes += [
        "across link/step: bytes each machine's cable transmitted in a step (eth0, TCP/IP "
        "headers included), mean of the 2 machines",
        "master: the sharded parameters the optimizer steps; replica copy: held from forward "
        "to backward by sharding across replicas; grads after backward; optim: AdamW state",
        "two launches per rate and size (ours fully_shard; our FSDP1 and torch's HSDP), each "
        "with torch's FSDP over 4 (the second such row is the second launch's); the variants "
        "of a launch step in turns, and ratios are within a launch",
    ]
    return [table]
