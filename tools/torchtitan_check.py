"""Manual check (not in CI): torchtitan's own trainer with torch's ``fully_shard`` vs ours.

Needs torchtitan 0.3.0 (not a dependency of ours), in a venv of its own::

    python3 -m venv /work/venv-titan
    /work/venv-titan/bin/pip install torch==2.13.0   # first, or pip pulls a CUDA build
    /work/venv-titan/bin/pip install torchtitan==0.3.0 --no-deps
    /work/venv-titan/bin/pip install tyro spmd_types==0.2.3 torchdata tensorboard \\
        triton tokenizers "datasets>=3.6,<4.8"       # what torchtitan imports
    /work/venv-titan/bin/python tools/torchtitan_check.py            # this tree
    /work/venv-titan/bin/python tools/torchtitan_check.py --tree /work/wt-spmd

PLACEHOLDER
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
import types
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flatparam", "zero_optim", "fsdp", "ckpt")
DTENSOR = ["--parallelism.spmd_backend", "full_dtensor"]
# name -> (ranks, torchtitan arguments)
CONFIGS: dict[str, tuple[int, list[str]]] = {
    "fsdp-2": (2, ["--parallelism.spmd_backend", "partial_dtensor"]),
    "dtensor-fsdp-2": (2, DTENSOR),
    "dtensor-fsdp2xtp2": (4, [*DTENSOR, "--parallelism.tensor_parallel_degree", "2"]),
    "dtensor-hsdp2x2": (
        4,
        [
            *DTENSOR,
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "2",
        ],
    ),
}
IMPLS = ("torch", "ours")
PG_TIMEOUT_S = 120  # every process group's timeout, in the rank processes


# ---------------------------------------------------------------- rank processes


class _CpuDeviceModule(types.ModuleType):
    """``torch.cuda``'s surface as torchtitan uses it, answered for the CPU.

    torchtitan picks ``torch.cuda`` when no accelerator is found; it sets the device,
    reads memory statistics and the device name, and synchronizes. ``torch.cpu`` has
    some of these; the rest are harmless constants here.
    """

    def __init__(self) -> None:
        super().__init__("torchtitan_check_cpu_device")

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch.cpu, name)

    def set_device(self, device: Any) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def synchronize(self, device: Any = None) -> None:
        pass

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> Any:
        return types.SimpleNamespace(name="cpu", total_memory=1 << 40)

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass


def _describe_tensor(t: Any) -> str:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        mesh = t.device_mesh
        dims = ",".join(
            f"{n}={s}" for n, s in zip(mesh.mesh_dim_names or (), mesh.shape, strict=False)
        )
        places = ",".join(str(p) for p in t.placements)
        return f"DTensor mesh({dims}) [{places}] {str(t.dtype).removeprefix('torch.')}"
    return f"{type(t).__name__} {str(t.dtype).removeprefix('torch.')}"


def _spy_fully_shard(calls: list[dict[str, Any]]) -> None:
    """Wrap ``torch.distributed.fsdp.fully_shard`` (torch's or ours) to record its calls.

    Records what torchtitan passes: the module(s), the mesh, ``dp_mesh_dims`` and the
    other keywords, and what the parameters it will manage are before and after.
    """
    import torch.distributed.fsdp as torch_fsdp

    inner = torch_fsdp.fully_shard
    calls.append({"implementation": f"{inner.__module__}.{inner.__qualname__}"})

    def own_params(modules: list[Any]) -> list[tuple[str, Any]]:
        fsdp_module = torch_fsdp.FSDPModule
        taken = {
            id(p)
            for m in modules
            for sub in m.modules()
            if sub is not m and isinstance(sub, fsdp_module)
            for p in sub.parameters()
        }
        return [(n, p) for m in modules for n, p in m.named_parameters() if id(p) not in taken]

    def summary(params: list[tuple[str, Any]]) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, p in params:
            key = _describe_tensor(p)
            out[key] = out.get(key, 0) + 1
        return out

    def spy(module: Any, *args: Any, **kwargs: Any) -> Any:
        modules = list(module) if isinstance(module, list) else [module]
        mesh = kwargs.get("mesh", args[0] if args else None)
        params = own_params(modules)
        record: dict[str, Any] = {
            "modules": [type(m).__name__ for m in modules],
            "mesh": None
            if mesh is None
            else {
                "names": list(mesh.mesh_dim_names or ()),
                "shape": list(mesh.shape),
            },
            "kwargs": {
                k: (v.__qualname__ if callable(v) and not isinstance(v, type) else repr(v))
                for k, v in kwargs.items()
                if k != "mesh"
            },
            "params_before": summary(params),
        }
        calls.append(record)
        result = inner(module, *args, **kwargs)
        names = {n for n, _ in params}  # fully_shard replaced the parameter objects
        after = [(n, p) for m in modules for n, p in m.named_parameters() if n in names]
        record["params_after"] = summary(after)
        return result

    torch_fsdp.fully_shard = spy


def _patch_for_cpu(results: dict[str, Any]) -> None:
    """torchtitan's run-time patches for a CPU run on gloo (see the module docstring)."""
    import torch.distributed.distributed_c10d as c10d

    # every process group (DeviceMesh's sub-groups included) gets a finite timeout
    c10d._get_default_timeout = lambda backend: timedelta(seconds=PG_TIMEOUT_S)

    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type = "cpu"
    titan_utils.device_module = _CpuDeviceModule()  # type: ignore[assignment]

    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common.attention import ScaledDotProductAttention

    # FlexAttention compiles a kernel with inductor (a C++ toolchain and minutes on
    # CPU); causal SDPA is the same model without document masking.
    llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()

    import torchtitan.distributed.utils as dist_utils

    # a barrier(device_ids=[cuda device]) and shorter timeouts: ours are set above
    dist_utils.set_pg_timeouts = lambda *args, **kwargs: None

    import torchtitan.distributed.fsdp as titan_fsdp

    disable_division = titan_fsdp.disable_fsdp_gradient_division

    def sum_reductions(model: Any) -> None:
        # torchtitan divides gradients itself (divide factor 1.0), which torch's
        # fully_shard turns into ReduceOp.PREMUL_SUM(1.0): gloo has none. A plain SUM
        # is the same reduction (ours always sums; the call is accepted and ignored).
        disable_division(model)
        for module in model.modules():
            if isinstance(module, titan_fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = sum_reductions

    from torchtitan.components.metrics import MetricsProcessor

    log = MetricsProcessor.log

    def spy_log(self: Any, step: int, global_avg_loss: float, global_max_loss: float,
                grad_norm: float, *args: Any, **kwargs: Any) -> Any:
        results["losses"].append(float(global_avg_loss))
        results["grad_norms"].append(float(grad_norm))
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

    MetricsProcessor.log = spy_log  # type: ignore[method-assign]


def _rank_main(impl: str, tree: Path, out: Path, titan_args: list[str]) -> int:
    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {"losses": [], "grad_norms": [], "fully_shard": [], "error": None}
    try:
        import torch

        torch.set_num_threads(1)
        if impl == "ours":
            sys.path[:0] = [str(tree / "packages" / name / "src") for name in PACKAGES]
            import fsdp.torch_compat

            fsdp.torch_compat.install()
            results["fsdp_file"] = fsdp.__file__
        _spy_fully_shard(results["fully_shard"])
        _patch_for_cpu(results)
        import torchtitan.train

        sys.argv = ["torchtitan.train", *titan_args]
        torchtitan.train.main()
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        results["error"] = text.splitlines()[0] if text else type(exc).__name__
        results["traceback"] = traceback.format_exc()
        code = 1
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    return code


# ---------------------------------------------------------------- driver


def _write_assets(folder: Path) -> None:
    """A word-level tokenizer and a small text corpus in the layout torchtitan reads.

    torchtitan's wheel lacks its repository's ``tests/assets`` (tokenizer and the
    ``c4_test`` corpus); these stand in, deterministic, with a vocabulary well under
    the debug model's 2,048.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = sorted({"".join(rng.choices(letters, k=rng.randint(2, 7))) for _ in range(900)})
    specials = ["[UNK]", "<|begin_of_text|>", "<|end_of_text|>"]
    vocab = {w: i for i, w in enumerate([*specials, *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    (folder / "tokenizer").mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer" / "tokenizer.json"))
    (folder / "tokenizer" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": specials[1], "eos_token": specials[2]})
    )
    (folder / "c4_test").mkdir()
    with open(folder / "c4_test" / "data.json", "w") as f:
        for _ in range(400):
            text = " ".join(rng.choices(words, k=rng.randint(20, 120)))
            f.write(json.dumps({"text": text}) + "\n")


def _titan_args(assets: Path, dump: Path, steps: int, extra: list[str]) -> list[str]:
    return [
        "--module", "llama3",
        "--config", "llama3_debugmodel",
        "--hf_assets_path", str(assets / "tokenizer"),
        "--dataloader.dataset_path", str(assets / "c4_test"),
        "--dump_folder", str(dump),
        "--training.steps", str(steps),
        "--training.seq_len", "32",
        "--training.local_batch_size", "2",
        "--debug.seed", "0",
        "--debug.deterministic",
        "--comm.init_timeout_seconds", str(PG_TIMEOUT_S),
        "--comm.trace_buf_size", "0",
        "--validator.no-enable",
        "--checkpoint.no-enable",
        "--metrics.no-enable-tensorboard",
        *extra,
    ]  # fmt: skip


def _run_config(
    impl: str, ranks: int, titan_args: list[str], tree: Path, work: Path, timeout: float
) -> dict[str, Any]:
    """One torchtitan training run on ``ranks`` gloo processes; rank 0's record."""
    out = work / "out"
    out.mkdir(parents=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc-per-node", str(ranks),
        "--monitor-interval", "1",
        str(Path(__file__).resolve()), "--rank-process", impl,
        "--tree", str(tree), "--out", str(out), "--", *titan_args,
    ]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HOME": str(work / "hf"),
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": "",
    }
    log_path = work / "log.txt"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"error": f"timed out after {timeout:.0f} s (log: {log_path})"}
    records = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if not records:
        return {"error": f"no rank wrote a result, exit {proc.returncode} (log: {log_path})"}
    errors = [r["error"] for r in records if r["error"]]
    record = records[0]
    if errors:
        record["error"] = errors[0]
    elif proc.returncode != 0:
        record["error"] = f"torchrun exited {proc.returncode} (log: {log_path})"
    record["log"] = str(log_path)
    return record


