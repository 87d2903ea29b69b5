"""Manual check (not in CI): torchtitan's own trainer with torch's ``fully_shard`` vs ours.

Needs torchtitan 0.3.0 (not a dependency of ours), in a venv of its own; our packages
are not installed there but put on the rank processes' path from ``--tree``::

    python3 -m venv /work/venv-titan
    /work/venv-titan/bin/pip install torch==2.13.0   # first, or pip pulls a CUDA build
    /work/venv-titan/bin/pip install torchtitan==0.3.0 --no-deps
    # what torchtitan imports (and ckpt's safetensors), without touching torch:
    /work/venv-titan/bin/pip install tyro spmd_types==0.2.3 torchdata tensorboard \\
        triton tokenizers "datasets>=3.6,<4.8" safetensors
    /work/venv-titan/bin/python tools/torchtitan_check.py                    # this tree
    /work/venv-titan/bin/python tools/torchtitan_check.py --tree /work/wt-spmd
    /work/venv-titan/bin/python tools/torchtitan_check.py --configs dtensor-hsdp2x2 --keep

Each configuration trains torchtitan's llama3 debug model (``--module llama3 --config
llama3_debugmodel``: 6 layers, dim 256, vocab 2,048, bf16 parameters / fp32 reductions,
selective activation checkpointing) for ``--steps`` steps, fixed seed, deterministic
algorithms, sequence length 32, local batch 2, through ``torchtitan.train.main`` under
``torch.distributed.run`` on CPU with gloo: once with torch's ``fully_shard`` and once
with ours (``fsdp.torch_compat.install()`` before torchtitan imports its names). It prints
per step both losses (the loss torchtitan logs) and grad norms, whether they are equal
bit for bit, and every distinct ``fully_shard`` call torchtitan makes: the modules, the
mesh, ``dp_mesh_dims`` and the other keywords, and its parameters' placements before
and after (``_S(0, 2)`` is ``_StridedShard(dim=0, split_factor=2)``). A run that fails
reports the first line of its error. Configurations (``--configs``):

- ``fsdp-2``: 2 ranks, ``spmd_backend=partial_dtensor``: plain FSDP on a 1-D ``fsdp`` mesh.
- ``dtensor-fsdp-2``: 2 ranks, ``full_dtensor``: parameters are DTensors on the SPMD
  mesh before ``fully_shard(..., dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))``.
- ``dtensor-fsdp2xtp2``: 4 ranks, ``full_dtensor``, dp_shard 2 x tp 2.
- ``dtensor-hsdp2x2``: 4 ranks, ``full_dtensor``, dp_replicate 2 x dp_shard 2.
- ``moe-fsdp-2`` (only when named): torchtitan's Qwen3 MoE debug model (``--module qwen3
  --config qwen3_moe_debug``: 8 layers, dim 256, 64 experts, top 8) on 2 ranks,
  ``partial_dtensor``, plain FSDP (experts ``Shard(0)`` on the ``fsdp`` mesh).
- ``moe-ep2-4`` (only when named): the same model on 4 ranks with
  ``--parallelism.expert_parallel_degree 2 --training.disable_cuda_graphs``: each
  block's ``shard_placement_fn`` answers ``ShardPlacementResult``s, the experts' on the
  ``efsdp`` mesh (experts are DTensors on ``ep`` before), the others' on ``fsdp``.
  4-rank reductions need not sum in gloo's order: read the max difference (ours sums
  in rank order; gloo's reduce-scatter in another, shard by shard, so a few elements of
  the 4-way reduced dense parameters differ by an ulp, which the logged losses and
  grad norms of 4 steps do not show but ``--cross-load``'s checkpoint comparison does).
- ``dtensor-moe-ep2-4`` (only when named): the same under ``full_dtensor``; ours raises
  ``NotImplementedError`` (a ``ShardPlacementResult`` mesh together with ``dp_mesh_dims``).
- ``spmd-types-2`` (only when named): torchtitan 0.3.0's default backend, which passes
  plain parameters with spmd_types annotations and ``dp_mesh_dims``; torch 2.13's
  ``fully_shard`` rejects them.

``--cross-load`` checks torchtitan's own checkpointing (``--checkpoint.enable``, a full
training state every ``--save-step`` steps, DCP) across implementations: each
configuration runs four times, torch's and ours uninterrupted for ``--steps`` steps
(saving at the save step), then ours resumed from torch's checkpoint and torch's
resumed from ours for the remaining steps; the summary compares each resumed run's
losses and grad norms with both uninterrupted runs, and the two uninterrupted runs'
checkpoints at the save step entry by entry (keys, shapes, dtypes, values; the
pickled entries by ``==``), e.g. ``--configs dtensor-fsdp-2 --steps 4 --cross-load``.
The last step's save is the model alone. Ours loads and saves through ckpt's
``get_state_dict`` family, which ``install()`` puts under torch's names.

Under ``full_dtensor`` the loss torchtitan logs is the data-parallel degree times the
mean (its own reporting; the grad norms match the plain run's), the same for both.

Run-time patches, applied in the rank processes (site-packages is not edited):

- every process group gets a ``PG_TIMEOUT_S`` timeout (the default one through
  ``--comm.init_timeout_seconds``, DeviceMesh's through c10d's default), and
  ``set_pg_timeouts`` (a barrier on a CUDA device) is skipped;
- ``torchtitan.tools.utils.device_type`` is ``"cpu"`` and its ``device_module`` answers
  torch.cuda's memory, name and synchronize calls (torchtitan falls back to CUDA);
- the debug models' attention (llama3's and qwen3's) is causal SDPA instead of
  FlexAttention, which compiles with inductor (a C++ toolchain and minutes on a CPU);
  the models are otherwise the same;
- torchtitan sets a gradient divide factor of 1.0, which torch's ``fully_shard`` turns
  into ``ReduceOp.PREMUL_SUM(1.0)``, which gloo lacks: every FSDP module also gets
  ``set_force_sum_reduction_for_comms(True)`` (the same sum; ours accepts the call);
- the repository's tokenizer and ``c4_test`` corpus are not in torchtitan's wheel:
  a word-level tokenizer and a random-word corpus are written to a temporary folder.

Each training run is a ``torch.distributed.run`` process group killed after
``--timeout`` seconds; the whole check takes about 3 minutes on 2 busy cores, a MoE
run about a minute, ``--cross-load`` on ``dtensor-fsdp2xtp2`` about 4 minutes.
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
import time
import traceback
import types
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flatparam", "zero_optim", "fsdp", "ckpt")
DTENSOR = ["--parallelism.spmd_backend", "full_dtensor"]
PARTIAL = ["--parallelism.spmd_backend", "partial_dtensor"]
LLAMA = ("llama3", "llama3_debugmodel")
QWEN3_MOE = ("qwen3", "qwen3_moe_debug")
EP2 = ["--parallelism.expert_parallel_degree", "2", "--training.disable_cuda_graphs"]


class Config(NamedTuple):
    """One configuration: rank count, torchtitan arguments, (module, config) to train."""

    ranks: int
    args: list[str]
    model: tuple[str, str] = LLAMA


CONFIGS: dict[str, Config] = {
    "fsdp-2": Config(2, PARTIAL),
    "dtensor-fsdp-2": Config(2, DTENSOR),
    "dtensor-fsdp2xtp2": Config(4, [*DTENSOR, "--parallelism.tensor_parallel_degree", "2"]),
    "dtensor-hsdp2x2": Config(
        4,
        [
            *DTENSOR,
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "2",
        ],
    ),
    # Qwen3 MoE debug model (8 layers, 64 experts, top 8): plain FSDP, and expert
    # parallelism (shard_placement_fn with a mesh per parameter) on 4 ranks
    "moe-fsdp-2": Config(2, PARTIAL, QWEN3_MOE),
    "moe-ep2-4": Config(4, [*PARTIAL, *EP2], QWEN3_MOE),
    "dtensor-moe-ep2-4": Config(4, [*DTENSOR, *EP2], QWEN3_MOE),
}
# torchtitan's own default backend: needs fully_shard to read spmd_types annotations
# on plain tensors, which torch 2.13's does not (not run unless named)
CONFIGS["spmd-types-2"] = Config(2, ["--parallelism.spmd_backend", "spmd_types"])
DEFAULT_CONFIGS = ["fsdp-2", "dtensor-fsdp-2", "dtensor-fsdp2xtp2", "dtensor-hsdp2x2"]
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


def _describe_mesh(mesh: Any) -> str:
    dims = ",".join(f"{n}={s}" for n, s in zip(mesh.mesh_dim_names or (), mesh.shape, strict=False))
    return f"mesh({dims or 'x'.join(str(s) for s in mesh.shape)})"


def _describe_placement(result: Any) -> str:
    """A ``shard_placement_fn`` answer: a placement, None, or a ShardPlacementResult."""
    if result is None:
        return "None (the call's mesh, Shard(0))"
    if not hasattr(result, "mesh_info"):
        return repr(result)
    info = result.mesh_info
    fields = [_describe_mesh(info.mesh)] if hasattr(info, "mesh") else [repr(info)]
    for field in ("shard_mesh_dim", "replicate_mesh_dim"):
        if hasattr(info, field):
            fields.append(f"{field}={getattr(info, field)}")
    return (
        f"{type(result).__name__}(placement={result.placement!r}, "
        f"mesh_info={type(info).__name__}({', '.join(fields)}))"
    )


def _spy_fully_shard(results: dict[str, Any]) -> None:
    """Wrap ``torch.distributed.fsdp.fully_shard`` (torch's or ours) to record its calls.

    Records what torchtitan passes: the module(s), the mesh, ``dp_mesh_dims`` and the
    other keywords, and what the parameters it will manage are before and after.
    """
    import torch.distributed.fsdp as torch_fsdp

    inner = torch_fsdp.fully_shard
    results["fully_shard_impl"] = f"{inner.__module__}.{inner.__qualname__}"
    calls: list[dict[str, Any]] = results["fully_shard"]

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

    def summary(params: list[tuple[str, Any]]) -> dict[str, list[str]]:
        """Kind of tensor -> the parameters of that kind, with their global shapes."""
        out: dict[str, list[str]] = {}
        for name, p in params:
            short = name.replace("_checkpoint_wrapped_module.", "")
            shape = "x".join(str(d) for d in p.shape)
            out.setdefault(_describe_tensor(p), []).append(f"{short}({shape})")
        return out

    def placement_fn_results(fn: Any, params: list[tuple[str, Any]]) -> dict[str, list[str]]:
        """What ``shard_placement_fn`` answers for each parameter, grouped by answer."""
        out: dict[str, list[str]] = {}
        for name, p in params:
            short = name.replace("_checkpoint_wrapped_module.", "")
            out.setdefault(_describe_placement(fn(p)), []).append(short)
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
        fn = kwargs.get("shard_placement_fn")
        if fn is not None:
            record["placement_fn"] = placement_fn_results(fn, params)
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

    from torchtitan.models import llama3
    from torchtitan.models.common.attention import ScaledDotProductAttention

    # FlexAttention compiles a kernel with inductor (a C++ toolchain and minutes on
    # CPU); causal SDPA is the same model without document masking.
    llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()
    from torchtitan.models import qwen3

    qwen3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()

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

    def spy_log(
        self: Any,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
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
        _spy_fully_shard(results)
        from torch.distributed.checkpoint import state_dict as dcp_state_dict

        get = dcp_state_dict.get_model_state_dict
        results["state_dict_impl"] = f"{get.__module__}.{get.__qualname__}"
        _patch_for_cpu(results)
        import torchtitan.train

        sys.argv = ["torchtitan.train", *titan_args]
        torchtitan.train.main()
        code = 0
    except BaseException as exc:  # reported to the driver
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


def _titan_args(
    work: Path, dump: Path, steps: int, config: Config, checkpoint: list[str] | None = None
) -> list[str]:
    """torchtitan's arguments for one run; ``checkpoint`` replaces ``--checkpoint.no-enable``."""
    assets = work / "assets"
    module, name = config.model
    return [
        "--module", module,
        "--config", name,
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
        *(checkpoint if checkpoint is not None else ["--checkpoint.no-enable"]),
        "--metrics.no-enable-tensorboard",
        *config.args,
    ]  # fmt: skip


def _checkpoint_args(folder: Path, interval: int) -> list[str]:
    """torchtitan's own checkpointing: full training state every ``interval`` steps."""
    return [
        "--checkpoint.enable",
        "--checkpoint.folder", str(folder),
        "--checkpoint.interval", str(interval),
        "--checkpoint.keep_latest_k", "0",
        # the last step's save: the model alone (the MoE model's full state is 3.6 GB)
        "--checkpoint.last_save_model_only",
    ]  # fmt: skip


def _compare_checkpoints(ref: Path, ours: Path) -> str:
    """Two DCP checkpoints' entries: the same keys, shapes and dtypes, and equal values.

    Read here (``no_dist``), a few hundred MB of tensors at a time; the pickled entries
    (optimizer hyperparameters, the dataloader's and the scheduler's state) by ``==``.
    """
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    metas = [dcp.FileSystemReader(str(f)).read_metadata().state_dict_metadata for f in (ref, ours)]
    if metas[0].keys() != metas[1].keys():
        only = sorted(metas[0].keys() ^ metas[1].keys())
        return f"keys differ ({len(only)}: {', '.join(only[:4])} ...)"
    tensors = [k for k, m in metas[0].items() if isinstance(m, TensorStorageMetadata)]
    others = [k for k in metas[0] if k not in set(tensors)]
    chunks: list[list[str]] = [others]
    size = 0
    for key in tensors:
        meta = metas[0][key]
        assert isinstance(meta, TensorStorageMetadata)
        nbytes = meta.size.numel() * meta.properties.dtype.itemsize
        if size + nbytes > 1 << 29 or len(chunks) == 1:
            chunks.append([])
            size = 0
        chunks[-1].append(key)
        size += nbytes
    unequal: list[str] = []
    worst = 0.0
    for keys in chunks:
        loaded = []
        for index, folder in enumerate((ref, ours)):
            out: dict[str, Any] = {}
            for key in keys:
                meta = metas[index][key]
                if isinstance(meta, TensorStorageMetadata):
                    out[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
                else:
                    out[key] = None
            if any(isinstance(metas[1 - index][k], TensorStorageMetadata) != (
                    isinstance(metas[index][k], TensorStorageMetadata)) for k in keys):  # fmt: skip
                return "an entry is a tensor in one checkpoint and not in the other"
            dcp.load(out, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
            loaded.append(out)
        for key in keys:
            a, b = loaded[0][key], loaded[1][key]
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                if a.shape != b.shape or a.dtype != b.dtype:
                    unequal.append(f"{key} ({list(a.shape)} {a.dtype} vs {list(b.shape)})")
                elif not torch.equal(a, b):
                    unequal.append(key)
                    worst = max(worst, (a.double() - b.double()).abs().max().item())
            elif a != b:
                unequal.append(f"{key} ({repr(a)[:40]} vs {repr(b)[:40]})")
    if unequal:
        # grouped by what they are: "optimizer.state.layers.3.attention.wo.weight.exp_avg"
        # counts under "optimizer.state.*.attention.wo.weight.exp_avg"
        groups: dict[str, int] = {}
        for key in unequal:
            parts = key.split(" ")[0].split(".")
            kind = ".".join("*" if part.isdigit() else part for part in parts)
            groups[kind] = groups.get(kind, 0) + 1
        listing = ", ".join(f"{n} x {kind}" for kind, n in sorted(groups.items()))
        return (
            f"{len(unequal)} of {len(metas[0])} entries differ (max |diff| {worst:.3g}): {listing}"
        )
    return f"same {len(metas[0])} entries ({len(tensors)} tensors), all equal bit for bit"


def _run_config(
    impl: str, ranks: int, titan_args: list[str], *, tree: Path, work: Path, timeout: float
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
        "HF_HOME": str(work.parent.parent / "hf"),
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


def _steps_equal(ref: list[float], ours: list[float]) -> tuple[bool, float]:
    """Whether two per-step series are equal bit for bit, and their largest difference."""
    if len(ref) != len(ours) or not ref:
        return False, float("nan")
    diff = max(abs(a - b) for a, b in zip(ref, ours, strict=True))
    return all(a == b for a, b in zip(ref, ours, strict=True)), diff


def _placements_after(record: dict[str, Any]) -> list[dict[str, int]]:
    return [call.get("params_after", {}) for call in record.get("fully_shard", [])]


def _verdict(ref: dict[str, Any], ours: dict[str, Any]) -> str:
    """One line: ours against torch's in one configuration."""
    if ref.get("error"):
        return f"torch's run failed: {ref['error']}"
    if ours.get("error"):
        return f"ours raised: {ours['error']}"
    loss_equal, loss_diff = _steps_equal(ref["losses"], ours["losses"])
    norm_equal, norm_diff = _steps_equal(ref["grad_norms"], ours["grad_norms"])
    text = (
        f"losses {'equal bit for bit' if loss_equal else 'NOT equal'} "
        f"(max |diff| {loss_diff:.3g}), grad norms "
        f"{'equal' if norm_equal else 'NOT equal'} (max |diff| {norm_diff:.3g})"
    )
    if _placements_after(ref) != _placements_after(ours):
        text += ", parameter placements after fully_shard DIFFER"
    return text


def _print_steps(by_impl: dict[str, dict[str, Any]]) -> None:
    """Per step: each run's loss (and, for two runs, whether they are equal).

    A resumed run's record has ``first_step`` > 1: its cells before it are blank.
    """
    ok = {impl: r for impl, r in by_impl.items() if not r.get("error")}
    for impl, r in by_impl.items():
        if r.get("error"):
            print(f"  {impl}: ERROR {r['error']}")
    if not ok:
        return

    def at(r: dict[str, Any], key: str, step: int) -> float | None:
        i = step - r.get("first_step", 1)
        return r[key][i] if 0 <= i < len(r[key]) else None

    last = max(r.get("first_step", 1) + len(r["losses"]) - 1 for r in ok.values())
    header = "".join(f"{impl + ' loss':>24}" for impl in ok)
    if len(ok) == 2:
        header += f"{'equal':>7}{'|diff|':>11}"
    print(f"  step{header}   grad norms")
    for step in range(1, last + 1):
        losses = [at(r, "losses", step) for r in ok.values()]
        norms = [at(r, "grad_norms", step) for r in ok.values()]
        cells = "".join(f"{'-' if x is None else repr(x):>24}" for x in losses)
        tail = ""
        if len(ok) == 2 and None not in losses:
            a, b = losses
            tail = f"{'yes' if a == b else 'NO':>7}{abs(a - b):>11.3g}"  # type: ignore[operator]
        norm_text = " ".join("-" if n is None else repr(n) for n in norms)
        print(f"  {step:>4}{cells}{tail}   {norm_text}")


def _resume_verdict(resumed: dict[str, Any], full: dict[str, Any]) -> str:
    """A run resumed from a checkpoint against an uninterrupted run, on the steps after."""
    if resumed.get("error"):
        return f"resumed run failed: {resumed['error']}"
    if full.get("error"):
        return f"uninterrupted run failed: {full['error']}"
    skip = resumed["first_step"] - 1
    loss_equal, loss_diff = _steps_equal(full["losses"][skip:], resumed["losses"])
    norm_equal, norm_diff = _steps_equal(full["grad_norms"][skip:], resumed["grad_norms"])
    return (
        f"steps {skip + 1}..{skip + len(resumed['losses'])}: losses "
        f"{'equal bit for bit' if loss_equal else 'NOT equal'} (max |diff| {loss_diff:.3g}), "
        f"grad norms {'equal' if norm_equal else 'NOT equal'} (max |diff| {norm_diff:.3g})"
    )


def _print_calls(record: dict[str, Any]) -> None:
    """Distinct fully_shard calls of one run, with how often each was made."""
    seen: dict[str, int] = {}
    for call in record.get("fully_shard", []):
        key = json.dumps(call, sort_keys=True)
        seen[key] = seen.get(key, 0) + 1
    for key, count in seen.items():
        call = json.loads(key)
        mesh = call["mesh"]
        dims = zip(mesh["names"], mesh["shape"], strict=False) if mesh else ()
        mesh_text = ", ".join(f"{n}={s}" for n, s in dims)
        print(f"    {count} x fully_shard([{', '.join(call['modules'])}], mesh=({mesh_text}))")
        for k, v in call["kwargs"].items():
            print(f"        {k} = {v}")
        for desc, names in call.get("placement_fn", {}).items():
            print(f"        shard_placement_fn -> {desc}: {len(names)} x {', '.join(names)}")
        if not call["params_before"]:
            print("        (no parameters of its own)")
        for when in ("params_before", "params_after"):
            for desc, names in call.get(when, {}).items():
                print(f"        {when[7:]:6}: {len(names)} x {desc}: {', '.join(names)}")


def _cross_load_runs(
    name: str, args: argparse.Namespace, tree: Path, work: Path
) -> dict[str, dict[str, Any]]:
    """Four runs: each implementation uninterrupted (saving a checkpoint at the save
    step), then each resumed from the other's checkpoint for the remaining steps."""
    config = CONFIGS[name]
    save = args.save_step or args.steps // 2
    runs: dict[str, dict[str, Any]] = {}
    for label, impl, source in (
        ("torch", "torch", None),
        ("ours", "ours", None),
        ("ours<-torch", "ours", "torch"),
        ("torch<-ours", "torch", "ours"),
    ):
        run_dir = work / name / label.replace("<-", "_from_")
        folder = run_dir / "checkpoint"
        if source is not None:
            saved = work / name / source / "checkpoint" / f"step-{save}"
            if not (saved / ".metadata").is_file():
                runs[label] = {"error": f"{source}'s run left no checkpoint at step {save}"}
                continue
            folder.mkdir(parents=True)
            (folder / f"step-{save}").symlink_to(saved)
        titan_args = _titan_args(
            work, run_dir / "dump", args.steps, config, _checkpoint_args(folder, save)
        )
        start = time.monotonic()
        r = _run_config(
            impl, config.ranks, titan_args, tree=tree, work=run_dir, timeout=args.timeout
        )
        if source is not None:
            r["first_step"] = save + 1
        runs[label] = r
        if label == "ours" and not runs["torch"].get("error") and not r.get("error"):
            saved = [work / name / impl / "checkpoint" / f"step-{save}" for impl in IMPLS]
            if all((f / ".metadata").is_file() for f in saved):
                r["checkpoint_vs_torch"] = _compare_checkpoints(*saved)
        status = r.get("error") or f"{len(r.get('losses', []))} steps"
        print(f"[{name} {label}: {status}, {time.monotonic() - start:.0f} s]", flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tree", type=Path, default=ROOT, help="repository whose packages/*/src are 'ours'"
    )
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--steps", type=int, default=3, help="training steps per run")
    parser.add_argument(
        "--cross-load",
        action="store_true",
        help="checkpoint at --save-step with one implementation, resume with the other",
    )
    parser.add_argument("--save-step", type=int, default=0, help="default: --steps // 2")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per training run")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (rank logs)")
    parser.add_argument("--rank-process", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("titan_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tree = args.tree.resolve()
    if args.rank_process:
        raise SystemExit(_rank_main(args.rank_process, tree, args.out, args.titan_args))
    if not (tree / "packages" / "fsdp" / "src" / "fsdp").is_dir():
        raise SystemExit(f"--tree {tree} has no packages/fsdp/src/fsdp: pass a repository root")
    if args.cross_load and not 0 < (args.save_step or args.steps // 2) < args.steps:
        raise SystemExit("--cross-load needs 0 < --save-step < --steps (e.g. --steps 4)")

    work = Path(tempfile.mkdtemp(prefix="torchtitan_check_"))
    try:
        _write_assets(work / "assets")
        results: dict[str, dict[str, dict[str, Any]]] = {}
        for name in args.configs:
            config = CONFIGS[name]
            if args.cross_load:
                results[name] = _cross_load_runs(name, args, tree, work)
                continue
            results[name] = {}
            for impl in args.impls:
                run_dir = work / name / impl
                titan_args = _titan_args(work, run_dir / "dump", args.steps, config)
                start = time.monotonic()
                r = _run_config(
                    impl, config.ranks, titan_args, tree=tree, work=run_dir, timeout=args.timeout
                )
                results[name][impl] = r
                status = r.get("error") or f"{len(r['losses'])} steps"
                print(f"[{name} {impl}: {status}, {time.monotonic() - start:.0f} s]", flush=True)

        print(f"\nours: {tree}; {args.steps} steps per run")
        for name, by_impl in results.items():
            config = CONFIGS[name]
            print(f"\n== {name}: {'/'.join(config.model)}, {config.ranks} ranks, "
                  f"{' '.join(config.args)}")  # fmt: skip
            for impl, r in by_impl.items():
                if "fully_shard_impl" in r:
                    print(f"  {impl}: {r['fully_shard_impl']}, {r['state_dict_impl']}")
            _print_steps(by_impl)
            if "torch" in by_impl and by_impl["torch"].get("fully_shard"):
                print("  fully_shard calls in torch's run (rank 0; before/after: its parameters):")
                _print_calls(by_impl["torch"])

        print("\n== summary (ours against torch's)")
        width = max(len(name) for name in results)
        for name, by_impl in results.items():
            if set(IMPLS) <= set(by_impl):
                print(f"  {name:{width}}  {_verdict(by_impl['torch'], by_impl['ours'])}")
            else:
                for impl, r in by_impl.items():
                    print(f"  {name:{width}}  {impl}: {r.get('error') or 'ran'}")
            if "checkpoint_vs_torch" in by_impl.get("ours", {}):
                print(f"  {name:{width}}  checkpoints at step {args.save_step or args.steps // 2}"
                      f", ours vs torch's: {by_impl['ours']['checkpoint_vs_torch']}")  # fmt: skip
            for resumed, full in (("ours<-torch", "torch"), ("torch<-ours", "ours")):
                for other in (full, resumed[: resumed.index("<")]):
                    if resumed in by_impl and other in by_impl:
                        verdict = _resume_verdict(by_impl[resumed], by_impl[other])
                        print(f"  {name:{width}}  {resumed} vs {other} uninterrupted: {verdict}")
    finally:
        if args.keep:
            print(f"\nwork folder (rank logs): {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
