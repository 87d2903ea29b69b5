"""The sorted-greedy partition and the state-dict translations, in one process."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zero_optim import Partition, sorted_greedy_partition
from zero_optim._state_dict import (
    check_full_state_dict,
    full_state_dict,
    local_state_dict,
    owned_global_indices,
)

group_sizes = st.lists(st.lists(st.integers(0, 1000), max_size=12), min_size=1, max_size=4)


def _reference(group_sizes: list[list[int]], world_size: int) -> list[list[list[int]]]:
    """The loop exactly as torch's ZeroRedundancyOptimizer runs it, on sizes."""
    loads = [0] * world_size
    out = []
    for sizes in group_sizes:
        per_rank: list[list[int]] = [[] for _ in range(world_size)]
        order = sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True)
        for i in order:
            rank = min(range(world_size), key=lambda r: (loads[r], r))
            per_rank[rank].append(i)
            loads[rank] += sizes[i]
        out.append(per_rank)
    return out


def test_worked_example() -> None:
    # Largest first, each to the lightest rank: 10 -> r0, 8 -> r1, 5 -> r1 (8 < 10),
    # 3 -> r0 (10 < 13), 3 -> r0 (13 == 13, lowest rank wins).
    p = sorted_greedy_partition([[3, 10, 5, 8, 3]], 2)
    assert p.members == (((1, 0, 4), (3, 2)),)
    assert p.owners == ((0, 0, 1, 1, 0),)
    assert p.numel_per_rank == (16, 13)
    assert p.owned(0) == [(0, 1), (0, 0), (0, 4)]


def test_loads_carry_over_between_groups() -> None:
    # Group 1's single parameter goes to the rank left lighter by group 0.
    p = sorted_greedy_partition([[10, 4], [1]], 2)
    assert p.owners == ((0, 1), (1,))
    assert p.numel_per_rank == (10, 5)


@given(group_sizes, st.integers(1, 5))
def test_matches_torch_loop_and_covers_every_parameter(
    sizes: list[list[int]], world_size: int
) -> None:
    p = sorted_greedy_partition(sizes, world_size)
    assert [list(map(list, g)) for g in p.members] == _reference(sizes, world_size)
    for g, group in enumerate(sizes):
        owned = sorted(i for rank_members in p.members[g] for i in rank_members)
        assert owned == list(range(len(group)))
    assert sum(p.numel_per_rank) == sum(map(sum, sizes))


@given(group_sizes, st.integers(1, 5))
def test_balance_bound(sizes: list[list[int]], world_size: int) -> None:
    # [Note: sorted-greedy partition]: no rank exceeds the mean by more than the
    # largest parameter, which bounds each rank's share of the optimizer state.
    p = sorted_greedy_partition(sizes, world_size)
    total = sum(map(sum, sizes))
    largest = max((s for g in sizes for s in g), default=0)
    assert max(p.numel_per_rank) - min(p.numel_per_rank) <= largest
    assert max(p.numel_per_rank) * world_size <= total + world_size * largest


@given(group_sizes, st.lists(st.integers(0, 1000), max_size=6), st.integers(1, 4))
def test_appending_a_group_moves_nothing(
    sizes: list[list[int]], extra: list[int], world_size: int
) -> None:
    before = sorted_greedy_partition(sizes, world_size)
    after = sorted_greedy_partition([*sizes, extra], world_size)
    assert after.owners[: len(sizes)] == before.owners
    assert after.members[: len(sizes)] == before.members


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="world_size must be at least 1, got 0"):
        sorted_greedy_partition([[1]], 0)
    with pytest.raises(ValueError, match=r"group 0: parameter sizes must be >= 0"):
        sorted_greedy_partition([[1, -2]], 2)
    with pytest.raises(ValueError, match=r"members\[0\] lists 1 ranks, expected 2"):
        Partition(2, ((0,),), (((0,),),), (1, 0))
    with pytest.raises(ValueError, match=r"members\[0\]\[1\] holds 0, but owners\[0\]\[0\] = 0"):
        Partition(2, ((0,),), (((), (0,)),), (1, 0))


# ---------------------------------------------------------------- state dicts


def _adam_like_state(index: int) -> dict[str, torch.Tensor]:
    return {"step": torch.tensor(3.0), "exp_avg": torch.full((2,), float(index))}


def test_full_to_local_and_back_at_any_world_size() -> None:
    sizes = [[5, 1, 4], [7, 2]]
    group_lengths = [3, 2]
    groups = [
        {"lr": 0.1, "params": [torch.zeros(s) for s in sizes[0]]},
        {"lr": 0.2, "params": [torch.zeros(s) for s in sizes[1]]},
    ]
    state = {i: _adam_like_state(i) for i in range(5) if i != 3}  # parameter 3 has no state
    full = full_state_dict(state, groups)
    assert full["param_groups"] == [{"lr": 0.1, "params": [0, 1, 2]}, {"lr": 0.2, "params": [3, 4]}]
    check_full_state_dict(full, group_lengths)
    for world_size in (1, 2, 3, 4):
        p = sorted_greedy_partition(sizes, world_size)
        rebuilt: dict[int, dict[str, torch.Tensor]] = {}
        for rank in range(world_size):
            local = local_state_dict(full, p, rank, group_lengths)
            ids = owned_global_indices(p, rank, group_lengths)
            assert [len(g["params"]) for g in local["param_groups"]] == [
                len(p.members[0][rank]),
                len(p.members[1][rank]),
            ]
            assert [g["lr"] for g in local["param_groups"]] == [0.1, 0.2]
            for local_index, value in local["state"].items():
                rebuilt[ids[local_index]] = value
        assert sorted(rebuilt) == sorted(state)
        for i, value in state.items():
            assert rebuilt[i] is value


def test_check_full_state_dict_names_the_mismatch() -> None:
    good = {"state": {}, "param_groups": [{"params": [0, 1]}]}
    check_full_state_dict(good, [2])
    with pytest.raises(ValueError, match="expects a full optimizer state dict"):
        check_full_state_dict({"state": {}}, [2])
    with pytest.raises(ValueError, match="has 1 parameter groups but this optimizer has 2"):
        check_full_state_dict(good, [1, 1])
    with pytest.raises(ValueError, match="group 0 of the state dict has 2 parameters"):
        check_full_state_dict(good, [3])
    bad_index = {"state": {7: {}}, "param_groups": [{"params": [0, 1]}]}
    with pytest.raises(ValueError, match=r"indices \[7\], outside 0..1"):
        check_full_state_dict(bad_index, [2])