def _compare(ref: dict[str, Any], ours: dict[str, Any]) -> str:
    if ref.get("error"):
        return f"torch's run failed: {ref['error']}"
    if ours.get("error"):
        return f"ours raised: {ours['error']}"
    a, b = ref["losses"], ours["losses"]
    if len(a) != len(b) or not a:
        return f"different step counts: {len(a)} vs {len(b)}"
    diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
    equal = all(x == y for x, y in zip(a, b, strict=True))
    return f"{'equal bit for bit' if equal else 'NOT equal'}, max |diff| {diff:.3g}"


def _print_calls(calls: list[dict[str, Any]]) -> None:
    """Distinct fully_shard calls, with how often each was made."""
    seen: dict[str, int] = {}
    for call in calls:
        key = json.dumps(call, sort_keys=True)
        seen[key] = seen.get(key, 0) + 1
    for key, count in seen.items():
        call = json.loads(key)
        mesh = call["mesh"]
        mesh_text = (
            "None"
            if mesh is None
            else ", ".join(f"{n}={s}" for n, s in zip(mesh["names"], mesh["shape"], strict=False))
        )
        print(f"    {count} x fully_shard({'+'.join(call['modules'])}, mesh({mesh_text}))")
        for k, v in call["kwargs"].items():
            print(f"        {k} = {v}")
        for when in ("params_before", "params_after"):
            for desc, n in call.get(when, {}).items():
                print(f"        {when[7:]:6}: {n} x {desc}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="the repository whose packages/*/src are ours")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--impls", nargs="*", default=list(IMPLS), choices=list(IMPLS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per training run")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    parser.add_argument("--rank-process", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("titan_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_process:
        raise SystemExit(_rank_main(args.rank_process, args.tree, args.out, args.titan_args))

    work = Path(tempfile.mkdtemp(prefix="torchtitan_check_"))
    try:
        _write_assets(work / "assets")
        results: dict[str, dict[str, dict[str, Any]]] = {}
        for name in args.configs:
            ranks, extra = CONFIGS[name]
            results[name] = {}
            for impl in args.impls:
                titan_args = _titan_args(work / "assets", work / name / impl / "dump", args.steps, extra)
                r = _run_config(impl, ranks, titan_args, args.tree.resolve(), work / name / impl, args.timeout)
                results[name][impl] = r
                status = r.get("error") or " ".join(repr(x) for x in r["losses"])
                print(f"{name} {impl}: {status}", flush=True)
        print(f"\nours from {args.tree.resolve()}; {args.steps} steps per run")
        for name, by_impl in results.items():
            ranks, extra = CONFIGS[name]
            print(f"\n== {name} ({ranks} ranks, {' '.join(extra) or 'default spmd backend'})")
            for impl, r in by_impl.items():
                if r.get("error"):
                    print(f"  {impl:5}: ERROR {r['error']}")
                else:
                    for step, (loss, norm) in enumerate(zip(r["losses"], r["grad_norms"], strict=True), 1):
                        print(f"  {impl:5} step {step}: loss {loss!r} grad_norm {norm!r}")
            if set(IMPLS) <= set(by_impl):
                print(f"  => {_compare(by_impl['torch'], by_impl['ours'])}")
            if "torch" in by_impl and by_impl["torch"].get("fully_shard"):
                print("  torch's run, fully_shard calls (rank 0):")
                _print_calls(by_impl["torch"]["fully_shard"])
    finally:
        if args.keep:
            print(f"work folder: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
