"""Sharding across replicas: this rank's shard of its replica, rebuilt from world shards.

[Note: sharding across replicas]
Hybrid sharding (HSDP) cuts the ranks into ``replicate_size`` replicas (rows of
a ``(replicate, shard)`` mesh; typically one machine each) of ``shard_size``
ranks. Its parameters are sharded inside a replica and replicated across
replicas, so every replica keeps a whole copy of the master weights and of the
optimizer state, and a gradient crosses between replicas once, as an all-reduce
of each rank's shard. *Sharding across replicas* (``fully_shard(...,
shard_across_replicas=True)``, ``ShardingStrategy.HYBRID_SHARD_ACROSS_REPLICAS``)
keeps HSDP's traffic and shards what the optimizer steps over every rank:

- The layout is the one plain sharding uses over all ``world = replicate_size *
  shard_size`` ranks, in the order of the world group: rank ``(m, s)`` (replica
  ``m``, shard rank ``s``) is world rank ``w = m * shard_size + s`` and holds
  chunk ``w`` of ``world_numel`` elements, its *world shard*. It is the master
  the optimizer steps, what ``parameters()`` and state dicts show: to everything
  outside the runtime the unit is sharded over the world group.
- The gathered buffer (``padded_numel = world * world_numel``) seen as
  ``replicate_size`` rows of ``shard_size`` chunks: row ``m'`` holds the chunks
  of replica ``m'``'s ranks. Rank ``(m, s)`` contributes to row ``m'`` the chunk
  of ``(m', s)``, the rank holding the same shard in replica ``m'``; so before
  gathering, rank ``(m, s)`` needs the world shards of its replicas ``(m', s)``,
  all ``m'``: its *replica shard*, ``replicate_size * world_numel`` elements, the
  same elements HSDP's shard holds (in another order). :class:`ReplicaShard`
  all-gathers it across the replicate group (the slow link) and keeps it, in the
  compute dtype, while the parameters it came from are current; each gather is
  then one all-gather per row inside the shard group, as fast as HSDP's.
- A gradient (laid out as the gathered buffer) is reduce-scattered per row inside
  the shard group, which leaves rank ``(m, s)`` the sum over its replica of the
  chunks of every ``(m', s)``: ``replicate_size`` chunks, HSDP's reduced shard;
  then reduce-scattered across the replicate group into the world shard's
  gradient, the sum over all ranks. A reduce-scatter and the next step's
  all-gather across replicas move what HSDP's all-reduce moves.

Timing: the root's pre-forward issues every unit's all-gather across replicas, in
the tree's order, so that they cross the link while the forward computes
(``RootContext.start_refreshes``). On the CPU the gather inside the replica
waits for its replica shard before it is issued, so a gather issued ahead of the
next module's forward may hold up the module computing: when the link is the
bottleneck the forward then starts one module's transfer later but ends when the
last transfer ends, as it must; when it is not, the bytes are there. (Issuing it
later when the bytes have not arrived would depend on timing that differs between
ranks, and the collectives of one group must be issued in the same order on every
rank.) On CUDA the unshard stream orders both. The reduce-scatter across replicas
is a reduction's second stage, where HSDP's all-reduce is ([Note: reductions in
flight] in ``_root_context.py``), overlapping the backward the same way.

The sums are HSDP's, term for term: inside the shard group over its ranks in rank
order, then across replicas. At two replicas an all-reduce and a reduce-scatter
add the same two terms, so training is HSDP's bit for bit; at more, the order of
the cross-replica sum may differ, in the last bits.

When the replica shard is gathered again is a function of the collectives every
rank issues, not of a rank's local state, so that no rank is alone in an
all-gather across replicas (a hang): it is dropped (1) when a reduction of the
unit's gradient moves on to its reduce-scatter across replicas, as the optimizer
may step next; (2) when the front end writes the world shard itself
(``load_state_dict``, ``summon_full_params`` writing back), which every rank
does; and it is gathered at the next gather after that. A unit's first gather
gathers it too. Between a synced backward and the next forward nothing holds it,
so the optimizer step runs beside the world shards only.

A gather between that drop and the optimizer step (``fully_shard``'s ``unshard()``
by hand after backward, a backward prefetch of a module whose backward already
ran) gathers the replica shard again, from the values before the step. Where the
front end's gathers already follow the world shard's version counter
(``fully_shard``: [Note: stale gathers] in ``_fully_shard/_param_group.py``), so
does the replica shard (``version``): a counter that moved since it was
gathered drops it, as the gather it fed is dropped. The wrapper's gathers happen
only in forward and backward, and there the counter could not decide for all
ranks alike (with ``use_orig_params`` a rank whose world shard is all padding
sees no optimizer step): in-place changes by other means after a forward and
before the next backward are seen from the next backward on, and the storage
warns when the counter says one happened.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fsdp._runtime._collectives import PendingCollective, all_gather_into
from fsdp._runtime._streams import Stream, Streams

__all__ = ["ReplicaGroups", "ReplicaShard"]

_log = logging.getLogger("fsdp")


@dataclass(frozen=True)
class ReplicaGroups:
    """The two groups of [Note: sharding across replicas], as the runtime needs them."""

    shard_group: Any  # dist.ProcessGroup: this rank's replica (HSDP's shard group)
    shard_rank: int
    shard_size: int
    replicate_group: Any  # dist.ProcessGroup: the ranks holding the same shard elsewhere
    replicate_rank: int
    replicate_size: int

    @classmethod
    def of(cls, shard_group: Any, replicate_group: Any) -> ReplicaGroups:
        """This rank's place in the two groups."""
        return cls(
            shard_group=shard_group,
            shard_rank=dist.get_rank(shard_group),
            shard_size=dist.get_world_size(shard_group),
            replicate_group=replicate_group,
            replicate_rank=dist.get_rank(replicate_group),
            replicate_size=dist.get_world_size(replicate_group),
        )

    @property
    def world_rank(self) -> int:
        """This rank's chunk of the world layout: ``replicate_rank * shard_size + shard_rank``."""
        return self.replicate_rank * self.shard_size + self.shard_rank

    @property
    def world_size(self) -> int:
        """Ranks of the world layout: ``replicate_size * shard_size``."""
        return self.replicate_size * self.shard_size


