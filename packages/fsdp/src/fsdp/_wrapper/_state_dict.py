"""``model.state_dict()`` / ``load_state_dict()`` of a wrapped model: the unwrapped keys.

The default of torch's FSDP (``StateDictType.FULL_STATE_DICT`` without
``rank0_only``) and the one this package implements: ``state_dict()`` returns
the full parameters and buffers under the keys of the model before wrapping,
on every rank, and ``load_state_dict()`` accepts such a dict. The other
state-dict types and the optimizer state dicts are the ``ckpt`` package's.

Each FSDP instance registers four hooks. Before ``nn.Module.state_dict``
visits an instance it summons that instance's unit (see [Note: summoned
parameters]), so the original parameters are registered on their modules;
after the visit the hook strips the instance's ``_fsdp_wrapped_module.`` from
the keys it produced and ends the summon. Loading does the reverse: the
pre-hook summons (with write-back) and inserts the prefix into the incoming
keys, the post-hook ends the summon, writing each rank's chunk back, and
cleans the reported missing/unexpected keys. Units are summoned one at a time
while saving (peak: one unit's full parameters plus the result).

[Note: state-dict types live in ckpt]
Any other setting (``SHARDED_STATE_DICT``, ``LOCAL_STATE_DICT``, or ``FULL`` with
``rank0_only``/``offload_to_cpu``), selected with ``ckpt.state_dict_type``, is
recorded on each instance (``_state_dict_type``, ``_state_dict_config``) and the
same four hooks hand over to ``ckpt.fsdp_methods``. The import is lazy, so
``import fsdp`` never needs ckpt; a non-default setting can only be made through
ckpt anyway. What ckpt may rely on while its hooks run is [Note: state-dict
hand-over] in ``units.py``, and ckpt reads the instance through that public module.
"""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Any

import torch
from torch import nn

from fsdp._runtime._common import (
    FLAT_PARAM,
    FROZEN_FLAT_PARAM,
    FSDP_PREFIX,
    TrainingState,
    clean_fqn,
)
from fsdp._wrapper._fsdp_state import FSDPState, get_fsdp_state
from fsdp._wrapper._summon import summon_unit
from fsdp.api import StateDictType
from fsdp.units import buffer_orig_dtypes

__all__ = ["ckpt_module", "register_state_dict_hooks"]


def ckpt_module(feature: str) -> ModuleType:
    """Import ``ckpt.fsdp_methods`` (ckpt's public hand-over point) for ``feature``.

    An ImportError says how to get ckpt when it is missing or too old to have it.
    """
    try:
        importlib.import_module("ckpt")
    except ImportError as e:
        if e.name != "ckpt":
            raise  # ckpt is there but broken: its own error says more
        raise ImportError(
            f"{feature} is provided by the ckpt package, which is not installed: "
            "pip install shardkit-ckpt (from a clone: pip install ./packages/ckpt; PyPI's "
            "'ckpt' is another project)"
        ) from e
    try:
        return importlib.import_module("ckpt.fsdp_methods")
    except ImportError as e:
        if e.name != "ckpt.fsdp_methods":
            raise
        raise ImportError(
            f"{feature} needs ckpt.fsdp_methods, which the installed ckpt lacks: "
            "pip install --upgrade shardkit-ckpt (from a clone: pip install ./packages/ckpt)"
        ) from e


def _custom(module: nn.Module) -> ModuleType | None:
    """ckpt's implementation if a non-default state-dict setting is selected."""
    sd_type = getattr(module, "_state_dict_type", StateDictType.FULL_STATE_DICT)
    config = getattr(module, "_state_dict_config", None)
    if (
        sd_type is StateDictType.FULL_STATE_DICT
        and not getattr(config, "offload_to_cpu", False)
        and not getattr(config, "rank0_only", False)
    ):
        return None
    return ckpt_module(f"state_dict() with {sd_type.name}")


_CTX = "_fsdp_state_dict_ctx"  # the ExitStack of an open summon, on the FSDP state


def _state(module: nn.Module) -> FSDPState:
    state = get_fsdp_state(module)
    assert state is not None
    return state


