"""zero_optim: optimizer state sharded across data-parallel ranks (ZeRO stage 1).

A drop-in for ``torch.distributed.optim.ZeroRedundancyOptimizer`` and for
torch's ``ddp_zero_hook`` comm hooks; see the package README.
"""

import torch.distributed

from flatparam import CollectiveError, RankDisagreementError, register_clean_exit
from zero_optim._ddp_hooks import (
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    hook_with_zero_step_to_owners,
)
from zero_optim._optimizer import ZeroRedundancyOptimizer
from zero_optim._partition import Partition, sorted_greedy_partition
from zero_optim._version import __version__

__all__ = [
    "CollectiveError",
    "Partition",
    "RankDisagreementError",
    "ZeroRedundancyOptimizer",
    "__version__",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "hook_with_zero_step_to_owners",
    "sorted_greedy_partition",
]

register_clean_exit(torch.distributed)
