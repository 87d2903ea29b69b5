"""Which ranks a unit shards over and which it replicates over.

Plain sharding uses one group. Hybrid sharding (``HYBRID_SHARD``,
``_HYBRID_SHARD_ZERO2``) uses two: a *shard* group, over which each unit's
flat parameter is split as in ``FULL_SHARD``/``SHARD_GRAD_OP``, and a
*replicate* group of the ranks holding the same shard in the other shard
groups. On a 2x2 layout of ranks ``[[0, 1], [2, 3]]`` (rows are shard
groups) rank 1 shards with rank 0 and replicates with rank 3.

[Note: hybrid gradient reduction]
A unit's gradient is reduce-scattered inside the shard group (each rank gets
the sum over its shard group of its chunk) and that chunk is then
all-reduced across the replicate group (the sum over every rank). The
average over all ``shard_size * replicate_size`` ranks, as DDP computes it,
is split into a pre-division before the reduce-scatter and a post-division
after the all-reduce (:func:`~fsdp._runtime._collectives.gradient_divide_factors` of
the data-parallel world size), as torch's FSDP does. Replicas hold equal
shards, so anything that needs every rank's piece of a gradient or a
parameter (gradient norms, ``summon_full_params``) only talks to the shard
group.

``HYBRID_SHARD_ACROSS_REPLICAS`` takes the same two groups and shards each unit
over every rank of them, in the order of the world group (see [Note: sharding
across replicas] in ``_runtime/_replica_shard.py``): to the wrapper its groups
are one shard group over the world (``ProcessGroups.shard_group``, what state
dicts, ``clip_grad_norm_`` and ``summon_full_params`` talk to) and the pair, kept
in ``ProcessGroups.across``, routes the runtime's gathers and reductions. The
world group is the default group (the pair must cover every rank, and rank
``(m, s)`` must be world rank ``m * shard_size + s``: torchrun's ranks with one
replica per node, ``init_device_mesh((replicas, shards))``), or for a mesh over
fewer ranks the mesh's own ranks flattened.

The groups come from, in this order of precedence: a ``(shard, replicate)``
pair of process groups; a 2-D ``DeviceMesh`` with dimensions
``(replicate, shard)`` (torch's convention: the outer dimension replicates);
or, when neither is given, a mesh built once per process from the launcher's
``LOCAL_WORLD_SIZE`` (shard inside a node, replicate across nodes). A 1-D
mesh gives a plain sharding group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp._runtime._replica_shard import ReplicaGroups
from fsdp.api import ShardingStrategy

__all__ = ["HYBRID_STRATEGIES", "ProcessGroups", "resolve_process_groups"]

HYBRID_STRATEGIES = (
    ShardingStrategy.HYBRID_SHARD,
    ShardingStrategy._HYBRID_SHARD_ZERO2,
    ShardingStrategy.HYBRID_SHARD_ACROSS_REPLICAS,
)

# Meshes built for hybrid sharding without explicit groups, one per (default group, node size),
# so that every FSDP instance (and every rank) uses the same groups. See _auto_hybrid_mesh.
# The default group itself is kept in the entry: a new default group (after
# destroy_process_group) never matches an old entry.
_AUTO_MESHES: list[tuple[Any, int, DeviceMesh]] = []


@dataclass(frozen=True)
class ProcessGroups:
    """The groups one FSDP instance communicates over (see the module docstring)."""

    shard_group: Any  # dist.ProcessGroup: all-gather / reduce-scatter
    shard_rank: int  # this rank in shard_group
    shard_size: int
    replicate_group: Any  # dist.ProcessGroup for the cross-replica all-reduce; None if not hybrid
    replicate_size: int  # 1 if not hybrid
    device_mesh: DeviceMesh | None  # the mesh the groups came from, if any
    # HYBRID_SHARD_ACROSS_REPLICAS: the (shard, replicate) pair; shard_group is the world's
    across: ReplicaGroups | None = None

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different data: the divisor of the gradient average."""
        return self.shard_size * self.replicate_size

    @property
    def hybrid_pair(self) -> tuple[Any, Any]:
        """The ``(shard_group, replicate_group)`` a hybrid strategy was given (or built)."""
        if self.across is not None:
            return self.across.shard_group, self.across.replicate_group
        return self.shard_group, self.replicate_group


def _require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "FullyShardedDataParallel needs torch.distributed initialised: call "
            "torch.distributed.init_process_group(backend) first (gloo on CPU, nccl on GPU), "
            "even for a single process (world_size=1)"
        )


def _member(group: Any, what: str) -> int:
    if not _is_group(group):
        # torch answers a name like "world" with "Group world is not registered" (ValueError)
        raise ValueError(
            f"the {what} passed to FullyShardedDataParallel must be a "
            f"torch.distributed.ProcessGroup, got {group!r} ({type(group).__name__}); pass "
            "None for the default group or a group from torch.distributed.new_group(...)"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"this process is not a member of the {what} passed to FullyShardedDataParallel; "
            "every rank that wraps the model must belong to it"
        )
    return rank


