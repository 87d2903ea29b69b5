"""The ``ckpt`` program in pipelines and scripts, run as ``python -m ckpt`` subprocesses.

What a script relies on ([Note: a program for scripts] in ``ckpt/_tools/cli.py``): a
closed pipe ends it quietly; ``--json`` on every subcommand, with real JSON values
and a JSON error document; a failed export leaves nothing behind; every problem with
a checkpoint's files has status 4 and names the file; re-export replaces the target
whole or refuses; an unknown target suffix is refused; ``ls`` flags a checkpoint whose
files do not match its manifest; ``verify`` checks plain DCP checkpoints as far as
their metadata allows.

The checkpoints are written once per module in this process (no process group). Each
item runs the real program as a subprocess at least once (3-6 s each on a loaded
2-core machine, most of it importing torch); its other cases call ``main(argv)`` in
this process, which is the same code without the interpreter start.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import ckpt
from ckpt._tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
MANY_KEYS = 3000  # inspect prints a line each: far more than a pipe buffer holds


def _env() -> dict[str, str]:
    extra = [str(p) for p in (ROOT / "packages").glob("*/src")]
    path = os.pathsep.join([*extra, str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def _ckpt(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckpt", *map(str, args)],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=cwd,
        timeout=120,
        check=False,
    )


class _InProcess:
    """``main(argv)``'s status and output, shaped like a finished subprocess."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _main(capsys: pytest.CaptureFixture[str], *args: str | Path) -> _InProcess:
    capsys.readouterr()
    status = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return _InProcess(status, out, err)


def _json(done: subprocess.CompletedProcess[str] | _InProcess) -> Any:
    try:
        return json.loads(done.stdout)
    except ValueError:
        pytest.fail(
            f"not one JSON document (status {done.returncode}):\n{done.stdout}\n{done.stderr}"
        )


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(6)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """run/step_00000001, run/step_00000002 (ckpt), plain (dcp.save) and many (ckpt,
    MANY_KEYS tensors), written once for the module; tests copy what they damage."""
    root = tmp_path_factory.mktemp("saved")
    model = _model()
    values = {"lr": 0.5, "nan": float("nan"), "ids": [1, 2, 3], "name": "run"}
    manager = ckpt.CheckpointManager(root / "run")
    manager.save(1, {"model": model, "step": 1, "cfg": values})
    manager.save(2, {"model": model, "step": 2})
    dcp.save({"model": model.state_dict(), "note": "plain"}, checkpoint_id=root / "plain")
    ckpt.save({f"model.w{i:04d}": torch.zeros(2) for i in range(MANY_KEYS)}, root / "many")
    return root


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _data_file(path: Path) -> Path:
    return max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_closed_pipe_ends_it_quietly(saved: Path) -> None:
    # The reader is gone before the program writes (as `ckpt inspect CK | head` once
    # head has its lines): the first write fails with EPIPE.
    for args in (["inspect", saved / "many"],):
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            done = subprocess.run(
                [sys.executable, "-m", "ckpt", *map(str, args)],
                stdout=write_end,
                stderr=subprocess.PIPE,
                text=True,
                env=_env(),
                timeout=120,
                check=False,
            )
        finally:
            os.close(write_end)
        assert done.returncode == 0, done.stderr
        assert done.stderr == "", done.stderr
    # And a real pipeline: head takes 3 of the thousands of lines.
    shell = subprocess.run(
        f"set -o pipefail; {sys.executable} -m ckpt inspect {saved / 'many'} | head -n 3",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
        check=False,
    )
    assert shell.returncode == 0, shell.stderr
    assert len(shell.stdout.splitlines()) == 3 and shell.stderr == "", shell


