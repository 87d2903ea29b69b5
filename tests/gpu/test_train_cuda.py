"""examples/train.py on CUDA: ours against torch's FSDP1 and ZeRO, same losses.

``torchrun`` with one rank per GPU (two when there are two, else one), the tiny
model of ``tests/test_train_example.py``; each run's losses from its
metrics.jsonl. With the same data, seed and arithmetic order, ours and torch's
agree within float32 reduction-order noise (2e-6 relative, the tolerance that
file explains).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu._common import needs_cuda

pytestmark = needs_cuda


@pytest.mark.parametrize("wrapper", ["fsdp", "ddp-zero"])
def test_train_ours_vs_torch_on_cuda(tmp_path: Path, wrapper: str) -> None:
    from tests.test_train_example import OTHER_WORLD_REL, TINY, Launch, losses

    nproc = min(2, torch.cuda.device_count())
    args = [*TINY, "--device", "cuda", "--wrapper", wrapper]
    runs = {
        impl: Launch(nproc, [*args, "--impl", impl, "--out-dir", impl], tmp_path)
        for impl in ("ours", "torch")
    }
    for impl, run in runs.items():
        code, out = run.finish()
        assert code == 0, f"{impl}:\n{out[-4000:]}"
    ours, theirs = losses(tmp_path / "ours"), losses(tmp_path / "torch")
    assert sorted(ours) == sorted(theirs)
    for step, loss in theirs.items():
        assert ours[step] == pytest.approx(loss, rel=OTHER_WORLD_REL), (step, ours, theirs)
