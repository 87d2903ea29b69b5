"""Who keeps whose replica, and which snapshot survives: pure functions of what ranks report.

[Note: replicas on another machine]
A rank's shard of the model and optimizer state exists once in the job, in that rank's
memory. Each snapshot is kept twice: in its own machine's memory, and as a replica in
the memory of a rank on the *next* machine (machines in the order their first rank
appears; rank ``i`` of a machine sends to rank ``i`` modulo the next machine's size).
Losing any one machine then leaves every shard somewhere: the lost machine's own
snapshots are replicated on the next machine, and the replicas it held have their
originals at home. On a single machine there is no one to send to; a lost worker
loses nothing there (its snapshots stay in the machine's memory), a lost machine
everything since the last disk checkpoint.

A step is recoverable when every original rank's snapshot of it survives somewhere,
on its own machine or as a replica (:func:`choose`); each piece is then served by a
rank whose machine holds it (the one with the fewest pieces to serve so far).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Choice", "Held", "Holding", "choose", "partners"]


def partners(hosts: Sequence[str]) -> list[int | None]:
    """For each rank, the rank that keeps its replica (None on a single machine); see
    [Note: replicas on another machine]. ``hosts[r]`` is rank r's machine."""
    machines: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        machines.setdefault(host, []).append(rank)
    order = list(machines.values())
    if len(order) < 2:
        return [None] * len(hosts)
    out: list[int | None] = [None] * len(hosts)
    for m, ranks in enumerate(order):
        following = order[(m + 1) % len(order)]
        for i, rank in enumerate(ranks):
            out[rank] = following[i % len(following)]
    return out


@dataclass(frozen=True)
class Held:
    """One committed snapshot file a machine holds."""

    generation: str
    step: int
    rank: int  # the original rank whose shard it is
    world_size: int  # of the job that took it
    created: float  # when it was taken (seconds since the epoch), to order generations
    replica: bool  # received from the original rank's machine


@dataclass(frozen=True)
class Holding:
    """What one rank of the restarted job can read from its machine's memory."""

    host: str
    held: tuple[Held, ...]


@dataclass(frozen=True)
class Choice:
    """The newest recoverable snapshot, and who serves each original rank's shard."""

    generation: str
    step: int
    world_size: int  # of the job that took it
    server: tuple[int, ...]  # server[r]: the current rank that serves original rank r
    from_replica: int  # original ranks whose own copy is gone, read from a replica


@dataclass(frozen=True)
class Missing:
    """The newest snapshot that did not survive whole, for the message that says so."""

    step: int
    world_size: int
    lost: tuple[int, ...]  # original ranks of which no copy survives


def choose(holdings: Sequence[Holding]) -> tuple[Choice | None, Missing | None]:
    """The newest step for which every original rank's shard survives (ties between two
    incarnations of the job go to the later one), and the newest incomplete step newer
    than it (None when there is none)."""
    by_step: dict[tuple[str, int], list[tuple[int, Held]]] = {}
    for current, holding in enumerate(holdings):
        for held in holding.held:
            by_step.setdefault((held.generation, held.step), []).append((current, held))
    ranked = sorted(
        by_step.items(),
        key=lambda kv: (kv[0][1], max(h.created for _, h in kv[1])),
        reverse=True,
    )
    missing: Missing | None = None
    for (generation, step), copies in ranked:
        world = copies[0][1].world_size
        covered = {h.rank for _, h in copies if h.world_size == world}
        lost = tuple(r for r in range(world) if r not in covered)
        if lost:
            missing = missing or Missing(step, world, lost)
            continue
        return _serve(generation, step, world, copies, holdings), missing
    return None, missing


def _serve(
    generation: str,
    step: int,
    world: int,
    copies: list[tuple[int, Held]],
    holdings: Sequence[Holding],
) -> Choice:
    by_rank: dict[int, list[tuple[int, Held]]] = {}
    for current, held in copies:
        by_rank.setdefault(held.rank, []).append((current, held))
    load = [0] * len(holdings)
    server: list[int] = []
    from_replica = 0
    for rank in range(world):
        candidates = sorted(by_rank[rank], key=lambda c: (load[c[0]], c[0]))
        chosen = candidates[0][0]
        load[chosen] += 1
        server.append(chosen)
        from_replica += all(h.replica for _, h in candidates)
    return Choice(generation, step, world, tuple(server), from_replica)