def _is_group(obj: object) -> bool:
    return isinstance(obj, dist.ProcessGroup)


def _is_standalone_group(obj: object) -> bool:
    """A process group, or a backend built by hand (``ProcessGroupGloo(store, rank, size)``)."""
    return _is_group(obj) or isinstance(obj, torch._C._distributed_c10d.Backend)


def _mesh_device_type() -> str:
    """The device type of an automatically built mesh: the default backend's device."""
    backend = str(dist.get_backend())
    if "nccl" in backend and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _local_world_size(world_size: int) -> int:
    """Ranks per node: the launcher's ``LOCAL_WORLD_SIZE`` (torchrun sets it)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None and world_size == 1:
        return 1  # one process: one node, whatever launched it
    if raw is None:
        raise ValueError(
            "hybrid sharding without process_group= or device_mesh= shards inside each node "
            "and replicates across nodes, which needs the number of ranks per node from the "
            "LOCAL_WORLD_SIZE environment variable (torchrun sets it), but it is not set. Launch "
            "with torchrun, set LOCAL_WORLD_SIZE, or pass device_mesh=init_device_mesh(device, "
            "(replicate, shard)) or process_group=(shard_group, replicate_group)"
        )
    try:
        local = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE must be an integer, got {raw!r}") from None
    if local < 1 or world_size % local != 0:
        raise ValueError(
            f"hybrid sharding needs the world size to be a multiple of the ranks per node, but "
            f"WORLD_SIZE({world_size}) % LOCAL_WORLD_SIZE({local}) != 0; pass "
            "device_mesh= or process_group=(shard_group, replicate_group) for uneven layouts"
        )
    return local


def _auto_hybrid_mesh() -> DeviceMesh:
    """A ``(nodes, ranks per node)`` mesh over the default group, built once per process.

    Every FSDP instance asking for automatic hybrid groups gets the same
    mesh, so manually wrapped instances agree with each other (torch's FSDP
    refuses manual wrapping without groups for this reason) and the groups are
    created once (creating a group is a collective over the default group).
    """
    world = dist.get_world_size()
    local = _local_world_size(world)
    default = dist.group.WORLD
    for group, size, mesh in _AUTO_MESHES:
        if group is default and size == local:
            return mesh
    mesh = init_device_mesh(
        _mesh_device_type(), (world // local, local), mesh_dim_names=("replicate", "shard")
    )
    _AUTO_MESHES.append((default, local, mesh))
    return mesh


def _from_mesh(mesh: object, hybrid: bool, strategy: ShardingStrategy) -> ProcessGroups:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
            f"{type(mesh).__name__}; build one with init_device_mesh(device_type, shape)"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(
            "this process is not part of the device_mesh passed to FullyShardedDataParallel; "
            "every rank that wraps the model must be in the mesh"
        )
    if hybrid:
        if mesh.ndim != 2:
            raise ValueError(
                f"sharding_strategy={strategy.name} needs a 2-D device_mesh with dimensions "
                f"(replicate, shard), got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}; "
                "e.g. init_device_mesh(device, (num_replicas, ranks_per_replica))"
            )
        shard, replicate = mesh.get_group(1), mesh.get_group(0)
        return ProcessGroups(
            shard_group=shard,
            shard_rank=_member(shard, "device_mesh"),
            shard_size=dist.get_world_size(shard),
            replicate_group=replicate,
            replicate_size=dist.get_world_size(replicate),
            device_mesh=mesh,
        )
    if mesh.ndim != 1:
        raise ValueError(
            f"sharding_strategy={strategy.name} shards over one group, so device_mesh must be "
            f"1-D, got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}. Use "
            "sharding_strategy=HYBRID_SHARD for a 2-D (replicate, shard) mesh, or pass "
            "mesh[dim_name] for one dimension"
        )
    group = mesh.get_group(0)
    return ProcessGroups(
        shard_group=group,
        shard_rank=_member(group, "device_mesh"),
        shard_size=dist.get_world_size(group),
        replicate_group=None,
        replicate_size=1,
        device_mesh=mesh,
    )


def _from_pair(pair: tuple[Any, ...], strategy: ShardingStrategy) -> ProcessGroups:
    if len(pair) != 2 or not all(_is_group(g) for g in pair):
        raise TypeError(
            f"for sharding_strategy={strategy.name}, process_group must be None or a pair "
            "(shard_group, replicate_group) of torch.distributed ProcessGroups, got a tuple of "
            f"{[type(g).__name__ for g in pair]}"
        )
    shard, replicate = pair
    shard_rank = _member(shard, "shard process group (process_group[0])")
    _member(replicate, "replicate process group (process_group[1])")
    shard_size, replicate_size = dist.get_world_size(shard), dist.get_world_size(replicate)
    world = dist.get_world_size()
    if shard_size * replicate_size != world:
        raise ValueError(
            "the (shard, replicate) process groups must together cover every rank exactly once, "
            f"but shard({shard_size}) * replicate({replicate_size}) != WORLD_SIZE({world}); "
            "each rank's shard group holds the ranks it shards with, its replicate group one "
            "rank from every shard group"
        )
    return ProcessGroups(
        shard_group=shard,
        shard_rank=shard_rank,
        shard_size=shard_size,
        replicate_group=replicate,
        replicate_size=replicate_size,
        device_mesh=None,
    )


def resolve_process_groups(
    process_group: Any, device_mesh: object, strategy: ShardingStrategy
) -> ProcessGroups:
    """The groups for ``strategy`` from the constructor's ``process_group``/``device_mesh``.

    Raises a clear error for every combination that cannot mean what the
    user wants: both arguments at once, a pair without a hybrid strategy, a
    single group with one, a mesh of the wrong dimension.
    """
    hybrid = strategy in HYBRID_STRATEGIES
    if _is_standalone_group(process_group) and device_mesh is None and not hybrid:
        # A group built by hand (ProcessGroupGloo(store, rank, size)) before, or without,
        # init_process_group: torch's FSDP takes it, so ask the group itself.
        return ProcessGroups(
            shard_group=process_group,
            shard_rank=process_group.rank(),
            shard_size=process_group.size(),
            replicate_group=None,
            replicate_size=1,
            device_mesh=None,
        )
    _require_initialized()
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            "pass either process_group= or device_mesh= to FullyShardedDataParallel, not both "
            "(the mesh already names the groups)"
        )
    if device_mesh is not None:
        return _across_replicas(_from_mesh(device_mesh, hybrid, strategy), strategy)
    if hybrid:
        if process_group is None:
            return _across_replicas(_from_mesh(_auto_hybrid_mesh(), True, strategy), strategy)
        if not isinstance(process_group, tuple):
            raise ValueError(
                f"sharding_strategy={strategy.name} needs two groups, but process_group is a "
                f"single {type(process_group).__name__}; pass process_group=(shard_group, "
                "replicate_group), a 2-D device_mesh=, or None to shard inside each node"
            )
        return _across_replicas(_from_pair(process_group, strategy), strategy)
    if isinstance(process_group, tuple):
        raise ValueError(
            "a (shard, replicate) process_group pair is only for hybrid sharding, but "
            f"sharding_strategy={strategy.name}; pass sharding_strategy=ShardingStrategy."
            "HYBRID_SHARD (or _HYBRID_SHARD_ZERO2), or a single process group"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    return ProcessGroups(
        shard_group=group,
        shard_rank=_member(group, "process_group"),
        shard_size=dist.get_world_size(group),
        replicate_group=None,
        replicate_size=1,
        device_mesh=None,
    )


def _across_replicas(groups: ProcessGroups, strategy: ShardingStrategy) -> ProcessGroups:
    """``HYBRID_SHARD_ACROSS_REPLICAS``: the pair as routes, the world group as the shard
    group (see the module docstring); other strategies' groups as they are.

    With one replica there is nothing across: plain sharding over the shard group.
    """
    if strategy is not ShardingStrategy.HYBRID_SHARD_ACROSS_REPLICAS or groups.replicate_size == 1:
        return groups
    across = ReplicaGroups.of(groups.shard_group, groups.replicate_group)
    world, world_rank = _world_group(groups.device_mesh)
    mesh = groups.device_mesh
    # With a mesh every rank sees every rank's place, so all of them refuse together.
    in_order = (
        world_rank == across.world_rank
        if mesh is None
        else mesh.mesh.flatten().tolist() == sorted(mesh.mesh.flatten().tolist())
    )
    if not in_order:
        raise ValueError(
            f"rank {dist.get_rank()}: sharding_strategy=HYBRID_SHARD_ACROSS_REPLICAS lays out "
            "every unit over all ranks in the order of the world group, which must be replica "
            f"by replica: this rank is replica {across.replicate_rank} of "
            f"{across.replicate_size}, shard rank {across.shard_rank} of {across.shard_size}, "
            f"so it must be rank {across.world_rank} of the world group, but it is rank "
            f"{world_rank} (mesh {None if mesh is None else mesh.mesh.tolist()}). Build the "
            "groups from init_device_mesh(device, (replicas, "
            "shards)) (each replica a block of consecutive ranks, as torchrun numbers a node's "
            "ranks), or use HYBRID_SHARD"
        )
    return ProcessGroups(
        shard_group=world,
        shard_rank=world_rank,
        shard_size=across.world_size,
        replicate_group=None,
        replicate_size=1,
        device_mesh=groups.device_mesh,
        across=across,
    )


def _world_group(mesh: DeviceMesh | None) -> tuple[Any, int]:
    """The group over every rank of a hybrid layout, and this rank's index in it: the
    default group, or for a mesh over fewer ranks its ranks flattened in mesh order."""
    if mesh is None or mesh.size() == dist.get_world_size():
        return dist.group.WORLD, dist.get_rank()
    flat = mesh._flatten("_".join(mesh.mesh_dim_names or ("replicate", "shard")))
    return flat.get_group(0), flat.get_local_rank(0)