def _enter(state: FSDPState, writeback: bool) -> None:
    stack = contextlib.ExitStack()
    if state.training_state is not TrainingState.SUMMON_FULL_PARAMS:
        stack.enter_context(summon_unit(state, writeback, rank0_only=False, offload_to_cpu=False))
    setattr(state, _CTX, stack)


def _exit(state: FSDPState) -> None:
    stack = state.__dict__.pop(_CTX, None)
    if stack is not None:
        stack.close()


def _expose_flat_param(module: nn.Module) -> None:
    """Under ``use_orig_params``, show ckpt the FlatParameter instead of the originals.

    ckpt's state-dict types read and write ``<prefix>_flat_param``, as with
    ``use_orig_params=False``; the original parameters (views of the same
    shard) see whatever is loaded into it.
    """
    unit = _state(module).unit
    if unit is not None and unit.orig is not None and FLAT_PARAM not in module._parameters:
        for part, key in zip(unit.parts(), (FLAT_PARAM, FROZEN_FLAT_PARAM), strict=False):
            assert part.orig is not None
            part.orig.deregister(part.flat_param._shared_param_infos)
            module._parameters[key] = part.flat_param


def _hide_flat_param(module: nn.Module) -> None:
    """Undo :func:`_expose_flat_param`."""
    unit = _state(module).unit
    if unit is not None and unit.orig is not None and FLAT_PARAM in module._parameters:
        for part, key in zip(unit.parts(), (FLAT_PARAM, FROZEN_FLAT_PARAM), strict=False):
            assert part.orig is not None
            del module._parameters[key]
            part.orig.register(part.flat_param._shared_param_infos)


def _pre_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    custom = _custom(module)
    if custom is not None:
        _expose_flat_param(module)
        custom.pre_state_dict(module, prefix)
        return
    _enter(_state(module), writeback=False)


def _post_state_dict(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    custom = _custom(module)
    if custom is not None:
        try:
            custom.post_state_dict(module, state_dict, prefix)
        finally:
            _hide_flat_param(module)
        return
    state = _state(module)
    try:
        inner = prefix + FSDP_PREFIX
        orig_dtypes = buffer_orig_dtypes(module, prefix)
        # An unsharded unit's summoned parameters alias its FlatParameter: copy them, or
        # the next optimizer step would change the returned state dict.
        flat_storages = (
            {u.flat_param.untyped_storage().data_ptr() for u in state.unit.parts()}
            if state.unit is not None
            else set()
        )
        for key in [k for k in state_dict if k.startswith(inner)]:
            value = state_dict.pop(key)
            new_key = prefix + key[len(inner) :]
            dtype = orig_dtypes.get(new_key)
            if dtype is not None and isinstance(value, torch.Tensor):
                value = value.to(dtype)
            if (
                isinstance(value, torch.Tensor)
                and value.untyped_storage().data_ptr() in flat_storages
            ):
                value = value.clone()
            state_dict[new_key] = value
    finally:
        _exit(state)


_post_state_dict._from_public_api = True  # type: ignore[attr-defined]


def _pre_load_state_dict(  # noqa: PLR0917 (nn.Module's hook signature)
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    custom = _custom(module)
    if custom is not None:
        _expose_flat_param(module)
        custom.pre_load_state_dict(module, state_dict, prefix, missing_keys, error_msgs)
        return
    _enter(_state(module), writeback=True)
    inner = prefix + FSDP_PREFIX
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


def _post_load_state_dict(module: nn.Module, incompatible_keys: Any) -> None:
    _hide_flat_param(module)
    state = _state(module)
    _exit(state)
    if state.unit is not None:  # every rank loads: [Note: sharding across replicas]
        for part in state.unit.parts():
            part.storage.drop_replica_shard()
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [clean_fqn(k) for k in keys]


def register_state_dict_hooks(module: nn.Module) -> None:
    """Give an FSDP instance the unwrapped-keys ``state_dict``/``load_state_dict``."""
    module.register_state_dict_pre_hook(_pre_state_dict)
    module.register_state_dict_post_hook(_post_state_dict)
    module.register_load_state_dict_pre_hook(_pre_load_state_dict)
    module.register_load_state_dict_post_hook(_post_load_state_dict)
