"""The option types of :class:`~fsdp.FullyShardedDataParallel`.

These mirror ``torch.distributed.fsdp.api`` name for name and field for field, so
that switching ``from torch.distributed.fsdp import ShardingStrategy`` to
``from fsdp import ShardingStrategy`` keeps a script working. They hold no logic
beyond validating themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
]


class ShardingStrategy(Enum):
    """What FSDP shards and when it gathers it back.

    - ``FULL_SHARD`` (ZeRO-3): parameters, gradients and optimizer state are
      sharded. A unit's parameters are all-gathered before its forward, freed
      after it, all-gathered again before its backward and freed after it; its
      gradient is reduce-scattered. Least memory, 3x the parameter bytes of
      traffic per step (the root unit stays gathered between forward and
      backward, so a little less).
    - ``SHARD_GRAD_OP`` (ZeRO-2): gradients and optimizer state are sharded;
      parameters are sharded only outside forward/backward (gathered once before
      the forward, freed after the backward). 2x the parameter bytes of traffic.
      Inside ``no_sync()`` the parameters stay gathered after the backward.
    - ``NO_SHARD``: nothing is sharded; gradients are all-reduced as in
      ``DistributedDataParallel``.
    - ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``: ``FULL_SHARD`` /
      ``SHARD_GRAD_OP`` inside a shard group of ranks (typically a node) and
      replication across shard groups: gradients are reduce-scattered inside
      the shard group, then all-reduced across the replicas, averaged over all
      ranks as in DDP. Parameter traffic stays inside the (fast) shard group;
      only ``1/shard_size`` of the gradient bytes cross groups.
    - ``HYBRID_SHARD_ACROSS_REPLICAS`` (ours, not torch's): ``HYBRID_SHARD``'s
      gathers and traffic across groups, with what the optimizer steps sharded
      over every rank: the flat parameter (the master weights), its gradient and
      so the optimizer state are ``1/world_size`` of the unit, as with
      ``FULL_SHARD`` over all ranks. Gradients are reduce-scattered inside the
      shard group, then reduce-scattered (not all-reduced) across the replicas;
      after the optimizer step, the next forward all-gathers the updated shards
      across the replicas into each rank's shard of its replica (kept in the
      compute dtype until the backward), which the shard group gathers as
      ``HYBRID_SHARD`` does. The same bytes cross groups as ``HYBRID_SHARD``;
      state dicts, ``clip_grad_norm_`` and ``summon_full_params`` see a unit
      sharded over all ranks. See [Note: sharding across replicas].
    """

    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()
    HYBRID_SHARD_ACROSS_REPLICAS = auto()


class BackwardPrefetch(Enum):
    """When the backward pass gathers the next unit's parameters.

    - ``BACKWARD_PRE``: before the current unit's gradient computation. Most
      overlap; at the peak the current and next unit's parameters and the
      current unit's gradient are alive.
    - ``BACKWARD_POST``: after the current unit's gradient computation (and
      after freeing its parameters). Less overlap, less memory.
    - ``None`` (pass it to the constructor): no prefetch; each unit's gather
      starts only when its backward needs it.

    The "next" unit is taken from the reverse of the first iteration's forward
    order; a mistargeted prefetch costs memory earlier than needed, never
    correctness.
    """

    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


def _check_dtype(name: str, value: object) -> None:
    if value is not None and not isinstance(value, torch.dtype):
        raise TypeError(
            f"MixedPrecision.{name} must be a torch.dtype or None, got {value!r} "
            f"({type(value).__name__}); e.g. MixedPrecision({name}=torch.bfloat16)"
        )


@dataclass(frozen=True)
class MixedPrecision:
    """Low-precision compute and communication with full-precision master weights.

    The sharded parameters (what the optimizer steps) keep their original
    dtype; only the gathered copies used for compute, the gradient reduction
    and the buffers are cast.

    Fields:
        param_dtype: dtype of the all-gathered parameters and hence of forward
            and backward compute. ``None``: the original dtype.
        reduce_dtype: dtype in which gradients are reduced across ranks.
            ``None``: ``param_dtype`` if that is set, else the original dtype.
        buffer_dtype: dtype the buffers are cast to (once, at the first
            forward). ``None``: buffers keep their dtype.
        keep_low_precision_grads: leave the reduced sharded gradient in the
            low-precision dtype instead of casting it back to the parameter's
            dtype (saves memory; the optimizer must cope with it).
        cast_forward_inputs: every FSDP unit casts the floating-point tensors
            of its forward inputs to ``param_dtype``.
        cast_root_forward_inputs: the root unit casts its forward inputs to
            ``param_dtype`` (on by default so that a model's input matches its
            compute dtype).
        _module_classes_to_ignore: with an ``auto_wrap_policy``, modules of
            these classes (batch norm by default, whose statistics need full
            precision) are wrapped in their own unit without mixed precision,
            and their inputs and outputs are cast around them.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[nn.Module]] = (_BatchNorm,)

    def __post_init__(self) -> None:
        _check_dtype("param_dtype", self.param_dtype)
        _check_dtype("reduce_dtype", self.reduce_dtype)
        _check_dtype("buffer_dtype", self.buffer_dtype)
        bad = [
            c
            for c in self._module_classes_to_ignore
            if not (isinstance(c, type) and issubclass(c, nn.Module))
        ]
        if bad:
            raise TypeError(
                f"MixedPrecision._module_classes_to_ignore must hold nn.Module subclasses, "
                f"got {bad!r}"
            )


