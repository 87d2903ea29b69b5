"""fsdp: FullyShardedDataParallel, a drop-in for torch's FSDP1 wrapper.

``from fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy`` replaces
``from torch.distributed.fsdp import ...``; the wrap policies are in
:mod:`fsdp.wrap`. See the package README for the design.
"""

from flatparam import CollectiveError, RankDisagreementError
from fsdp._clean_exit import register_clean_exit
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

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CollectiveError",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "RankDisagreementError",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "TrainingState",
    "__version__",
]

register_clean_exit()
