"""Make code written for torch's ZeRO use ours: :func:`install` and :func:`uninstall`.

Puts our ``ZeroRedundancyOptimizer`` under torch's name in ``torch.distributed.optim``
and ``torch.distributed.optim.zero_redundancy_optimizer``, and our DDP comm hooks
(``hook_with_zero_step``, ``hook_with_zero_step_interleaved``) in
``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook``, so that a library
importing them afterwards (or inside its functions) gets ours::

    import zero_optim.torch_compat

    zero_optim.torch_compat.install()  # before importing the library

With the ``ckpt`` package installed, it also puts ckpt's ``get_state_dict`` family
under torch's names in ``torch.distributed.checkpoint.state_dict`` (see
``ckpt.torch_compat``), so that torch's state-dict functions give and take a sharded,
FQN-keyed state of our optimizer too; without ckpt they stay torch's.

The one place in this package that imports torch's ZeRO modules, only to replace
names in them. torch's internals keep torch's classes (they bound them at import,
which this module triggers before patching). :func:`uninstall` puts torch's objects
back; both are idempotent.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import zero_optim
from flatparam import import_optional

__all__ = ["install", "installed", "uninstall"]


def _replacements() -> dict[str, dict[str, Any]]:
    """torch module name -> {name: our object}."""
    optimizer = {"ZeroRedundancyOptimizer": zero_optim.ZeroRedundancyOptimizer}
    return {
        "torch.distributed.optim": optimizer,
        "torch.distributed.optim.zero_redundancy_optimizer": optimizer,
        "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook": {
            "hook_with_zero_step": zero_optim.hook_with_zero_step,
            "hook_with_zero_step_interleaved": zero_optim.hook_with_zero_step_interleaved,
        },
    }


_MISSING = object()
# (module name, attribute) -> torch's object (or _MISSING), while installed.
_saved: dict[tuple[str, str], Any] = {}


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_saved)


def _ckpt_hand_over() -> ModuleType | None:
    """ckpt's hand-over module if ckpt (with the state-dict functions) is installed."""
    return import_optional("ckpt.fsdp_methods", "install_state_dict_functions")


def install() -> None:
    """Put our ZeRO optimizer and DDP comm hooks under torch's names. Idempotent."""
    if _saved:
        return
    ckpt = _ckpt_hand_over()
    if ckpt is not None:
        ckpt.install_state_dict_functions("zero_optim")
    for module_name, names in _replacements().items():
        module = importlib.import_module(module_name)
        for name, obj in names.items():
            _saved[(module_name, name)] = module.__dict__.get(name, _MISSING)
            setattr(module, name, obj)


def uninstall() -> None:
    """Put torch's own objects back under their names. Idempotent."""
    for (module_name, name), original in _saved.items():
        module = importlib.import_module(module_name)
        if original is _MISSING:
            module.__dict__.pop(name, None)
        else:
            setattr(module, name, original)
    if _saved:
        ckpt = _ckpt_hand_over()
        if ckpt is not None:
            ckpt.uninstall_state_dict_functions("zero_optim")
    _saved.clear()
