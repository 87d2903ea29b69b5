"""An fsdp model's ``state_dict``/``load_state_dict`` under each state-dict type.

fsdp's four state-dict hooks call these when a type other than the default FULL one
is selected (see [Note: state-dict types live in ckpt] in fsdp). Each FSDP instance
handles its own unit; ``nn.Module.state_dict`` visits the instances recursively, and
nothing is summoned, so a unit's parameters exist unsharded only while its own hook
runs.

[Note: one unit at a time]
While saving, ``nn.Module.state_dict`` sees an instance's FlatParameter (its shard)
under ``<prefix>_flat_param`` and no original parameters (they are not registered
between forward passes). The post-hook replaces that key:

* FULL: gathers the unit, copies each original parameter out of the gathered flat
  tensor (to the CPU with ``offload_to_cpu``) and drops the gathered tensor before
  returning, so a rank's device holds at most one unit unsharded at any time. With
  ``rank0_only`` the other ranks send their shards to rank 0, which copies them into
  the parameters it returns: no rank holds a unit unsharded besides that result.
* SHARDED: each parameter's dimension-0 chunk as a DTensor (see [Note: SHARDED is
  chunked per original parameter] in ``_wrappers/sharded_chunks.py``), moved straight from the
  flat shards to the chunks by one all-to-all (see [Note: a unit's bytes move once]
  in ``_wrappers/fsdp1_unit_exchange.py``): no rank holds the unit unsharded.
* LOCAL: the shard itself (padding included) as a ``DTensor`` of the padded flat
  tensor, which ``Shard(0)`` splits exactly as fsdp does; no communication.

Loading is the mirror image: the pre-hook takes the unit's keys out of the incoming
dict, rebuilds this rank's shard (from full tensors; from DTensors chunked as SHARDED
makes them by the reverse all-to-all, from other DTensors gathered parameter by
parameter; or from the local shard) and puts it under
``<prefix>_flat_param``, which ``nn.Module`` then copies into the FlatParameter with
its usual shape check. Missing keys are reported through ``missing_keys`` and shape
mismatches through ``error_msgs``, so ``load_state_dict(strict=True)`` lists them
the way it does for any module.

Everything these hooks know about the instance (its flat units, their layout and
group, where its wrapped module's keys are, the buffers' original dtypes, the
training-state check) comes from fsdp's public :mod:`fsdp.units`; what they may rely
on while fsdp hands a state dict over is [Note: state-dict hand-over] there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from ckpt._errors import CheckpointError
from ckpt._wrappers.fsdp1_runs import shard_from_runs, unit_runs, unit_template
from ckpt._wrappers.fsdp1_unit_exchange import (
    chunks_to_shard,
    gather_params_on_rank0,
    shard_to_chunks,
)
from ckpt._wrappers.loadable_values import loadable
from ckpt._wrappers.optim_dict_forms import copy_value
from ckpt._wrappers.sharded_chunks import (
    chunk_dtensor,
    full_value,
    is_chunked_like_ours,
    mesh_for,
    to_dtensor,
)
from flatparam import shard_flat
from fsdp.api import StateDictConfig, StateDictType
from fsdp.units import (
    FlatUnit,
    assert_idle,
    buffer_orig_dtypes,
    gather_flat,
    instance_flat_units,
    wrapped_prefix,
)

__all__ = [
    "RUNS_ATTR",
    "LocalShardMismatchError",
    "local_shard_of",
    "post_state_dict",
    "pre_load_state_dict",
    "pre_state_dict",
]

_CPU = torch.device("cpu")


RUNS_ATTR = "_ckpt_runs"
"""Set by ckpt's adapter on FSDP instances whose SHARDED state dict is this rank's runs
of the parameters: ``"save"``, views of the shard (and LOCAL entries the shard itself),
by reference, without a copy or a collective ([Note: capture, then copy or write] in
``_wrappers/fsdp1_runs.py``); ``"load"``, views of fresh buffers for DCP to fill, which
``load_state_dict`` then puts into the shard ([Note: loading runs])."""


class LocalShardMismatchError(CheckpointError, ValueError):
    """A LOCAL state dict does not match this rank's shard (another world size or model).

    A :class:`~ckpt.CheckpointError` like every ckpt error, and still a ``ValueError``
    for code written against its first version.
    """


def _settings(module: nn.Module) -> tuple[StateDictType, StateDictConfig]:
    return module._state_dict_type, module._state_dict_config  # type: ignore[return-value]


def pre_state_dict(module: nn.Module, prefix: str) -> None:
    """Nothing to prepare: see [Note: one unit at a time]; only the state is checked."""
    assert_idle(module, "state_dict")


def post_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
    """Replace the instance's ``_flat_param`` entry by the selected type's entries."""
    sd_type, config = _settings(module)
    offload = config.offload_to_cpu
    rank0_only = bool(getattr(config, "rank0_only", False))
    runs = module.__dict__.get(RUNS_ATTR)  # not forwarded to the wrapped module
    capture = runs == "save"
    # A frozen part (fsdp's [Note: frozen part]) is a unit of its own, under its own key;
    # only LOCAL state dicts show the keys.
    produced: dict[str, Any] = {}
    for unit in instance_flat_units(module, prefix):
        state_dict.pop(unit.key, None)
        if sd_type is StateDictType.LOCAL_STATE_DICT:
            produced[unit.key] = _local_dtensor(unit, offload, copy=not capture)
        elif runs is not None and sd_type is StateDictType.SHARDED_STATE_DICT:
            dtype = unit.flat_param.dtype
            made = unit_runs(unit, unit.flat_param) if capture else unit_template(unit, dtype)
            for index, value in made.items():
                entry = unit.params[index]
                for key in (entry.fqn, *entry.aliases):
                    produced[key] = value
        else:
            produced.update(_unit_params(unit, sd_type, offload, rank0_only))
    _strip_inner_prefix(module, state_dict, prefix, offload and not capture)
    state_dict.update(produced)
    if rank0_only and dist.get_rank() != 0:
        for key in [k for k in state_dict if k.startswith(prefix)]:
            del state_dict[key]


def _unit_params(
    unit: FlatUnit, sd_type: StateDictType, offload: bool, rank0_only: bool
) -> dict[str, Any]:
    """FULL or SHARDED entries of one unit (see [Note: one unit at a time])."""
    device = torch.device("cpu") if offload else unit.sharding.device
    sharded = sd_type is StateDictType.SHARDED_STATE_DICT
    group = unit.sharding.group
    values: list[Any]
    if sharded and unit.sharded:
        chunks = shard_to_chunks(unit, unit.flat_param.detach(), device)
        values = [
            chunk_dtensor(c, e.shape, group) for c, e in zip(chunks, unit.params, strict=True)
        ]
    elif rank0_only and not sharded:
        gathered = gather_params_on_rank0(unit, unit.flat_param.detach(), device)
        if gathered is None:
            return {}
        values = list(gathered)
    else:
        full = gather_flat(unit, unit.flat_param.detach())  # collective: every rank
        values = []
        for entry in unit.params:
            param = full[entry.start : entry.end].view(entry.shape)
            if sharded:
                values.append(to_dtensor(param, group, device))
            else:
                values.append(copy_value(param, _CPU if offload else None))
        del full
    out: dict[str, Any] = {}
    for entry, value in zip(unit.params, values, strict=True):
        out[entry.fqn] = value
        for alias in entry.aliases:
            out[alias] = value
    return out


def _strip_inner_prefix(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, offload: bool
) -> None:
    """Keys below the instance lose its ``_fsdp_wrapped_module.``; buffers regain their
    dtype from before mixed precision (and move to the CPU with ``offload``)."""
    inner = wrapped_prefix(prefix)
    orig_dtypes = buffer_orig_dtypes(module, prefix)
    for key in [k for k in state_dict if k.startswith(inner)]:
        value = state_dict.pop(key)
        new_key = prefix + key[len(inner) :]
        if isinstance(value, Tensor) and type(value) is Tensor:
            dtype = orig_dtypes.get(new_key)
            if dtype is not None:
                value = value.to(dtype)
            if offload:
                value = value.to("cpu")
        state_dict[new_key] = value


def _local_dtensor(unit: FlatUnit, offload: bool, copy: bool = True) -> DTensor | Tensor:
    """This rank's padded shard as a DTensor of the padded flat tensor (``copy=False``:
    the shard itself, for a save to write or copy as it does everything else).

    The padded flat tensor (``padded_numel = world_size * shard_numel``) splits into
    equal chunks, so ``Shard(0)`` describes the flat shards exactly. An unsharded
    unit (NO_SHARD, one rank) holds the whole flat tensor on every rank: a plain
    (replicated) tensor then.
    """
    shard = unit.flat_param.detach()
    data = copy_value(shard, _CPU if offload else None) if copy else shard
    if not unit.sharded:
        return data
    mesh = mesh_for(unit.sharding.group, data.device.type)
    return DTensor.from_local(
        data,
        mesh,
        [Shard(0)],
        run_check=False,
        shape=torch.Size([unit.layout.padded_numel]),
        stride=(1,),
    )


def local_shard_of(unit: FlatUnit, value: Any, key: str) -> Tensor:
    """This rank's padded flat shard from a LOCAL state-dict value for ``unit``.

    Raises :class:`LocalShardMismatchError` when the value was made for another shard
    layout: a LOCAL state dict only loads at the world size (and model) that saved it.
    """
    world = unit.layout.world_size
    value = loadable(value, key)
    if isinstance(value, DTensor):
        saved_world = value.device_mesh.size()
        if saved_world != world or value.placements != (Shard(0),):
            raise LocalShardMismatchError(
                f"{key}: the LOCAL state dict was saved on {saved_world} ranks ("
                f"{value.placements}), this model is sharded over {world}: a LOCAL state "
                f"dict loads only at the world size that saved it; save with "
                f"SHARDED_STATE_DICT or FULL_STATE_DICT to change world size"
            )
        if tuple(value.shape) != (unit.layout.padded_numel,):
            raise LocalShardMismatchError(
                f"{key}: the LOCAL state dict holds a padded flat parameter of "
                f"{tuple(value.shape)} elements, this model's has "
                f"({unit.layout.padded_numel},): it was saved from another model"
            )
        data = value.to_local()
    elif isinstance(value, Tensor):
        data = value.detach().reshape(-1)
        if data.numel() != unit.layout.shard_numel:
            raise LocalShardMismatchError(
                f"{key}: the LOCAL state dict holds a flat shard of {data.numel()} elements, "
                f"this rank's has {unit.layout.shard_numel}: it was saved at another world "
                f"size or from another model"
            )
    else:
        raise TypeError(f"{key}: expected a DTensor or tensor, got {type(value).__name__}")
    return data.to(device=unit.flat_param.device, dtype=unit.flat_param.dtype, copy=True)


def pre_load_state_dict(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    missing_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Rebuild this rank's shard from the incoming entries (see [Note: one unit at a time])."""
    assert_idle(module, "load_state_dict")
    sd_type, _ = _settings(module)
    runs = module.__dict__.get(RUNS_ATTR) == "load"
    shards: list[tuple[FlatUnit, Tensor | None]] = []
    for unit in instance_flat_units(module, prefix):
        shard: Tensor | None = None
        if sd_type is StateDictType.LOCAL_STATE_DICT:
            if unit.key in state_dict:
                shard = local_shard_of(unit, state_dict.pop(unit.key), unit.key)
        elif runs and sd_type is StateDictType.SHARDED_STATE_DICT:
            shard = _shard_from_runs(unit, state_dict, missing_keys)
        else:
            shard = _shard_from_params(unit, state_dict, missing_keys, error_msgs)
        shards.append((unit, shard))
    inner = wrapped_prefix(prefix)
    flat_keys = {unit.key for unit, _ in shards}
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        if key not in flat_keys:
            state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)
    for unit, shard in shards:
        # Missing or mismatched entries were reported; keep the current values.
        state_dict[unit.key] = unit.flat_param.detach() if shard is None else shard


