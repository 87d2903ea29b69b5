"""examples/minimal/: each script runs under torchrun on 2 CPU ranks (gloo), checkpoints
through ckpt, and a second launch with more steps resumes from the newest checkpoint
and prints the losses an uninterrupted run prints.

Launched exactly as the README says (``torchrun --standalone --nproc-per-node 2``, here
as ``python -m torch.distributed.run``, which is what the ``torchrun`` script runs), in
a subprocess with a hard timeout. The uninterrupted run and the first half run side by
side.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.process_tree import kill_tree

MINIMAL = Path(__file__).resolve().parent.parent / "examples" / "minimal"
SCRIPTS = ["fsdp1.py", "ddp_zero.py", "fully_shard.py"]
TIMEOUT = 240  # seconds per launch; one takes 10-30 s on a loaded 2-core machine


def _torchrun(script: str, *args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", str(MINIMAL / script), *args,
        ],
        cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # the ranks too: the agent starts them in sessions of their own
        out, _ = proc.communicate()
        pytest.fail(f"no result in {TIMEOUT} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    return out


def _losses(out: str) -> dict[int, str]:
    """step -> the loss as printed (six decimals): equal runs print equal text."""
    return {int(s): loss for s, loss in re.findall(r"^step (\d+) loss ([\d.]+),", out, re.M)}


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_minimal_example_trains_saves_and_resumes(script: str, tmp_path: Path) -> None:
    full = _torchrun(script, "--steps", "40", "--out", "full", cwd=tmp_path)
    half = _torchrun(script, "--steps", "20", cwd=tmp_path)  # the default --out
    out_full, out_half = _finish(full), _finish(half)
    resumed = _finish(_torchrun(script, "--steps", "40", cwd=tmp_path))

    want = _losses(out_full)
    assert sorted(want) == [10, 20, 30, 40], out_full
    assert float(want[40]) < float(want[10]) / 2, f"the loss did not fall: {want}"
    assert _losses(out_half) == {10: want[10], 20: want[20]}, out_half
    run = tmp_path / "runs" / f"minimal-{Path(script).stem.replace('_', '-')}"
    assert f"resumed from {run / 'checkpoints' / 'step_00000020'}" in resumed, resumed
    assert _losses(resumed) == {30: want[30], 40: want[40]}, resumed
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert kept == ["step_00000030", "step_00000040"]  # keep_last=2
