"""State dicts: torch's layout, consolidated on one rank, loadable at another world size.

Saved at world size 2 after five steps, then loaded at world sizes 4 and 1: the
loaded optimizer must hold exactly the saved state (consolidating it again
gives it back bit for bit) and must then train exactly like DDP with the plain
optimizer that loaded the same state dict.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.ranks import run_ranks
from tests.zero_optim._common import (
    OPTIMIZERS,
    OURS,
    OURS_BUCKETS,
    PLAIN,
    TORCH_ZERO,
    assert_same,
    build,
    train,
)
from zero_optim import ZeroRedundancyOptimizer

SCENARIO = "groups"  # two groups, a frozen weight, a scheduler editing the LR


def assert_state_dicts_equal(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """Same layout (keys, indices, hyperparameters) and bitwise-equal state tensors."""
    assert got["param_groups"] == want["param_groups"], what
    assert sorted(got["state"]) == sorted(want["state"]), what
    for index, state in want["state"].items():
        assert sorted(got["state"][index]) == sorted(state), (what, index)
        for key, value in state.items():
            other = got["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(other.cpu(), value.cpu()), (what, index, key)
            else:
                assert other == value, (what, index, key)


def _save_rank(folder: str) -> None:
    rank = dist.get_rank()
    for opt_name in OPTIMIZERS:
        _, plain = train(PLAIN, opt_name, SCENARIO, steps=5)
        _, torch_zero = train(TORCH_ZERO, opt_name, SCENARIO, steps=5)
        params, ours = train(OURS, opt_name, SCENARIO, steps=5)
        assert isinstance(ours, ZeroRedundancyOptimizer)
        assert isinstance(torch_zero, torch.distributed.optim.ZeroRedundancyOptimizer)
        torch_zero.consolidate_state_dict(to=0)
        ours.consolidate_state_dict(to=1)
        if rank == 1:
            torch.save(ours.state_dict(), Path(folder) / f"{opt_name}.to1.pt")
        else:
            with pytest.raises(RuntimeError, match=r"call consolidate_state_dict\(to=0\)"):
                ours.state_dict()
        ours.consolidate_state_dict(to=0)
        if rank != 0:
            continue
        saved = ours.state_dict()
        # torch's Optimizer layout exactly: the plain optimizer's own state dict
        # and torch's ZeRO's consolidated one are the same dict.
        assert_state_dicts_equal(saved, plain.state_dict(), f"{opt_name}: ours vs plain")
        assert_state_dicts_equal(saved, torch_zero.state_dict(), f"{opt_name}: ours vs torch")
        torch.save({"optim": saved, "params": params}, Path(folder) / f"{opt_name}.pt")


def _load_rank(folder: str) -> None:
    for opt_name in OPTIMIZERS:
        saved = torch.load(Path(folder) / f"{opt_name}.pt", weights_only=False)
        on_one = torch.load(Path(folder) / f"{opt_name}.to1.pt", weights_only=False)
        assert_state_dicts_equal(on_one, saved["optim"], "consolidated on rank 1 vs on 0")
        results = {}
        for variant in (PLAIN, OURS, OURS_BUCKETS):
            built = build(variant, opt_name, SCENARIO)
            model, _, opt = built
            with torch.no_grad():
                for p, value in zip(model.parameters(), saved["params"], strict=True):
                    p.copy_(value)
            opt.load_state_dict(copy.deepcopy(saved["optim"]))
            if isinstance(opt, ZeroRedundancyOptimizer):
                opt.consolidate_state_dict(to=0)
                if dist.get_rank() == 0:
                    assert_state_dicts_equal(
                        opt.state_dict(), saved["optim"], f"{opt_name}/{variant} round trip"
                    )
            results[variant], _ = train(variant, opt_name, SCENARIO, 5, first_step=5, built=built)
        for variant in (OURS, OURS_BUCKETS):
            assert_same(results[variant], results[PLAIN], f"{opt_name}/{variant} after loading")


@pytest.fixture(scope="module")
def saved_at_two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """State dicts saved at world size 2 (the saving ranks check the layout)."""
    folder = tmp_path_factory.mktemp("zero_state")
    run_ranks(_save_rank, 2, str(folder), timeout=120)
    return folder


@pytest.mark.parametrize("load_world_size", [4, 1])
def test_saved_at_two_loads_at_other_world_sizes(saved_at_two: Path, load_world_size: int) -> None:
    run_ranks(_load_rank, load_world_size, str(saved_at_two), timeout=120)
