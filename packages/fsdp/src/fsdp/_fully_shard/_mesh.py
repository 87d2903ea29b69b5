"""Which ranks ``fully_shard`` shards over and replicates across: its ``DeviceMesh``.

A 1-D mesh shards over all its ranks (FSDP); a 2-D mesh ``(replicate, shard)``
shards inside each row and replicates across rows (HSDP), as torch's. The
parameters become ``DTensor`` s on that mesh with ``(Shard(d),)`` or
``(Replicate(), Shard(d))``. With ``shard_across_replicas=True`` (ours) a 2-D
mesh shards what the optimizer steps over all its ranks ([Note: sharding across
replicas] in ``_runtime/_replica_shard.py``): the parameters are ``DTensor`` s
with ``(Shard(d),)`` on the mesh flattened (as torch names it: ``replicate_shard``),
and the two dimensions' groups route the runtime's collectives.
``reshard_after_forward=n`` (an int) keeps, between forward and backward, a
shard over the ``n`` consecutive ranks that contain this one: a second mesh whose
groups this module makes once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate

from fsdp._runtime._replica_shard import ReplicaGroups

__all__ = [
    "InvalidArgumentError",
    "MeshInfo",
    "default_mesh",
    "mesh_device",
    "mesh_info",
    "post_forward_info",
    "where",
]


class InvalidArgumentError(ValueError, AssertionError):
    """A ``fully_shard`` argument it cannot work with.

    A ``ValueError``, which is what it is; an ``AssertionError`` too, because
    torch's ``fully_shard`` raises that for the same mistakes (a 2-D mesh
    without dimension names, a shard dimension the parameter does not have,
    applying it twice) and code written against torch catches it. The message
    keeps torch's words and adds the fix.
    """


_log = logging.getLogger("fsdp")


@dataclass(frozen=True)
class MeshInfo:
    """The groups of one ``fully_shard`` mesh, as the runtime needs them."""

    mesh: DeviceMesh  # 1-D (shard) or 2-D (replicate, shard)
    shard_group: Any  # dist.ProcessGroup: the ranks a parameter is cut over
    shard_rank: int
    shard_size: int
    replicate_group: Any  # dist.ProcessGroup across replicas (HSDP), None for 1-D
    replicate_size: int
    # shard_across_replicas: the 2-D mesh's groups; ``mesh`` and the shard_* fields are then
    # the flattened mesh's, over every rank
    across: ReplicaGroups | None = None

    def placements(self, shard: Placement) -> tuple[Placement, ...]:
        """A sharded parameter's placements on :attr:`mesh` (``shard``: its dp cut, a
        ``Shard`` or, under tensor parallelism, a ``_StridedShard``)."""
        return (shard,) if self.mesh.ndim == 1 else (Replicate(), shard)


def where() -> str:
    """This process's rank, for messages ("rank 3"; "this process" before init)."""
    return f"rank {dist.get_rank()}" if dist.is_initialized() else "this process"


