"""What a wrapped model's shards hold, for tools outside fsdp (checkpoint loaders, exporters).

fsdp keeps each unit's original parameters flattened into one tensor and splits it
over the ranks, so a rank holds arbitrary element ranges of some parameters. A tool
that fills or reads a model's weights shard by shard (loading pretrained safetensors
weights, exporting) needs exactly three facts, which this module gives without
exposing the flat-parameter machinery:

* :func:`local_shards`: for every original parameter, the range of its flattened
  elements this rank holds and a writable view of them in the rank's storage;
* :func:`unwrapped_name`: a name of the wrapped model as the unwrapped model's
  ``state_dict()`` spells it;
* :func:`is_flat_parameter`: whether a tensor of ``named_parameters()`` is fsdp's own
  flat storage (skip it) rather than an original parameter left unsharded.

The whole layout (units, their flat tensors, ranges, sharding) is in
:mod:`fsdp.units`. Together they are the public boundary between fsdp and other
packages (ckpt included): typed, documented and kept stable across fsdp 0.1.x
whatever the internal layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from flatparam import FlatParameter
from fsdp._runtime._common import TrainingState, clean_fqn
from fsdp._wrapper._flat_param_unit import ShardState
from fsdp._wrapper._fsdp_state import get_fsdp_state
from fsdp.units import flat_units

__all__ = ["LocalShard", "is_flat_parameter", "local_shards", "unwrapped_name"]


@dataclass(frozen=True)
class LocalShard:
    """The part of one original parameter that this rank holds.

    ``local[i]`` is element ``start + i`` of the flattened full parameter
    (``param.reshape(-1)``), so ``local`` covers ``[start, end)``; writing into it
    changes the model (it is a view of the rank's shard storage). ``start == end``
    when this rank holds none of the parameter.
    """

    name: str  # the unwrapped model's name of the parameter ("h.0.attn.c_attn.weight")
    aliases: tuple[str, ...]  # other names of the same tied parameter ("lm_head.weight")
    shape: torch.Size  # the full parameter's shape
    dtype: torch.dtype  # dtype of the stored shard (the original parameters' dtype)
    start: int  # first flattened element held here, inclusive
    end: int  # exclusive
    local: Tensor  # 1-D, end - start elements, a view into this rank's storage


def unwrapped_name(name: str) -> str:
    """``name`` (of ``named_parameters``/``named_buffers``/``state_dict`` of a model
    holding fsdp instances) as the unwrapped model names it."""
    return clean_fqn(name)


def is_flat_parameter(tensor: Tensor) -> bool:
    """Whether ``tensor`` is fsdp's flat storage of a unit, not an original parameter."""
    return isinstance(tensor, FlatParameter)


def local_shards(model: nn.Module) -> list[LocalShard]:
    """Every original parameter managed by the fsdp instances in ``model``, with the
    slice of it this rank holds; in module order, then flat order.

    Frozen parts are listed like the rest (see [Note: flat units] in
    :mod:`fsdp.units`, which has the whole layout). Parameters of ignored modules,
    and modules outside any fsdp instance, are not listed: they are whole on every
    rank (see :func:`is_flat_parameter`). Call it between training steps: a unit
    whose parameters are gathered (inside forward, ``summon_full_params``) raises,
    as its shard is not the storage then in use.
    """
    for module_name, module in model.named_modules():
        state = get_fsdp_state(module)
        if state is None or state.unit is None:
            continue
        unit = state.unit
        if unit.state is not ShardState.SHARDED or state.training_state is not TrainingState.IDLE:
            raise RuntimeError(
                f"fsdp unit {module_name or '<root>'} is {state.training_state.name} with its "
                f"parameters {unit.state.name}, not IDLE and SHARDED: call local_shards "
                f"between steps, outside forward and summon_full_params"
            )
    out: list[LocalShard] = []
    for flat_unit in flat_units(model):
        # this rank's padded chunk (the whole flat tensor if not sharded)
        storage = flat_unit.flat_param.data
        pieces = {p.param_index: p for p in flat_unit.local_pieces()}
        for index, param in enumerate(flat_unit.params):
            piece = pieces.get(index)
            if piece is None:
                start = end = offset = 0
            else:
                start, end, offset = piece.param_start, piece.param_end, piece.shard_offset
            out.append(
                LocalShard(
                    name=param.fqn,
                    aliases=param.aliases,
                    shape=param.shape,
                    dtype=storage.dtype,
                    start=start,
                    end=end,
                    local=storage[offset : offset + (end - start)],
                )
            )
    return out
