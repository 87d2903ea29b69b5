"""Make libraries written for torch's FSDP use ours: :func:`install` and :func:`uninstall`.

Lightning, accelerate and transformers' ``Trainer`` import ``FullyShardedDataParallel``,
its option types, its wrap policies and ``ShardedGradScaler`` from
``torch.distributed.fsdp`` (and its submodules ``api``, ``fully_sharded_data_parallel``,
``wrap``, ``sharded_grad_scaler``); torchtitan, accelerate's ``fsdp_version: 2`` and
Lightning's ``ModelParallelStrategy`` import FSDP2's ``fully_shard``, ``FSDPModule``,
``MixedPrecisionPolicy``, ``CPUOffloadPolicy`` (...) from ``torch.distributed.fsdp`` or
the older ``torch.distributed._composable.fsdp``. :func:`install` puts ours under those
names in those modules, so a library that imports them afterwards gets ours, and one
that imports them inside its functions (most do) gets ours from then on::

    import fsdp.torch_compat

    fsdp.torch_compat.install()  # before importing lightning / accelerate / transformers
    import lightning as L

Patching a library's imports this way is common practice (Liger-Kernel's
``apply_liger_kernel_to_*`` does it for transformers). It is the one place in this
package that imports torch's FSDP modules, and only to replace names in them.

With the ``ckpt`` package installed, :func:`install` also puts ckpt's
``get_state_dict`` family under torch's names in ``torch.distributed.checkpoint.
state_dict`` (see ``ckpt.torch_compat``): torch's own functions would look for torch's
private FSDP state on our class. Without ckpt they stay torch's.

What stays torch's: torch's own internals, which bound torch's classes when
``torch.distributed.fsdp`` was first imported (this module imports it before
patching, so that is always before), and FSDP2's private modules (``_fsdp_param``,
``_fsdp_param_group``, ...), which only torch's own ``fully_shard`` uses.
:func:`uninstall` puts torch's objects back; both are idempotent.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

# torch's state-dict functions bind torch's FSDP1 class when first imported: before
# install() puts ours under its name, so that they keep serving torch's own FSDP1.
import torch.distributed.checkpoint.state_dict  # noqa: F401

import fsdp
from flatparam import import_optional
from fsdp import sharded_grad_scaler, wrap

__all__ = ["install", "installed", "uninstall"]

_OPTION_TYPES = (
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
)
_WRAP_NAMES = (
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
    "_or_policy",
    "_module_wrap_policy",
    "_wrap_module_cls_individually",
)


_FULLY_SHARD_NAMES = (
    "FSDPModule",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
)
_POLICY_NAMES = (
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
)


def _replacements() -> dict[str, dict[str, Any]]:
    """torch module name -> {name: our object}."""
    ours = {name: getattr(fsdp, name) for name in _OPTION_TYPES}
    fully_shard = {name: getattr(fsdp, name) for name in _FULLY_SHARD_NAMES}
    policies = {name: getattr(fsdp, name) for name in _POLICY_NAMES}
    fsdp_names = {
        **ours,
        **fully_shard,
        **policies,
        "FullyShardedDataParallel": fsdp.FullyShardedDataParallel,
        "OptimStateKeyType": fsdp.OptimStateKeyType,
    }
    return {
        "torch.distributed.fsdp": fsdp_names,
        "torch.distributed.fsdp._fully_shard": {**fully_shard, **policies},
        "torch.distributed.fsdp._fully_shard._fully_shard": fully_shard,
        "torch.distributed.fsdp._fully_shard._fsdp_api": policies,
        "torch.distributed._composable.fsdp": {**fully_shard, **policies},
        "torch.distributed._composable.fsdp.fully_shard": fully_shard,
        "torch.distributed.fsdp.api": ours,
        "torch.distributed.fsdp.fully_sharded_data_parallel": fsdp_names,
        "torch.distributed.fsdp.wrap": {name: getattr(wrap, name) for name in _WRAP_NAMES},
        "torch.distributed.fsdp.sharded_grad_scaler": {
            "ShardedGradScaler": sharded_grad_scaler.ShardedGradScaler
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
    """Put our FSDP classes, option types, wrap policies and scaler under torch's names.

    Call it before importing the library that should use them. Idempotent; undone by
    :func:`uninstall`.
    """
    if _saved:
        return
    ckpt = _ckpt_hand_over()
    if ckpt is not None:
        ckpt.install_state_dict_functions("fsdp")
    replacements = _replacements()
    # Import every module first: one imported after another was patched would copy our
    # objects into its namespace (torch.distributed._composable.fsdp re-exports
    # torch.distributed.fsdp's names), and those would pass for torch's at uninstall().
    modules = {name: importlib.import_module(name) for name in replacements}
    for module_name, names in replacements.items():
        module = modules[module_name]
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
            ckpt.uninstall_state_dict_functions("fsdp")
    _saved.clear()
