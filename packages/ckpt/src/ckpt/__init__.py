"""ckpt: atomic, verified, parallel checkpoints on torch.distributed.checkpoint.

``save``/``load`` take a dict of models, optimizers, stateful objects, tensors and
plain objects (like DCP's); every rank writes its own shards; the checkpoint appears
by one atomic rename after all ranks finish, with a manifest of checksums that
``load`` verifies first. ``CheckpointManager`` keeps step-numbered checkpoints for a
training loop. See the package README.
"""

from ckpt._checkpoint import (
    AsyncSave,
    CheckpointInfo,
    async_save,
    load,
    save,
    verify,
    wait_pending,
)
from ckpt._errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    FileProblem,
    NotACheckpointError,
    PartialCheckpointError,
    ShapeMismatch,
    StateDictMismatchError,
)
from ckpt._manager import CheckpointManager
from ckpt._manifest import MANIFEST_NAME, Checksum, FileRecord, Manifest
from ckpt._state import StateAdapter, StateContext, Stateful, register_adapter
from ckpt._version import __version__

__all__ = [
    "MANIFEST_NAME",
    "AsyncSave",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "Checksum",
    "CorruptCheckpointError",
    "FileProblem",
    "FileRecord",
    "Manifest",
    "NotACheckpointError",
    "PartialCheckpointError",
    "ShapeMismatch",
    "StateAdapter",
    "StateContext",
    "StateDictMismatchError",
    "Stateful",
    "__version__",
    "async_save",
    "load",
    "register_adapter",
    "save",
    "verify",
    "wait_pending",
]
