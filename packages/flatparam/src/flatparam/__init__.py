"""flatparam: flatten parameters into one FlatParameter and shard it.

No ``torch.distributed`` here: the sharding is pure arithmetic on sizes
(:class:`ShardLayout`), so fsdp and zero_optim share it and test it alone.
"""

from flatparam._shard import (
    ShardLayout,
    ShardPiece,
    align_numel_for,
    pad_flat,
    shard_flat,
    unpad_flat,
    unshard_flat,
)
from flatparam._version import __version__

__all__ = [
    "ShardLayout",
    "ShardPiece",
    "__version__",
    "align_numel_for",
    "pad_flat",
    "shard_flat",
    "unpad_flat",
    "unshard_flat",
]
