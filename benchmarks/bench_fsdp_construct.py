"""Resident memory after wrapping: ours vs torch's FSDP1 at the sizes of ``bench_scale``.

Each variant builds the GPT of ``bench_scale`` (one unit per block plus the
root, FULL_SHARD) in fresh processes on 2 gloo/CPU ranks and reads, on rank
0, the resident set (``VmRSS``) right after the constructor returns and its
peak during construction (``VmHWM``, reset after building the model), both
above the resident set before the model was built (both packages imported); the model itself is
freed by wrapping (its parameters become shards). "ours, no trim" disables
the trimming of glibc's heap after each unit (see [Note: construction RSS]
in ``fsdp/_init.py``): the state before it. Linux only. The allocator's
state is inherited from the launching process, so repeats may differ by a
few tens of MiB; the bytes of tensors in use do not.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import Options, Table, launch, proc_status_kb

DESCRIPTION = "resident memory after wrapping, ours vs torch FSDP1 (2 ranks)"

VARIANTS = ("torch FSDP1", "ours, no trim", "ours")


def _rank(variant: str, model_kwargs: dict[str, int]) -> dict[str, float]:
    import torch
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.wrap as torch_wrap

    import fsdp
    import fsdp._runtime._host_memory
    import fsdp.wrap
    from benchmarks.gpt import GPT, Block

    torch.manual_seed(0)
    base = proc_status_kb("VmRSS")
    model = GPT(**model_kwargs)
    built = proc_status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    wrapped: Any
    if variant == "torch FSDP1":
        wrapped = torch_fsdp.FullyShardedDataParallel(
            model,
            auto_wrap_policy=torch_wrap.ModuleWrapPolicy({Block}),
            device_id=torch.device("cpu"),
        )
    else:
        if variant == "ours, no trim":
            fsdp._runtime._host_memory._malloc_trim = None
        wrapped = fsdp.FullyShardedDataParallel(
            model, auto_wrap_policy=fsdp.wrap.ModuleWrapPolicy({Block}), device_id="cpu"
        )
    after = proc_status_kb("VmRSS")
    peak = proc_status_kb("VmHWM")
    shard = sum(p.numel() * p.element_size() for p in wrapped.parameters())
    mib = 1024.0
    return {
        "model": (built - base) / mib,
        "after": (after - base) / mib,
        "peak": (peak - base) / mib,
        "shard": shard / 2**20,
    }


def run(options: Options) -> list[Table]:
    """Every size and variant in fresh launches, rank 0's numbers."""
    from benchmarks.bench_scale import QUICK_SIZES, SIZES

    sizes = QUICK_SIZES if options.quick else SIZES
    table = Table(
        "resident MiB above the process before the model, rank 0 of 2, gloo/CPU, FULL_SHARD",
        ["params", "variant", "model", "shards", "after wrap", "vs torch", "peak in wrap"],
    )
    for label, model in sizes.items():
        rows = {v: launch(_rank, 2, v, model)[0] for v in VARIANTS}
        base = rows["torch FSDP1"]["after"]
        for v, r in rows.items():
            table.add(
                label,
                v,
                f"{r['model']:.1f}",
                f"{r['shard']:.1f}",
                f"{r['after']:.1f}",
                "-" if v == "torch FSDP1" else f"{r['after'] - base:+.1f}",
                f"{r['peak']:.1f}",
            )
    return [table]