def test_json_on_every_subcommand_with_real_values(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shown = _ckpt("inspect", "--json", "--values", saved / "run" / "step_00000001")
    assert shown.returncode == 0, shown.stderr
    doc = _json(shown)
    assert doc["values_read"] is True
    assert doc["objects"] == {
        "step": 1,
        "cfg.lr": 0.5,
        "cfg.nan": {"float": "nan"},  # JSON has no NaN
        "cfg.ids": [1, 2, 3],
        "cfg.name": "run",
    }
    assert doc["tensors"]["model.0.weight"] == {
        "shape": [16, 16],
        "dtype": "float32",
        "bytes": 1024,
        "sharding": "whole",
        "chunks": 1,
    }

    rows = _json(_main(capsys, "ls", "--json", saved / "run"))
    assert [(r["name"], r["status"], r["problems"]) for r in rows] == [
        ("step_00000001", "committed", []),
        ("step_00000002", "committed", []),
    ]
    assert isinstance(rows[0]["bytes"], int) and isinstance(rows[0]["created"], float)

    checked = _main(capsys, "verify", "--json", saved / "run" / "step_00000002")
    assert checked.returncode == 0, checked.stderr
    report = _json(checked)
    assert report["ok"] is True and report["kind"] == "ckpt" and report["problems"] == []
    assert report["files"] == 3 and report["checksum"] == "crc32"  # data, .metadata, index

    exported = _main(
        capsys, "export", "--json", saved / "plain", "--to", tmp_path / "w.safetensors", "-q"
    )
    assert exported.returncode == 0, exported.stderr
    out = _json(exported)
    assert out["format"] == "safetensors" and len(out["files"]) == 1
    assert out["files"][0] == {
        "path": str(tmp_path / "w.safetensors"),
        "tensors": 12,
        "bytes": 6 * (16 * 16 + 16) * 4,
    }

    # A failure is a JSON document too, with the status the program exits with.
    missing = _main(capsys, "inspect", "--json", tmp_path / "nothing")
    assert missing.returncode == 3
    assert _json(missing)["error"]["status"] == 3
    assert _json(missing)["error"]["kind"] == "NotACheckpointError"


def test_a_failed_export_leaves_nothing_behind(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A plain DCP checkpoint whose data file keeps its length but has zeros in the
    # middle: the size check passes, a chunk fails to read half-way through the export.
    broken = _copy(saved / "plain", tmp_path / "broken")
    data = _data_file(broken)
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle - 2048 : middle + 2048] = bytes(4096)
    data.write_bytes(raw)
    out = tmp_path / "out"
    out.mkdir()
    before = _tree(tmp_path)
    for i, (to, extra) in enumerate(
        [
            (out / "new" / "sub" / "model.safetensors", []),
            (out / "sharded", ["--max-shard-size", "2KB"]),
            (out / "model.pt", []),
        ]
    ):
        args = ["export", broken, "--to", to, *extra]
        done = _ckpt(*args) if i == 0 else _main(capsys, *args)
        assert done.returncode == 4, (to, done.stdout, done.stderr)
        assert data.name in done.stderr, done.stderr  # names the file
        assert _tree(tmp_path) == before, (to, _tree(out))  # no .tmp, .partial, folders


def test_missing_or_truncated_files_exit_4_naming_the_file(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lost = _copy(saved / "plain", tmp_path / "lost")
    _data_file(lost).unlink()
    for i, args in enumerate(
        [
            ["export", lost, "--to", tmp_path / "a.safetensors"],
            ["export", "--no-verify", lost, "--to", tmp_path / "b.safetensors"],
            ["verify", lost],
            ["inspect", "--values", lost],
        ]
    ):
        done = _ckpt(*args) if i == 0 else _main(capsys, *args)
        assert done.returncode == 4, (args, done.stdout, done.stderr)
        text = done.stdout + done.stderr
        assert "__0_0.distcp" in text and "missing" in text, (args, text)
        assert "Errno" not in text, text
    short = _copy(saved / "run" / "step_00000001", tmp_path / "short")
    data = _data_file(short)
    data.write_bytes(data.read_bytes()[:-10])
    done = _main(capsys, "export", short, "--to", tmp_path / "c.safetensors")
    assert done.returncode == 4 and f"{data.name}: size: truncated" in done.stderr, done.stderr
    assert not (tmp_path / "c.safetensors").exists()


def test_re_export_replaces_the_target_whole_or_refuses(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf_dir = tmp_path / "hf"
    first = _main(capsys, "export", saved / "plain", "--to", hf_dir, "--max-shard-size", "2KB")
    assert first.returncode == 0, first.stderr
    (hf_dir / "config.json").write_text("{}")  # the user's file beside the export
    shards_before = sorted(p.name for p in hf_dir.glob("model-*.safetensors"))
    assert len(shards_before) > 2

    refused = _ckpt("export", saved / "plain", "--to", hf_dir)
    assert refused.returncode == 2, refused.stderr
    assert "already holds an export" in refused.stderr and "--overwrite" in refused.stderr
    assert sorted(p.name for p in hf_dir.glob("model-*.safetensors")) == shards_before

    again = _main(capsys, "export", saved / "plain", "--to", hf_dir, "--overwrite")
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in hf_dir.iterdir()) == [
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    weights = load_file(hf_dir / "model-00001-of-00001.safetensors")
    assert torch.equal(weights["0.weight"], _model().state_dict()["0.weight"])

    single = tmp_path / "one.safetensors"
    assert _main(capsys, "export", saved / "plain", "--to", single).returncode == 0
    assert _main(capsys, "export", saved / "plain", "--to", single).returncode == 2
    assert _main(capsys, "export", saved / "plain", "--to", single, "--overwrite").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "one.safetensors"]


def test_an_unknown_target_suffix_is_refused(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    done = _ckpt("export", saved / "plain", "--to", tmp_path / "m.onnx")
    assert done.returncode == 2, done
    assert "'.onnx' is not a format ckpt writes" in done.stderr and "--format" in done.stderr
    assert list(tmp_path.iterdir()) == []
    chosen = _main(
        capsys, "export", saved / "plain", "--to", tmp_path / "m.onnx", "--format", "torch"
    )
    assert chosen.returncode == 0, chosen.stderr  # an explicit format is taken as asked
    assert set(torch.load(tmp_path / "m.onnx", weights_only=True)) == set(_model().state_dict())


def test_ls_flags_a_checkpoint_whose_files_do_not_match(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(saved / "run", tmp_path / "run")
    data = _data_file(run / "step_00000002")
    data.write_bytes(data.read_bytes()[:100])  # truncated
    shutil.copytree(saved / "plain", run / "plain")
    (run / "plain" / "__0_0.distcp").unlink()
    done = _ckpt("ls", "--json", run)
    assert done.returncode == 4, done
    rows = {r["name"]: r for r in _json(done)}
    assert rows["step_00000001"]["status"] == "committed"
    assert rows["step_00000002"]["status"] == "damaged"
    (problem,) = rows["step_00000002"]["problems"]
    assert problem["file"] == data.name and problem["kind"] == "size"
    assert problem["detail"].startswith("truncated: 100 bytes on disk")
    assert rows["plain"]["status"] == "damaged"
    assert rows["plain"]["problems"][0]["kind"] == "missing"
    text = _main(capsys, "ls", run)
    assert text.returncode == 4 and "DAMAGED" in text.stdout and data.name in text.stdout
    assert _main(capsys, "ls", saved / "run").returncode == 0  # the untouched originals


def test_verify_checks_a_plain_dcp_checkpoint_by_its_metadata(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ok = _main(capsys, "verify", saved / "plain")
    assert ok.returncode == 0, ok.stderr
    assert "ok as far as a plain DCP checkpoint can be checked" in ok.stdout
    short = _copy(saved / "plain", tmp_path / "short")
    data = _data_file(short)
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[: size // 2])
    done = _ckpt("verify", "--json", short)
    assert done.returncode == 4, done.stderr
    (problem,) = _json(done)["problems"]
    assert problem["file"] == "__0_0.distcp" and problem["kind"] == "size"
    assert f"truncated: {size // 2} bytes on disk" in problem["detail"]
