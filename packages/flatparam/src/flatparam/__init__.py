"""flatparam: flatten parameters into one FlatParameter and shard it.

No ``torch.distributed`` here: the sharding is pure arithmetic on sizes, in two
layouts: :class:`ShardLayout` cuts one flat tensor into equal chunks (FSDP1,
ZeRO), :class:`ChunkLayout` cuts every parameter along a dimension and packs a
rank's chunks into one buffer (FSDP2's per-parameter sharding). fsdp and
zero_optim share them and test them alone.
"""

from flatparam._agreement import check_fingerprints_agree
from flatparam._chunk_layout import ChunkLayout
from flatparam._clean_exit import register_clean_exit
from flatparam._flat_param import (
    FlatParameter,
    ParamInfo,
    ParamOffset,
    ShardMetadata,
    SharedParamInfo,
)
from flatparam._optional import import_optional
from flatparam._rank_errors import CollectiveError, RankDisagreementError, named_backend_failures
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
from flatparam._wrapper import FLAT_PARAM, FPW_MODULE, FlattenParamsWrapper

__all__ = [
    "FLAT_PARAM",
    "FPW_MODULE",
    "ChunkLayout",
    "CollectiveError",
    "FlatParameter",
    "FlattenParamsWrapper",
    "ParamInfo",
    "ParamOffset",
    "RankDisagreementError",
    "ShardLayout",
    "ShardMetadata",
    "ShardPiece",
    "SharedParamInfo",
    "__version__",
    "align_numel_for",
    "check_fingerprints_agree",
    "import_optional",
    "named_backend_failures",
    "pad_flat",
    "register_clean_exit",
    "shard_flat",
    "unpad_flat",
    "unshard_flat",
]
