"""fsdp: fully sharded data parallelism, torch's two APIs over one runtime.

``from fsdp import fully_shard, FSDPModule, MixedPrecisionPolicy`` replaces torch's
FSDP2 (``from torch.distributed.fsdp import fully_shard, ...``), and
``from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy`` torch's FSDP1
wrapper; the wrap policies are in :mod:`fsdp.wrap`. Tools that read or fill a wrapped
model's shards use the public layout in :mod:`fsdp.units` and :mod:`fsdp.shards`. See
the package README for the design.
"""

import torch.distributed

from flatparam import CollectiveError, RankDisagreementError, register_clean_exit
from fsdp._fully_shard._api import (
    FSDPModule,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from fsdp._fully_shard._param_mesh import ShardPlacementResult
from fsdp._fully_shard._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdp._fully_shard._spmd import DataParallelMeshDims
from fsdp._runtime._common import TrainingState, TrainingStateError
from fsdp._runtime._quantize import QuantizedCommPolicy
from fsdp._version import __version__
from fsdp._wrapper._memory import MemoryEstimate, UnitSize, estimate_memory
from fsdp._wrapper._torch_types import to_fsdp_policy, to_fsdp_type
from fsdp.api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fsdp.fully_sharded_data_parallel import FullyShardedDataParallel
from fsdp.sharded_grad_scaler import ShardedGradScaler
from fsdp.shards import LocalShard, is_flat_parameter, local_shards, unwrapped_name
from fsdp.units import FlatUnit, UnitParam, UnitSharding, flat_units

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "CollectiveError",
    "DataParallelMeshDims",
    "FSDPModule",
    "FlatUnit",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalShard",
    "LocalStateDictConfig",
    "MemoryEstimate",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "QuantizedCommPolicy",
    "RankDisagreementError",
    "ShardPlacementResult",
    "ShardedGradScaler",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "TrainingState",
    "TrainingStateError",
    "UnitParam",
    "UnitSharding",
    "UnitSize",
    "UnshardHandle",
    "__version__",
    "estimate_memory",
    "flat_units",
    "fully_shard",
    "is_flat_parameter",
    "local_shards",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "to_fsdp_policy",
    "to_fsdp_type",
    "unwrapped_name",
]

register_clean_exit(torch.distributed)