def default_mesh() -> DeviceMesh:
    """torch's default: a 1-D mesh over the default group, on the accelerator if any."""
    if not dist.is_initialized():
        dist.init_process_group()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def mesh_info(mesh: Any, shard_across_replicas: bool = False) -> MeshInfo:
    """Check ``mesh`` and read its groups; errors name the mesh and the fix."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard(mesh=...) needs a torch.distributed.device_mesh.DeviceMesh, got "
            f"{type(mesh).__name__}; build one with "
            "init_device_mesh('cpu' or 'cuda', (world_size,))"
        )
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise InvalidArgumentError(
            "Please init the 2D mesh for HSDP with mesh_dim_names specified: fully_shard "
            "shards along the last dimension and replicates along the first, so build it with "
            "init_device_mesh(device, (replicas, shards), mesh_dim_names=('replicate', 'shard'))"
        )
    shard_dim = mesh.ndim - 1
    shard_group = mesh.get_group(shard_dim)
    replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
    info = MeshInfo(
        mesh=mesh,
        shard_group=shard_group,
        shard_rank=mesh.get_local_rank(shard_dim),
        shard_size=mesh.size(shard_dim),
        replicate_group=replicate_group,
        replicate_size=mesh.size(0) if mesh.ndim == 2 else 1,
    )
    return _across_replicas(info) if shard_across_replicas else info


def _across_replicas(info: MeshInfo) -> MeshInfo:
    """``shard_across_replicas=True``: the flattened mesh as the shard mesh, the 2-D mesh's
    groups as routes (see the module docstring); one replica: HSDP's info, nothing to do."""
    mesh = info.mesh
    if mesh.ndim != 2:
        raise InvalidArgumentError(
            f"{where()}: fully_shard(shard_across_replicas=True) needs a 2-D mesh (replicate, "
            f"shard), got {mesh}: build it with init_device_mesh(device, (replicas, "
            "shards_per_replica), mesh_dim_names=('replicate', 'shard')), or drop the option "
            "(a 1-D mesh already shards everything over all its ranks)"
        )
    if info.replicate_size == 1:
        return info
    across = ReplicaGroups.of(info.shard_group, info.replicate_group)
    flat = mesh._flatten("_".join(mesh.mesh_dim_names or ()))  # torch's name for it
    ranks = mesh.mesh.flatten().tolist()
    if ranks != sorted(ranks):  # every rank sees the whole mesh: all refuse together
        raise InvalidArgumentError(
            f"{where()}: fully_shard(shard_across_replicas=True) lays parameters out over the "
            "mesh flattened, whose group orders ranks by number, so the mesh must list them "
            f"in increasing order, replica by replica; got {mesh.mesh.tolist()}. Build it with "
            "init_device_mesh(device, (replicas, shards_per_replica))"
        )
    return MeshInfo(
        mesh=flat,
        shard_group=flat.get_group(0),
        shard_rank=across.world_rank,
        shard_size=across.world_size,
        replicate_group=None,
        replicate_size=1,
        across=across,
    )


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device parameters live on: the CPU, or the current device of the mesh's type."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module: Any = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def post_forward_info(reshard_after_forward: bool | int, info: MeshInfo) -> MeshInfo | None:
    """The mesh parameters are resharded to after forward; ``None``: kept unsharded.

    ``True`` reshards to the module's own shard group, ``False`` keeps them,
    an int ``n`` (a divisor of the shard group's size) reshards to the ``n``
    consecutive ranks around this one, as torch's.
    """
    if isinstance(reshard_after_forward, bool):
        return info if reshard_after_forward else None
    if not isinstance(reshard_after_forward, int):
        raise ValueError(
            "reshard_after_forward should be a bool or an int representing the group size "
            f"to reshard to, not {reshard_after_forward!r}"
        )
    n, size = reshard_after_forward, info.shard_size
    if n < 1 or n > size or size % n != 0:
        raise ValueError(
            f"If passing reshard_after_forward as an int, it should be a factor of {size}, "
            f"not {n}: it is how many ranks keep a shard between forward and backward"
        )
    if n == 1:
        _log.warning(
            "reshard_after_forward=1 (int) means resharding parameters to world size 1, "
            "instead of reshard_after_forward=True (bool)"
        )
        return None
    if n == size:
        return info
    if info.mesh.size() != dist.get_world_size():
        # DeviceMesh(ranks) makes a group per row of ``ranks`` in one collective sequence
        # over all processes; a slice's rows differ on each rank of the other dimensions
        # (every tp rank has its own dp slice), so they would wait for each other forever.
        raise NotImplementedError(
            f"reshard_after_forward={n} (an int) is not supported when fully_shard's mesh is "
            f"a slice of a larger mesh ({info.mesh}: {info.mesh.size()} of "
            f"{dist.get_world_size()} ranks, e.g. the dp slice of a (dp, tp) mesh): the "
            "groups of the smaller mesh differ across the slices and cannot be made together "
            "(torch's fully_shard hangs there); pass reshard_after_forward=True or False"
        )
    # The shard group's ranks in rows of n, as torch's: a (size/n*replicas, n) mesh.
    ranks = info.mesh.mesh.reshape(-1, n)
    smaller = DeviceMesh(info.mesh.device_type, ranks, mesh_dim_names=("outer", "inner"))
    return MeshInfo(
        mesh=smaller,
        shard_group=smaller.get_group(1),
        shard_rank=smaller.get_local_rank(1),
        shard_size=n,
        replicate_group=None,
        replicate_size=1,
    )