@dataclass(frozen=True)
class CPUOffload:
    """Keep the sharded parameters (and their gradients) in CPU memory.

    With ``offload_params=True`` the sharded flat parameter and its gradient
    live on the CPU between uses and the optimizer steps there; each unit's
    shard is copied to the compute device just before it is all-gathered, and
    each reduced gradient shard is copied back right after its reduction.
    Trades transfer time for device memory.
    """

    offload_params: bool = False


# --- state-dict types ------------------------------------------------------------------------
# Plain data, as in torch.distributed.fsdp.api, so that scripts import them from fsdp (or
# ckpt, which re-exports them) and so that an FSDP instance can record its setting without
# the ckpt package. What each type produces is implemented by ckpt.


class StateDictType(Enum):
    """Which form ``state_dict()``/``load_state_dict()`` of an FSDP model take.

    - ``FULL_STATE_DICT``: every parameter full (unsharded) under the keys of the
      model before wrapping. The default; works without the ckpt package.
    - ``SHARDED_STATE_DICT``: every parameter under its unwrapped key as a
      ``DTensor`` sharded on dimension 0 over the process group's ``DeviceMesh``
      (torch.distributed.checkpoint saves and reshards it; any world size loads it).
    - ``LOCAL_STATE_DICT``: this rank's shard of each FlatParameter as is, under
      ``<instance>._flat_param``; loads only at the world size that produced it.

    Select one with ``ckpt.state_dict_type(model, ...)`` (or the
    ``FullyShardedDataParallel`` static methods of the same names).
    """

    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


@dataclass
class StateDictConfig:
    """Options common to every model state-dict type.

    Fields:
        offload_to_cpu: put the returned tensors in CPU memory (device memory
            then only ever holds one unit's gathered parameters at a time).
    """

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """Options of ``FULL_STATE_DICT``.

    Fields:
        rank0_only: only global rank 0 receives the full tensors; every other
            rank returns an empty dict (and needs no memory for them). With
            ``offload_to_cpu`` this is how a model larger than one device is
            saved: units are gathered one at a time and copied to rank 0's CPU.
    """

    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    """Options of ``LOCAL_STATE_DICT`` (only ``offload_to_cpu``)."""


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """Options of ``SHARDED_STATE_DICT``.

    ``_use_dtensor`` is accepted for torch compatibility; our sharded state
    dicts always hold ``DTensor`` values.
    """

    _use_dtensor: bool = True


@dataclass
class OptimStateDictConfig:
    """Options common to every optimizer state-dict type.

    Fields:
        offload_to_cpu: put the returned state tensors in CPU memory (default
            ``True``, as in torch: optimizer state is twice the parameters for Adam).
    """

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    """Options of the full optimizer state dict.

    Fields:
        rank0_only: only global rank 0 receives the state; other ranks get ``{}``.
    """

    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """Options of the local optimizer state dict (on the device by default)."""

    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """Options of the sharded optimizer state dict (``DTensor`` values)."""

    _use_dtensor: bool = True


@dataclass
class StateDictSettings:
    """An FSDP tree's state-dict type with its model and optimizer configs."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


class OptimStateKeyType(Enum):
    """How an optimizer state dict names parameters: by FQN or by integer index."""

    PARAM_NAME = auto()
    PARAM_ID = auto()
