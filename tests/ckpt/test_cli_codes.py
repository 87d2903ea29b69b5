"""The ``ckpt`` program's exit codes and listings, called in-process (``main(argv)``).

The subprocess tests (``test_cli.py``) cover the real program on real checkpoints;
these cover every outcome a script may branch on, cheaply.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckpt
from ckpt._tools.cli import EXIT_CORRUPT, EXIT_NOT_A_CHECKPOINT, EXIT_UNTRUSTED, main
from tests.ckpt._forge import rehash_manifest

KEY = b"a key of at least sixteen bytes"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def test_ls_lists_steps_and_partial_saves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manager = ckpt.CheckpointManager(tmp_path / "run")
    manager.save(1, {"model": _model()})
    manager.save(2, {"model": _model()})
    (tmp_path / "run" / ".step_00000003.partial").mkdir()
    assert main(["ls", "--json", str(tmp_path / "run")]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["step_00000001", "step_00000002", ".step_00000003.partial"]
    assert rows[0]["world_size"] == 1 and rows[0]["saved_by"] == "model=torch.Linear"
    assert rows[2]["status"].startswith("partial")
    assert main(["ls", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "step_00000002" in out and "partial" in out


def test_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c"
    ckpt.save({"model": _model()}, path, key=KEY)
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    assert main(["verify", str(path), "--key-file", str(key_file)]) == 0
    assert "signature ok" in capsys.readouterr().out
    wrong = tmp_path / "wrong"
    wrong.write_bytes(b"another key of sixteen bytes")
    assert main(["verify", str(path), "--key-file", str(wrong)]) == EXIT_UNTRUSTED
    assert main(["inspect", str(tmp_path / "nothing")]) == EXIT_NOT_A_CHECKPOINT
    assert main(["verify", str(tmp_path)]) == EXIT_NOT_A_CHECKPOINT
    data = next(path.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-1])  # truncated
    capsys.readouterr()
    assert main(["verify", str(path)]) == EXIT_CORRUPT
    assert "truncated" in capsys.readouterr().out
    assert main(["export", str(path), "--to", str(tmp_path / "o.safetensors")]) == EXIT_CORRUPT
    rehash_manifest(path)  # a forger's manifest: the plain check passes, the key does not
    assert main(["verify", str(path)]) == 0
    assert main(["verify", str(path), "--key-file", str(key_file)]) == EXIT_UNTRUSTED
    with pytest.raises(SystemExit) as usage:
        main(["export", str(path)])  # --to missing
    assert usage.value.code == 2
