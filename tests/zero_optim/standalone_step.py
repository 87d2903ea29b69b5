"""A 2-rank ZeRO training step that needs only torch, flatparam and zero_optim.

Run it as a script: ``python tests/zero_optim/standalone_step.py``. It is self
contained (no ``tests`` package, no pytest) so that it also runs in a fresh
virtual environment holding only the ``flatparam`` and ``zero_optim`` wheels:
that is the install check ``nox -s build`` can run. ``test_standalone.py`` runs
it in this environment with ``ZERO_OPTIM_BLOCK`` naming modules to make
unimportable (our other packages, and torch's own ZeRO), which is what their
absence looks like to zero_optim.

Each rank trains a small model three steps with DDP + ours (plain and
overlapped with the DDP hook) and with DDP + the plain optimizer, and checks
the parameters agree bit for bit; the script exits 0 and prints one "ok" line.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from typing import Any

_BLOCK = [m for m in os.environ.get("ZERO_OPTIM_BLOCK", "").split(",") if m]


class _Unavailable(importlib.abc.MetaPathFinder):
    """Makes the modules named in ZERO_OPTIM_BLOCK (and their submodules) unimportable."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if any(fullname == m or fullname.startswith(m + ".") for m in _BLOCK):
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked)", name=fullname)


if _BLOCK:
    sys.meta_path.insert(0, _Unavailable())

import datetime  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import zero_optim  # noqa: E402

WORLD_SIZE = 2
TIMEOUT_S = 120
OTHERS = ("fsdp", "ckpt", "torch.distributed.optim")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def _train(mode: str, rank: int) -> list[torch.Tensor]:
    model = _model()
    ddp = DistributedDataParallel(model)
    opt: torch.optim.Optimizer
    if mode == "plain":
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    else:
        opt = zero_optim.ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, overlap_with_ddp=mode == "overlap", lr=0.01
        )
        if mode == "overlap":
            ddp.register_comm_hook(None, zero_optim.hook_with_zero_step(allreduce_hook, ddp, opt))
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        if mode != "overlap":
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _rank(rank: int, rendezvous: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        torch.set_num_threads(1)
        reference = _train("plain", rank)
        for mode in ("zero", "overlap"):
            got = _train(mode, rank)
            for i, (a, b) in enumerate(zip(got, reference, strict=True)):
                if not torch.equal(a, b):
                    raise AssertionError(f"rank {rank}: {mode} parameter {i} differs from plain")
        loaded = [m for m in OTHERS if m in sys.modules]
        if loaded:
            raise AssertionError(f"zero_optim pulled in {loaded}")
        # Both ranks done before either tears gloo down: a rank that destroyed its group
        # while its peer still finished DDP's last reducer work aborted the peer (SIGABRT,
        # "terminate called without an active exception") once under load in CI.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> int:
    for name in OTHERS[:2]:
        try:
            __import__(name)
        except ModuleNotFoundError:
            continue
        print(f"note: {name} is importable here; this check only shows zero_optim never imports it")
    with tempfile.TemporaryDirectory() as folder:
        ctx = mp.start_processes(
            _rank, args=(os.path.join(folder, "rendezvous"),), nprocs=WORLD_SIZE, join=False
        )
        deadline = time.monotonic() + TIMEOUT_S
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                print("standalone step: timed out", file=sys.stderr)
                return 1
    loaded = [m for m in OTHERS if m in sys.modules] or "none"
    print(
        f"ok: zero_optim {zero_optim.__version__} trained {WORLD_SIZE} ranks (plain and "
        f"overlapped) with {loaded} of {list(OTHERS)} imported"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
