"""examples/train.py end to end: it trains, stops cleanly on SIGINT with a checkpoint,
resumes at world sizes 2 and 1 with the losses of an uninterrupted run, and exits with
a clear message when a rank dies. Plus its pure pieces (data order, config checks,
corpus) in one process.

The program is launched the way a user launches it: ``torchrun`` in a subprocess, with
a hard timeout. Each launch costs a few seconds of interpreter start, so launches that
do not depend on each other run concurrently, and the model is tiny.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

pytest.importorskip("rich", reason="the example needs rich (add it to the tests session)")
pytest.importorskip("matplotlib", reason="the example needs matplotlib (tests session)")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TRAIN = EXAMPLES / "train.py"
sys.path.insert(0, str(EXAMPLES))

from tinygpt.config import TrainConfig, parse_config  # noqa: E402
from tinygpt.data import BatchSampler, epoch_windows, rank_slice  # noqa: E402

LAUNCH_TIMEOUT = 120  # seconds; a launch normally takes 5-10
TINY = [
    "--wrapper", "ddp", "--steps", "8", "--batch-size", "8", "--grad-accum", "2",
    "--seq-len", "32", "--n-layer", "2", "--n-head", "2", "--d-model", "32",
    "--warmup-steps", "2", "--log-every", "2", "--eval-windows", "8",
    "--sample-lines", "1", "--sample-chars", "16", "--no-progress",
]  # fmt: skip


class Launch:
    """One ``torchrun`` of train.py in its own session, so a timeout kills it all."""

    def __init__(self, nproc: int, args: Sequence[str], cwd: Path) -> None:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), str(TRAIN), *args,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip

    def finish(self) -> tuple[int, str]:
        """Exit code and combined output; kills the whole launch on timeout."""
        try:
            out, _ = self.proc.communicate(timeout=LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, _ = self.proc.communicate()
            pytest.fail(f"train.py did not finish in {LAUNCH_TIMEOUT} s:\n{out[-4000:]}")
        return self.proc.returncode, out


def losses(out_dir: Path) -> dict[int, float]:
    """step -> loss from a run's metrics.jsonl (a resumed run's holds the whole curve)."""
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.mark.slow
def test_train_interrupt_resume_at_two_world_sizes(tmp_path: Path) -> None:
    # Uninterrupted reference, and a run that rank 1 interrupts with SIGINT in step 3.
    ref = Launch(2, [*TINY, "--out-dir", "ref"], tmp_path)
    cut = Launch(
        2,
        [*TINY, "--out-dir", "cut", "--inject-sigint-at-step", "3", "--inject-rank", "1"],
        tmp_path,
    )
    rc_ref, out_ref = ref.finish()
    rc_cut, out_cut = cut.finish()
    assert rc_ref == 0, out_ref
    assert rc_cut != 0, out_cut  # interrupted: 130 from the workers, reported by torchrun
    assert "stopped after step 3" in out_cut, out_cut
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step-0000003"]

    full = losses(tmp_path / "ref")
    assert sorted(full) == list(range(1, 9))
    assert full[8] < full[1] - 0.3, f"the loss did not fall: {full}"
    assert (tmp_path / "ref" / "train.png").stat().st_size > 0
    assert "run summary" in out_ref and "--- sample 1 ---" in out_ref
    assert losses(tmp_path / "cut") == {s: full[s] for s in (1, 2, 3)}  # same run so far

    # Resume the interrupted run at world size 2 and, from a copy, at world size 1.
    shutil.copytree(tmp_path / "cut", tmp_path / "cut1")
    at2 = Launch(2, [*TINY, "--out-dir", "cut", "--resume"], tmp_path)
    at1 = Launch(1, [*TINY, "--out-dir", "cut1", "--resume"], tmp_path)
    rc2, out2 = at2.finish()
    rc1, out1 = at1.finish()
    assert rc2 == 0, out2
    assert rc1 == 0, out1
    assert "resumed from" in out2 and "saved by 2 ranks, now 1" in out1

    # Same world size: the same computation, so the same bits.
    resumed2 = losses(tmp_path / "cut")
    assert resumed2 == full, (resumed2, full)
    # Another world size: the same global batches, split differently; float rounding.
    resumed1 = losses(tmp_path / "cut1")
    assert sorted(resumed1) == list(range(1, 9))
    for step in range(4, 9):
        assert resumed1[step] == pytest.approx(full[step], rel=1e-5, abs=1e-5), step


@pytest.mark.slow
def test_train_a_dead_rank_stops_the_others(tmp_path: Path) -> None:
    crash = Launch(
        2,
        [*TINY, "--out-dir", "crash", "--inject-crash-at-step", "3", "--inject-rank", "1",
         "--pg-timeout", "30"],
        tmp_path,
    )  # fmt: skip
    rc, out = crash.finish()
    assert rc != 0, out
    assert "[rank 1] --inject-crash-at-step 3: dying" in out
    # Rank 0 either reports the broken collective itself or is stopped by torchrun
    # first; either way the launch ends well within the process-group timeout.
    assert "another rank died" in out or "SIGTERM" in out, out


def test_train_refuses_bad_config() -> None:
    cfg = TrainConfig(wrapper="ddp", batch_size=12, grad_accum=2)
    with pytest.raises(ValueError, match=r"--batch-size\(12\) % \(WORLD_SIZE\(4\) \* "):
        cfg.check_world_size(4)
    cfg.check_world_size(3)  # 12 % (3 * 2) == 0
    with pytest.raises(ValueError, match=r"--d-model\(100\) % --n-head\(3\)"):
        TrainConfig(d_model=100, n_head=3)
    with pytest.raises(ValueError, match="--strategy applies to --wrapper fsdp only"):
        TrainConfig(wrapper="ddp", strategy="FULL_SHARD")
    with pytest.raises(ValueError, match="--resume and --overwrite"):
        TrainConfig(resume=True, overwrite=True)
    with pytest.raises(SystemExit):
        parse_config(["--nproc-per-node", "2"])
    assert parse_config(["--wrapper", "ddp", "--steps", "5"]).steps == 5


def test_batches_do_not_depend_on_world_size_and_resume_exactly() -> None:
    # The ranks' slices of every step tile that step's global batch, in order.
    sampler = BatchSampler(num_tokens=5_000, seq_len=16, seed=3)
    batches = [sampler.next_batch(12) for _ in range(40)]  # crosses epochs (312/epoch)
    assert sampler.epoch >= 1
    for batch in batches:
        for world in (1, 2, 3, 4):
            parts = [rank_slice(batch, r, world) for r in range(world)]
            assert torch.equal(torch.cat(parts), batch)
    # The first epoch's batches visit each of its windows once, all inside the text.
    epoch0 = epoch_windows(5_000, 16, seed=3, epoch=0)
    assert torch.equal(torch.cat(batches)[: len(epoch0)], epoch0)
    assert len(set(epoch0.tolist())) == len(epoch0) >= (5_000 - 1 - 15) // 16
    assert int(epoch0.min()) >= 0 and int(epoch0.max()) + 16 + 1 <= 5_000
    # A sampler restored from the state after 25 batches continues identically.
    replay = BatchSampler(num_tokens=5_000, seq_len=16, seed=3)
    for _ in range(25):
        replay.next_batch(12)
    restored = BatchSampler(num_tokens=5_000, seq_len=16, seed=3)
    restored.load_state_dict(replay.state_dict())
    for batch in batches[25:]:
        assert torch.equal(restored.next_batch(12), batch)
    with pytest.raises(ValueError, match="resume with --seed 3"):
        BatchSampler(num_tokens=5_000, seq_len=16, seed=4).load_state_dict(replay.state_dict())


def test_shipped_corpus_is_the_generated_one() -> None:
    sys.path.insert(0, str(EXAMPLES / "data"))
    try:
        import make_corpus
    finally:
        sys.path.remove(str(EXAMPLES / "data"))
    shipped = (EXAMPLES / "data" / "corpus.txt").read_text(encoding="ascii")
    assert make_corpus.generate() == shipped
    assert 200_000 < len(shipped) < 500_000
