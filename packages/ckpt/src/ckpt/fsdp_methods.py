"""What ``fsdp.FullyShardedDataParallel`` delegates to ckpt: the public hand-over point.

fsdp and ckpt are versioned separately, so fsdp may call ckpt only through names that
ckpt keeps stable across its 0.1.x releases, exactly as ckpt reads fsdp only through
``fsdp.units``. This module is that set, and fsdp imports nothing else from ckpt (lazily:
``import fsdp`` never needs ckpt).

* The three state-dict hooks fsdp's ``state_dict()`` / ``load_state_dict()`` call when a
  non-default state-dict type is selected (sharded, local, or a full one with
  ``rank0_only`` / ``offload_to_cpu``); what they may rely on while they run is
  [Note: state-dict hand-over] in ``fsdp.units``.
* The implementations of FSDP's state-dict-type and optimizer-state static methods,
  with torch's FSDP1 signatures (``FSDP.optim_state_dict(model, optim, ...)`` and the
  rest); ckpt's own ``ckpt.optim_state_dict`` is the wrapper-agnostic form.
* ``install_state_dict_functions`` / ``uninstall_state_dict_functions``: what
  ``fsdp.torch_compat.install()`` and ``zero_optim.torch_compat.install()`` call to put
  ckpt's ``get_state_dict`` family under torch's names (:mod:`ckpt.torch_compat`).
"""

from __future__ import annotations

from ckpt._wrappers.fsdp1_model import post_state_dict, pre_load_state_dict, pre_state_dict
from ckpt._wrappers.fsdp1_optim import (
    flatten_sharded_optim_state_dict,
    full_optim_state_dict,
    optim_state_dict,
    optim_state_dict_to_load,
    rekey_optim_state_dict,
    scatter_full_optim_state_dict,
    shard_full_optim_state_dict,
    sharded_optim_state_dict,
)
from ckpt._wrappers.fsdp1_state_dict_type import (
    get_state_dict_type,
    set_state_dict_type,
    state_dict_type,
)
from ckpt.torch_compat import install as install_state_dict_functions
from ckpt.torch_compat import uninstall as uninstall_state_dict_functions

__all__ = [
    "flatten_sharded_optim_state_dict",
    "full_optim_state_dict",
    "get_state_dict_type",
    "install_state_dict_functions",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "post_state_dict",
    "pre_load_state_dict",
    "pre_state_dict",
    "rekey_optim_state_dict",
    "scatter_full_optim_state_dict",
    "set_state_dict_type",
    "shard_full_optim_state_dict",
    "sharded_optim_state_dict",
    "state_dict_type",
    "uninstall_state_dict_functions",
]
