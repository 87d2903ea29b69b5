"""fsdp: FullyShardedDataParallel, a drop-in for torch's FSDP1 wrapper.

``from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy`` replaces
``from torch.distributed.fsdp import ...``; the wrap policies are in
:mod:`fsdp.wrap`. See the package README for the design.
"""

from fsdp._common import TrainingState
from fsdp._version import __version__
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
from fsdp.shards import LocalShard, is_flat_parameter, local_shards, unwrapped_name

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalShard",
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
    "TrainingState",
    "__version__",
    "is_flat_parameter",
    "local_shards",
    "unwrapped_name",
]
