"""Put ckpt's state-dict functions under torch's names: :func:`install`, :func:`uninstall`.

torch's ``get_state_dict``, ``set_state_dict``, ``get_model_state_dict``,
``set_model_state_dict``, ``get_optimizer_state_dict`` and ``set_optimizer_state_dict``
(``torch.distributed.checkpoint.state_dict``) know torch's wrappers only: on our
``FullyShardedDataParallel`` under torch's name they look for torch's private FSDP
state and fail, and under its own name they take it for a plain module (full tensors
instead of shards, the flat shards' optimizer state); a ``ZeroRedundancyOptimizer``
of ours they take for a plain optimizer. :func:`install` replaces those six functions
with ckpt's (``ckpt.get_state_dict`` ...), which handle our wrappers and hand
everything else to torch's own functions unchanged, so for plain, DDP, torch FSDP1,
``fully_shard`` and tensor-parallel models nothing changes:

* in ``torch.distributed.checkpoint.state_dict``, so that code importing them from
  there afterwards gets ours (accelerate and Lightning import them inside their
  functions, at every call);
* in every module already loaded that holds torch's function objects among its
  globals (``from torch.distributed.checkpoint.state_dict import get_state_dict`` at
  module level, as torchtitan's checkpointer does), found by identity, whatever the
  name they are bound to. ckpt's own modules are left alone.

``StateDictOptions`` stays torch's class: ``ckpt.StateDictOptions`` is that class.
:func:`uninstall` puts back every object it replaced (where it has not been replaced
again since). ``fsdp.torch_compat.install()`` and ``zero_optim.torch_compat.install()``
call :func:`install` too, each as a holder of its own: the functions stay ckpt's
until every holder has called :func:`uninstall`.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from ckpt._state_dict_api import functions
from ckpt._state_dict_api.front_ends import TORCH, TorchFunctions

__all__ = ["install", "installed", "uninstall"]

_NAMES = tuple(f.name for f in dataclasses.fields(TorchFunctions))
_holders: set[str] = set()
# (module name, global name) -> torch's function that was there, while installed.
_replaced: dict[tuple[str, str], Any] = {}


def installed() -> bool:
    """Whether torch's state-dict function names hold ckpt's."""
    return bool(_holders)


def _ours(name: str) -> Any:
    return getattr(functions, name)


def _patch() -> None:
    theirs = {id(getattr(TORCH, name)): name for name in _NAMES}
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name == "ckpt" or module_name.startswith("ckpt."):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            name = theirs.get(id(value))
            if name is not None and value is getattr(TORCH, name):
                _replaced[(module_name, attr)] = value
                namespace[attr] = _ours(name)


def install(holder: str = "ckpt") -> None:
    """Put ckpt's state-dict functions under torch's names (see the module docstring).

    ``holder`` names who asks (``"fsdp"``, ``"zero_optim"``, or ``"ckpt"`` for a
    direct call); installing twice for one holder does nothing.
    """
    if holder in _holders:
        return
    _holders.add(holder)
    if len(_holders) == 1:
        _patch()


def uninstall(holder: str = "ckpt") -> None:
    """Drop ``holder``'s request; once no holder is left, put torch's functions back."""
    _holders.discard(holder)
    if _holders:
        return
    for (module_name, attr), original in _replaced.items():
        module = sys.modules.get(module_name)
        namespace = getattr(module, "__dict__", None)
        name = original.__name__
        if isinstance(namespace, dict) and namespace.get(attr) is _ours(name):
            namespace[attr] = original
    _replaced.clear()