def _shard_from_runs(
    unit: FlatUnit, state_dict: dict[str, Any], missing_keys: list[str]
) -> Tensor | None:
    """This rank's shard from the runs a ``RUNS_ATTR="load"`` template made and DCP
    filled ([Note: loading runs] in ``_wrappers/fsdp1_runs.py``): no collective."""
    held = unit_runs(unit, unit.flat_param)  # which parameters this rank has runs of
    runs: dict[int, Any] = {}
    missing: list[str] = []
    for index, entry in enumerate(unit.params):
        for alias in entry.aliases:
            state_dict.pop(alias, None)
        value = state_dict.pop(entry.fqn, None)
        if value is not None:
            runs[index] = value
        elif index in held:
            missing.append(entry.fqn)
    if missing:
        missing_keys.extend(missing)
        return None
    return shard_from_runs(unit, runs, unit.flat_param.dtype, unit.flat_param.device)


def _shard_from_params(
    unit: FlatUnit, state_dict: dict[str, Any], missing_keys: list[str], error_msgs: list[str]
) -> Tensor | None:
    """This rank's shard from FULL (tensors) or SHARDED (DTensor) entries of the unit."""
    values: list[Any] = []
    missing: list[str] = []
    for entry in unit.params:
        key = entry.fqn
        for alias in entry.aliases:
            state_dict.pop(alias, None)
        if key not in state_dict:
            missing.append(key)
            continue
        values.append(loadable(state_dict.pop(key), key))  # ShardedTensor, tensor-like
    if missing:
        missing_keys.extend(missing)
        return None
    bad = False
    for entry, value in zip(unit.params, values, strict=True):
        if not isinstance(value, Tensor):
            raise TypeError(
                f"{entry.fqn}: expected a tensor or DTensor in the state dict, "
                f"got {type(value).__name__}"
            )
        if tuple(value.shape) != tuple(entry.shape):  # a DTensor's shape is the global one
            error_msgs.append(
                f"size mismatch for {entry.fqn}: copying a param with shape "
                f"{tuple(value.shape)} from checkpoint, the shape in current model is "
                f"{tuple(entry.shape)}."
            )
            bad = True
    if bad:
        return None
    group = unit.sharding.group
    if unit.sharded and all(is_chunked_like_ours(v, group) for v in values):
        # DCP filled the template SHARDED made: the chunks are here, no gather needed.
        return chunks_to_shard(unit, [v.to_local() for v in values])
    # Full tensors (FULL), or DTensors laid out otherwise: every rank rebuilds each
    # parameter (a collective for a DTensor: every rank, same order) and keeps its shard.
    parts = [full_value(v).reshape(-1).to(unit.flat_param.dtype) for v in values]
    flat = torch.cat([p.to(unit.flat_param.device) for p in parts])
    if not unit.sharded:
        return flat
    return shard_flat(flat, unit.layout, unit.shard_index)
