"""Peak RSS per rank, ours vs torch's FSDP1: ``python -m benchmarks.rss [--inflight N]``.

A 4,194,304-parameter model (4 units of four 512x512 Linears) on 2 gloo/CPU
ranks, three AdamW steps in three cases: 3/4 of every unit frozen
(``use_orig_params=True``), all trainable, and all trainable accumulating
two micro-batches without ``no_sync``. Per rank: the resident-set growth
over the unwrapped model (MB) right after wrapping, and its peak during
wrapping and during training (``VmHWM`` of ``/proc/self/status``, reset
before each phase). Linux only.

glibc keeps freed blocks of a few MB in its heap once an ``mmap``ed block
was freed (its threshold grows), so without ``MALLOC_MMAP_THRESHOLD_=65536``
in the environment these numbers measure the allocation order as much as
the memory in use; the README's numbers were taken with it. ``--inflight 0``
completes each gradient reduction before the next unit's backward (ours
keeps one in flight by default to overlap it; see [Note: reductions in
flight] in ``fsdp/_root_context.py``).
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import proc_status_kb
from tests.ranks import run_ranks

CASES = {  # name -> (frozen, micro-batches per step, use_orig_params)
    "3/4 frozen": (True, 1, True),
    "trainable": (False, 1, False),
    "accumulate x2": (False, 2, False),
}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Layer(nn.Module):
    """Four 512x512 Linears (1,048,576 parameters); q, k, v frozen if asked."""

    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(512, 512, bias=False) for _ in range(4))
        if frozen:
            for m in (self.q, self.k, self.v):
                m.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.o(torch.tanh(self.q(x) + self.k(x) + self.v(x)))


def _rank(impl: str, case: str, inflight: int | None) -> dict[str, float]:
    frozen, accumulate, orig = CASES[case]
    torch.manual_seed(0)
    net = nn.Sequential(*(Layer(frozen) for _ in range(4)))
    gc.collect()
    base = proc_status_kb("VmRSS")
    _reset_peak()
    model: Any
    if impl == "ours":
        import fsdp
        from fsdp.wrap import ModuleWrapPolicy

        model = fsdp.FullyShardedDataParallel(
            net, auto_wrap_policy=ModuleWrapPolicy({Layer}), use_orig_params=orig
        )
        if inflight is not None:
            model._fsdp_state.lazy_init()
            model._fsdp_state.ctx.max_reductions_in_flight = inflight
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

        model = FullyShardedDataParallel(
            net,
            auto_wrap_policy=TorchPolicy({Layer}),
            use_orig_params=orig,
            device_id=torch.device("cpu"),
        )
    del net
    gc.collect()
    out = {
        "wrap peak": proc_status_kb("VmHWM") - base,
        "after wrap": proc_status_kb("VmRSS") - base,
    }
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    _reset_peak()
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        for _ in range(accumulate):
            model(torch.randn(8, 512, generator=g)).sum().backward()
        opt.step()
        opt.zero_grad()
    out["train peak"] = proc_status_kb("VmHWM") - base
    return {k: v / 1024 for k, v in out.items()}


def main(argv: list[str]) -> int:
    """Print one line per case and implementation: each rank's MB."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rss", description=__doc__)
    parser.add_argument("--inflight", type=int, default=None, help="ours: reductions in flight")
    args = parser.parse_args(argv)
    for case in CASES:
        for impl in ("ours", "torch"):
            ranks = run_ranks(_rank, 2, impl, case, args.inflight, timeout=300)
            cells = "  ".join(" / ".join(f"{k} {v:5.1f}" for k, v in r.items()) for r in ranks)
            print(f"{case:14} {impl:5}  {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