class ReplicaShard:
    """This rank's shard of its replica, gathered across replicas; see the note.

    ``rows[m']`` is the world shard of replica ``m'``'s rank that holds this
    rank's shard: the input of row ``m'``'s all-gather inside the shard group.
    """

    groups: ReplicaGroups
    world_numel: int  # elements of one world shard
    rows: Tensor  # 2-D [replicate_size, world_numel]; storage allocated only while held
    pinned: bool  # the world shard is pinned host memory (CPU offload on CUDA)
    # The world shard's version counter, when the front end's gathers follow it (see the
    # note); None: the tensor's own, only warned about.
    version: Callable[[], int] | None
    _pending: PendingCollective | None  # the all-gather in flight (CPU; CUDA orders by stream)
    _source: tuple[int, int] | None  # (version, data_ptr) of the world shard it came from
    _warned: bool

    def __init__(
        self,
        groups: ReplicaGroups,
        world_numel: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        pinned: bool,
        version: Callable[[], int] | None = None,
    ) -> None:
        self.groups = groups
        self.world_numel = world_numel
        self.rows = torch.empty(groups.replicate_size, world_numel, dtype=dtype, device=device)
        self.rows.untyped_storage().resize_(0)
        self.pinned = pinned
        self.version = version
        self._pending = None
        self._source = None
        self._warned = False

    @property
    def held(self) -> bool:
        """Whether the replica shard is gathered (or being gathered)."""
        return self._source is not None

    @property
    def nbytes(self) -> int:
        """Bytes held now (0 when dropped)."""
        return int(self.rows.untyped_storage().nbytes())

    def start_refresh(self, world_shard: Tensor, streams: Streams) -> None:
        """Issue the all-gather across replicas unless the replica shard is held; returns
        at once (on CUDA the unshard stream runs it after the compute stream's work)."""
        if self._source is not None and self._current(world_shard):
            return
        self.drop()
        g = self.groups
        numel = g.replicate_size * self.world_numel
        self.rows.untyped_storage().resize_(numel * self.rows.element_size())
        flat = self.rows.view(-1)
        slot = self.rows[g.replicate_rank]
        if not streams.enabled:
            slot.copy_(world_shard.detach())  # the cast (and host copy) into this rank's row
            self._pending = all_gather_into(flat, slot, g.replicate_group)
        else:
            # [Note: stream ordering] (unshard): the world shard's last writer ran on compute.
            streams.wait_stream(Stream.UNSHARD, Stream.COMPUTE)
            with streams.use(Stream.UNSHARD):
                slot.copy_(world_shard.detach(), non_blocking=self.pinned)
                all_gather_into(flat, slot, g.replicate_group).wait()  # the stream waits
        self._source = self._source_of(world_shard)

    def ready(self, world_shard: Tensor, streams: Streams) -> Tensor:
        """The replica shard's rows, gathered (waits for the all-gather on the CPU)."""
        self.start_refresh(world_shard, streams)
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()
        return self.rows

    def drop(self) -> None:
        """Free the replica shard; the next gather gathers it again (see the note)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()  # never free memory a collective writes into
        self.rows.untyped_storage().resize_(0)
        self._source = None

    def _current(self, world_shard: Tensor) -> bool:
        """Whether the held replica shard may be used (see the note)."""
        if self._source == self._source_of(world_shard):
            return True
        if self.version is not None:
            return False
        if not self._warned:
            self._warned = True
            _log.warning(
                "the parameters sharded across replicas were changed in place after a "
                "forward and before a backward (their version counter moved); the forward "
                "keeps using the values gathered before the change until the next backward. "
                "Change them between a backward and the next forward (where optimizer.step() "
                "runs), or through load_state_dict(), which every rank runs and which "
                "gathers them again"
            )
        return True

    def _source_of(self, world_shard: Tensor) -> tuple[int, int]:
        version = world_shard._version if self.version is None else self.version()
        return version, world_shard.data_ptr()
