"""zero_optim works with fsdp, ckpt and torch's own ZeRO absent.

``standalone_step.py`` runs in a fresh interpreter with those modules made
unimportable (``ZERO_OPTIM_BLOCK``), in the parent and in both ranks it spawns,
and trains two ranks with DDP + ours against DDP + the plain optimizer. The
same script is the smoke test to run in a venv holding only the flatparam and
zero_optim wheels (see its docstring); that slower check belongs to
``nox -s build``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("standalone_step.py")


def test_two_rank_step_without_fsdp_ckpt_or_torch_zero() -> None:
    env = {
        **os.environ,
        "ZERO_OPTIM_BLOCK": "fsdp,ckpt,torch.distributed.optim",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    }
    done = subprocess.run(
        [sys.executable, str(SCRIPT)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok: zero_optim" in done.stdout
    assert "with none of ['fsdp', 'ckpt', 'torch.distributed.optim'] imported" in done.stdout
    assert "is importable here" not in done.stdout  # the block did work
