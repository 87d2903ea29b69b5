"""Which rank owns which parameter: the sorted-greedy partition.

A pure function of parameter sizes and the world size, with no process group and
no optimizer, so every rank computes the same answer on its own and the tests
check it in one process.

[Note: sorted-greedy partition]
Parameter groups are partitioned one after another, in order. Inside a group the
parameters are visited largest first (ties keep their order in the group) and
each one goes to the rank whose running total of elements is smallest (ties go
to the lowest rank). The running totals carry over from one group to the next,
so the ranks stay balanced over the whole model, not group by group.

Two consequences the rest of the package relies on:

* Appending a group never moves a parameter of an earlier group: group ``g``'s
  assignment depends only on groups ``0..g``. ``add_param_group`` therefore keeps
  every existing optimizer state where it is.
* After every assignment ``max(load) - min(load) <= largest parameter``: the
  parameter just placed went to the lightest rank. Since ``min(load)`` is at
  most the mean, every rank holds at most ``total / world_size + largest``
  elements, and so at most that share of the optimizer state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Partition", "sorted_greedy_partition"]


@dataclass(frozen=True)
class Partition:
    """The owner of every parameter, as computed by :func:`sorted_greedy_partition`.

    Parameters are named by ``(group index, index inside the group's params)``.
    Every rank derives the same ``Partition`` from the same sizes, so it doubles
    as the agreed order of the collectives that follow a step.
    """

    world_size: int
    # owners[g][i]: the rank that owns parameter i of group g
    owners: tuple[tuple[int, ...], ...]
    # members[g][r]: indices (into group g) owned by rank r, in assignment order
    # (largest first); this is the parameter order of rank r's local optimizer
    members: tuple[tuple[tuple[int, ...], ...], ...]
    # numel_per_rank[r]: elements owned by rank r over all groups
    numel_per_rank: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        if len(self.owners) != len(self.members):
            raise ValueError(
                f"owners has {len(self.owners)} groups but members has {len(self.members)}"
            )
        for g, (owners, members) in enumerate(zip(self.owners, self.members, strict=True)):
            if len(members) != self.world_size:
                raise ValueError(
                    f"members[{g}] lists {len(members)} ranks, expected {self.world_size}"
                )
            for rank, indices in enumerate(members):
                for i in indices:
                    if owners[i] != rank:
                        raise ValueError(
                            f"members[{g}][{rank}] holds {i}, but owners[{g}][{i}] = {owners[i]}"
                        )
            if sum(len(m) for m in members) != len(owners):
                raise ValueError(f"group {g}: members and owners disagree on the count")

    @property
    def num_groups(self) -> int:
        """Number of parameter groups partitioned."""
        return len(self.owners)

    def owned(self, rank: int) -> list[tuple[int, int]]:
        """``(group, index)`` of every parameter ``rank`` owns, in local-optimizer order.

        This is the order in which the rank's local optimizer (and its
        ``state_dict``) numbers its parameters: group by group, assignment order
        inside a group.
        """
        return [(g, i) for g, members in enumerate(self.members) for i in members[rank]]


def sorted_greedy_partition(group_sizes: Sequence[Sequence[int]], world_size: int) -> Partition:
    """Assign every parameter to one rank, balancing element counts.

    ``group_sizes[g][i]`` is the element count of parameter ``i`` of group ``g``.
    Each parameter goes whole to one rank (a parameter is never split), which
    keeps the local optimizer an ordinary ``torch.optim`` optimizer over whole
    tensors. The rules, and the balance bound they guarantee, are in
    [Note: sorted-greedy partition] at the top of this module; they are the ones
    ``torch.distributed.optim.ZeroRedundancyOptimizer`` uses, so ours and torch's
    give every parameter the same owner.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    loads = [0] * world_size
    owners: list[tuple[int, ...]] = []
    members: list[tuple[tuple[int, ...], ...]] = []
    for g, sizes in enumerate(group_sizes):
        if any(size < 0 for size in sizes):
            raise ValueError(f"group {g}: parameter sizes must be >= 0, got {list(sizes)}")
        group_owners = [0] * len(sizes)
        group_members: list[list[int]] = [[] for _ in range(world_size)]
        # sorted() is stable even with reverse=True: equal sizes keep group order.
        for i in sorted(range(len(sizes)), key=sizes.__getitem__, reverse=True):
            rank = loads.index(min(loads))  # the lightest rank; ties -> lowest rank
            group_owners[i] = rank
            group_members[rank].append(i)
            loads[rank] += sizes[i]
        owners.append(tuple(group_owners))
        members.append(tuple(tuple(m) for m in group_members))
    return Partition(world_size, tuple(owners), tuple(members), tuple(loads))
