"""PyTorch Lightning (Fabric and Trainer, ``FSDPStrategy``) driving our FSDP on 2 CPU ranks.

The ``compat`` nox session runs these (they need ``lightning``, which the ``tests``
session does not install). For each configuration (sharding strategy x
``use_orig_params`` x Lightning's ``state_dict_type``), a rank trains with gradient
accumulation and gradient clipping uninterrupted; again with a checkpoint half way,
resumed into a model seeded otherwise; and once with torch's own FSDP1 without
Lightning (what Lightning's calls amount to). The resumed losses must equal the
uninterrupted ones exactly, and the training losses torch's FSDP1's: exactly with
``use_orig_params=False``, to 1e-6 relative with ``True`` (see the test).

Two ways of plugging ours in: ``fsdp.torch_compat.install()`` (every name), and
only our class behind torch's name (Lightning's options then reach ours as torch's
option types).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from tests.compat._fabric import fabric_run, torch_reference, trainer_run, unplug
from tests.ranks import run_ranks

pytest.importorskip("lightning")

CONFIGS = list(itertools.product([False, True], ["sharded", "full"]))


def _rank(api: str, how: str, strategy: str, root: str) -> list[dict[str, Any]]:
    import fsdp

    run = fabric_run if api == "fabric" else trainer_run
    out = []
    for orig, sd_type in CONFIGS:
        result = run(how, strategy, orig, sd_type, root)
        assert result["wrapper"] is fsdp.FullyShardedDataParallel, result["wrapper"]
        result["config"] = (orig, sd_type)
        result["wrapper"] = result["wrapper"].__name__
        out.append(result)
    unplug(how)
    trainer = api == "trainer"
    references = {orig: torch_reference(strategy, orig, trainer) for orig in (False, True)}
    for result in out:
        result["torch-same-orig"] = references[result["config"][0]]
    return out


@pytest.mark.parametrize(
    ("api", "how", "strategy"),
    [
        (api, how, strategy)
        for api in ("fabric", "trainer")
        for how, strategy in [
            ("install", "FULL_SHARD"),
            ("install", "SHARD_GRAD_OP"),
            ("install", "NO_SHARD"),
            ("class", "FULL_SHARD"),
        ]
    ],
)
def test_lightning_trains_saves_and_resumes_on_ours(
    api: str, how: str, strategy: str, tmp_path: Path
) -> None:
    for results in run_ranks(_rank, 2, api, how, strategy, str(tmp_path), timeout=240):
        for r in results:
            whole = r["whole"]
            assert r["resumed"] == whole, r  # resumed from the checkpoint: exactly
            n = len(r["torch-same-orig"])
            if not r["config"][0]:
                assert whole[:n] == r["torch-same-orig"], r  # torch's FSDP1: exactly
            else:
                # use_orig_params=True: equal to torch's FSDP1 (same setting) up to an ulp
                # from the second micro-batch of an accumulation on, in some runs; torch's
                # own use_orig_params=True and False differ from each other the same way.
                assert whole[:n] == pytest.approx(r["torch-same-orig"], rel=1e-6, abs=0), r


def _model_parallel_rank(root: str) -> dict[str, Any]:
    from tests.compat._model_parallel import model_parallel_run

    return {impl: model_parallel_run(impl, root) for impl in ("ours", "torch")}


def test_model_parallel_strategy_with_fully_shard(tmp_path: Path) -> None:
    """Lightning's ModelParallelStrategy (FSDP2) with a parallelize_fn calling fully_shard:
    ours trains, saves, resumes exactly and equals torch's fully_shard bit for bit."""
    for result in run_ranks(_model_parallel_rank, 2, str(tmp_path), timeout=240):
        ours, theirs = result["ours"], result["torch"]
        assert ours["ours"] and not theirs["ours"]
        assert ours["resumed"] == ours["whole"]
        assert ours["whole"] == theirs["whole"]
        assert theirs["resumed"] == theirs["whole"]
