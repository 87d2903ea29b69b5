"""ckpt: atomic, verified, parallel checkpoints on torch.distributed.checkpoint.

``save``/``load`` take a dict of models, optimizers, stateful objects, tensors and
plain objects (like DCP's); every rank writes its own shards; the checkpoint appears
by one atomic rename after all ranks finish, with a manifest of checksums that
``load`` verifies first (and never runs code from the checkpoint; a ``key`` signs and
checks the manifest). ``CheckpointManager`` keeps step-numbered checkpoints for a
training loop; ``MemorySnapshots`` keeps the training state in host memory every few
steps, replicated on another machine, so a lost worker or machine costs no steps;
``load_pretrained`` fills a sharded model from safetensors weights
shard by shard; the ``ckpt`` program (``python -m ckpt``) lists, inspects, verifies
and exports checkpoints. ``get_state_dict``/``set_state_dict`` and the rest of
``torch.distributed.checkpoint.state_dict``'s API work on our wrappers too
(``ckpt.torch_compat.install()`` puts them under torch's names). See the package
README.
"""

from ckpt._commit.agreement import CheckpointDisagreementError
from ckpt._commit.manager import CheckpointManager
from ckpt._commit.save_load import (
    AsyncSave,
    CheckpointInfo,
    async_save,
    load,
    save,
    verify,
    wait_pending,
)
from ckpt._commit.staging import release_staging_buffers
from ckpt._errors import (
    CheckpointCollectiveError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointInUseError,
    CorruptCheckpointError,
    DiskFullError,
    FileProblem,
    NotACheckpointError,
    PartialCheckpointError,
    ShapeMismatch,
    SignatureError,
    StateDictMismatchError,
    UnsafeCheckpointError,
)
from ckpt._format.manifest import MANIFEST_NAME, Checksum, FileRecord, Manifest
from ckpt._memory.snapshots import Found, MemorySnapshots, SnapshotError
from ckpt._state_dict_api.functions import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from ckpt._tools.pretrained import PretrainedLoad, load_pretrained
from ckpt._version import __version__
from ckpt._wrappers.adapters import (
    StateAdapter,
    StateContext,
    Stateful,
    register_adapter,
    register_builtin_adapters,
)
from ckpt._wrappers.fsdp1_model import LocalShardMismatchError
from ckpt._wrappers.fsdp1_state_dict_type import (
    get_state_dict_type,
    set_state_dict_type,
    state_dict_type,
)
from ckpt._wrappers.optim_state import load_optim_state_dict, optim_state_dict
from flatparam import CollectiveError, RankDisagreementError
from fsdp.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

__all__ = [
    "MANIFEST_NAME",
    "AsyncSave",
    "CheckpointCollectiveError",
    "CheckpointDisagreementError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInUseError",
    "CheckpointInfo",
    "CheckpointManager",
    "Checksum",
    "CollectiveError",
    "CorruptCheckpointError",
    "DiskFullError",
    "FileProblem",
    "FileRecord",
    "Found",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalShardMismatchError",
    "LocalStateDictConfig",
    "Manifest",
    "MemorySnapshots",
    "NotACheckpointError",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "PartialCheckpointError",
    "PretrainedLoad",
    "RankDisagreementError",
    "ShapeMismatch",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "SignatureError",
    "SnapshotError",
    "StateAdapter",
    "StateContext",
    "StateDictConfig",
    "StateDictMismatchError",
    "StateDictOptions",
    "StateDictSettings",
    "StateDictType",
    "Stateful",
    "UnsafeCheckpointError",
    "__version__",
    "async_save",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "get_state_dict_type",
    "load",
    "load_optim_state_dict",
    "load_pretrained",
    "optim_state_dict",
    "register_adapter",
    "release_staging_buffers",
    "save",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "set_state_dict_type",
    "state_dict_type",
    "verify",
    "wait_pending",
]

register_builtin_adapters()
