"""Checkpoints of models sharded across replicas ([Note: sharding across replicas]).

Such a model's state is laid out as plain sharding over all its ranks, so its
checkpoints are those of ``FULL_SHARD`` / 1-D ``fully_shard`` over the world: written
on 4 ranks (2 replicas x 2) they resume on 2 ranks under plain sharding, and a
checkpoint written on 2 ranks resumes on 4 sharded across replicas; by ``ckpt.save`` /
``ckpt.load`` on disk and by torch's state-dict API (``get_state_dict`` /
``set_state_dict``, ckpt's). Every rank trains on the same batch (``_wrappers.py``),
so the two steps after resuming and the weights after them equal the uninterrupted
run's bit for bit.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch.distributed as dist

import ckpt
from tests.ckpt._wrappers import full_weights, resumes_from, same, train, wrap
from tests.ranks import run_ranks

ACROSS = ("fsdp-across", "fully_shard-across")
PLAIN = ("fsdp", "fully_shard")


def _rank_save(root: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in kinds:
        model, optim = wrap(kind)
        train(model, optim, 0, 3)
        ckpt.save({"model": model, "optim": optim, "step": 3}, Path(root) / kind)
        # torch's state-dict API: full state dicts, kept in memory for the resume below
        msd, osd = ckpt.get_state_dict(
            model, optim, options=ckpt.StateDictOptions(full_state_dict=True)
        )
        fresh, fresh_optim = wrap(kind, seed=9)
        # A copy: torch's optimizers take tensors like the step counts by reference.
        msd, osd = copy.deepcopy((msd, osd))
        ckpt.set_state_dict(fresh, fresh_optim, model_state_dict=msd, optim_state_dict=osd)
        api = train(fresh, fresh_optim, 3, 5), full_weights(fresh)
        losses = train(model, optim, 3, 5)
        weights = full_weights(model)
        out[kind] = (losses, weights)
        out[f"{kind} api"] = api[0] == losses and same(api[1], weights)
    return out


def _rank_resume(root: str, expected: dict[str, Any], sources: tuple[str, ...]) -> dict[str, bool]:
    kinds = PLAIN if dist.get_world_size() == 2 else ACROSS
    results: dict[str, bool] = {}
    for source in sources:
        losses, weights = expected[source]
        folder = Path(root) / source
        for kind in kinds:
            results[f"{source} -> {kind}"] = resumes_from(folder, kind, losses, weights)
    return results


def test_checkpoints_move_between_world_sizes(tmp_path: Path) -> None:
    across = run_ranks(_rank_save, 4, str(tmp_path), ACROSS, timeout=120)[0]
    plain = run_ranks(_rank_save, 2, str(tmp_path), PLAIN, timeout=120)[0]
    for kind in (*ACROSS, *PLAIN):
        expected = across if kind in ACROSS else plain
        assert expected[f"{kind} api"], f"{kind}: get_state_dict -> set_state_dict resume differs"
    for world, expected, sources in ((2, across, ACROSS), (4, plain, PLAIN)):
        for results in run_ranks(_rank_resume, world, str(tmp_path), expected, sources):
            assert len(results) == 4
            assert all(results.values()), {k: v for k, v in results.items() if not v}
