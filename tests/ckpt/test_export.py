"""``ckpt export``: names, shards, dtypes, chunk layouts, and its memory bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file

import ckpt
from ckpt._format.reader import CheckpointReader
from ckpt._tools.export import _strip_wrappers, export, parse_size, plan_shards
from tests.ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def test_parse_size_and_plan_shards() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1000") == 1000
    with pytest.raises(ValueError, match="5GB"):
        parse_size("lots")
    sizes = {"a": 4, "b": 4, "c": 10, "d": 1}
    assert plan_shards(sizes, 8) == [["a", "b"], ["c"], ["d"]]
    assert plan_shards(sizes, None) == [["a", "b", "c", "d"]]


def test_wrapper_names_are_removed() -> None:
    assert _strip_wrappers("module.layer.weight") == "layer.weight"
    assert _strip_wrappers("_orig_mod.h.0._fsdp_wrapped_module.w") == "h.0.w"
    assert _strip_wrappers("block.module.weight") == "block.module.weight"


def test_formats_dtype_and_entry(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    model.register_buffer("count", torch.arange(4))
    ddp_like = torch.nn.ModuleDict({"module": model})  # keys "module.0.weight", ...
    ckpt.save({"model": ddp_like, "step": 1}, tmp_path / "c")
    reader = CheckpointReader(tmp_path / "c")
    expected = model.state_dict()

    export(reader, tmp_path / "one.safetensors")
    one = load_file(tmp_path / "one.safetensors")
    assert one.keys() == expected.keys()
    assert all(torch.equal(one[k], v) for k, v in expected.items())

    export(reader, tmp_path / "half", dtype=torch.bfloat16, max_shard_size=100)
    index = json.loads((tmp_path / "half" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(
        v.numel() * (2 if v.is_floating_point() else 8) for v in expected.values()
    )
    for name, file in index["weight_map"].items():
        with safe_open(tmp_path / "half" / file, "pt") as f:
            got = f.get_tensor(name)
        want = expected[name]
        want = want.to(torch.bfloat16) if want.is_floating_point() else want
        assert got.dtype == want.dtype and torch.equal(got, want), name

    export(reader, tmp_path / "m.pt")
    saved = torch.load(tmp_path / "m.pt", weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in expected.items())

    with pytest.raises(ckpt.CheckpointError, match="entries are model"):
        export(reader, tmp_path / "x.safetensors", entry="optim")


def _rank_save_2d(path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    cols = distribute_tensor(full, mesh, [Shard(1)])  # column chunks: not row-tiled
    rows = distribute_tensor(full * 2, mesh, [Shard(0)])
    dcp.save({"w": cols, "r": rows}, checkpoint_id=path)


def test_column_chunks_are_assembled(tmp_path: Path) -> None:
    run_ranks(_rank_save_2d, 2, str(tmp_path / "d"))
    reader = CheckpointReader(tmp_path / "d")
    info = reader.tensors()
    assert info["w"].sharding == "2 chunks" and info["r"].sharding == "2 row chunks"
    export(reader, tmp_path / "o.safetensors")
    out = load_file(tmp_path / "o.safetensors")
    full = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    assert torch.equal(out["w"], full) and torch.equal(out["r"], full * 2)


def _peak_rss_of_export(path: Path, out: Path, *args: str) -> int:
    """Peak resident bytes of ``python -m ckpt export`` (ru_maxrss of the child)."""
    env = {
        **os.environ,
        # A fixed mmap threshold: every block of 1 MiB or more is mapped and unmapped when
        # freed. glibc's dynamic threshold otherwise rises after the first large free and
        # keeps later 16 MiB tensors in its heap after they are freed, so the peak counted a
        # freed tensor too, depending on which thread's arena served it (CI saw 43 MiB once).
        "MALLOC_MMAP_THRESHOLD_": str(1024 * 1024),
        "PYTHONPATH": os.pathsep.join(
            [*(str(p) for p in (ROOT / "packages").glob("*/src")), os.environ.get("PYTHONPATH", "")]
        ),
    }
    code = (
        "import resource, subprocess, sys\n"
        "rc = subprocess.run([sys.executable, '-m', 'ckpt', 'export', *sys.argv[1:]]).returncode\n"
        "assert rc == 0, rc\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path), "--to", str(out), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    return int(done.stdout.split()[-1]) * 1024  # Linux reports KiB


@pytest.mark.timeout(300)
def test_export_memory_is_largest_tensor_plus_buffer(tmp_path: Path) -> None:
    """8 tensors of 16 MiB (128 MiB) exported with a 4 MiB buffer to bf16: the peak
    grows over a tiny checkpoint's by less than one tensor + one buffer + 16 MiB of
    slack (allocator and page granularity), far below the model's size."""
    big = {f"model.w{i}": torch.full((4 * MiB,), float(i)) for i in range(8)}  # 16 MiB each
    ckpt.save(big, tmp_path / "big")
    ckpt.save({"model.w0": torch.ones(4)}, tmp_path / "small")
    args = ("--buffer-size", "4MiB", "--dtype", "bf16")
    small_peak = _peak_rss_of_export(tmp_path / "small", tmp_path / "s.safetensors", *args)
    big_peak = _peak_rss_of_export(tmp_path / "big", tmp_path / "b.safetensors", *args)
    growth = big_peak - small_peak
    print(
        f"export peak RSS: tiny checkpoint {small_peak / MiB:.1f} MiB, 128 MiB model "
        f"{big_peak / MiB:.1f} MiB, growth {growth / MiB:.1f} MiB"
    )
    assert growth < 16 * MiB + 4 * MiB + 16 * MiB, growth / MiB
    with safe_open(tmp_path / "b.safetensors", "pt") as f:
        for i in range(8):
            t = f.get_slice(f"w{i}")
            assert t.get_dtype() == "BF16"
            assert torch.equal(t[:3], torch.full((3,), float(i), dtype=torch.bfloat16))
