"""A wrapped model's units, their flat layout and their sharding, for tools outside fsdp.

Checkpointing, exporting, resharding and inspection tools need to know how fsdp
stores a model's parameters, without depending on how fsdp manages them. This
module is that knowledge as plain, frozen data, read off a model whenever asked:

* :func:`flat_units` / :func:`instance_flat_units`: every flat tensor ("unit") of
  the model, in module order, as a :class:`FlatUnit`: the original parameters it
  holds (:class:`UnitParam`: unwrapped name, tied aliases, shape, ``[start, end)``
  in the flat tensor), how it is split over ranks (a :class:`flatparam.ShardLayout`,
  which says which rank holds which range and where the padding is), the group
  it is split over (:class:`UnitSharding`), and the tensors an optimizer steps;
* :func:`gather_flat`: a tensor laid out like a unit's shard (the shard itself, an
  Adam moment of it) gathered into the unit's full flat tensor;
* what ckpt's state-dict hooks need from the FSDP instance they run for:
  :func:`wrapped_prefix`, :func:`assert_idle` and :func:`buffer_orig_dtypes`
  (see [Note: state-dict hand-over]).

Together with :mod:`fsdp.shards` this is fsdp's public boundary to other packages
(ckpt included): typed, documented, and kept stable across fsdp 0.1.x whatever the
internal classes do.

[Note: flat units]
An FSDP instance flattens the parameters it manages into one 1-D tensor, its
*flat tensor*: parameter ``p`` is ``flat[p.start : p.end].view(p.shape)``. When
the parameters mix trainable and frozen ones (a LoRA adapter inside the layer it
adapts), the frozen ones form a second flat tensor of the same instance, its
*frozen part*, flattened and sharded on its own; a :class:`FlatUnit` is one flat
tensor, so such an instance has two. A sharded flat tensor is padded at its end
to ``layout.padded_numel`` and split into ``layout.world_size`` equal chunks of
``layout.shard_numel``; rank ``r`` of ``sharding.group`` holds chunk ``r``
(``layout.bounds(r)``), and ``layout.pieces(r)`` lists the parameter slices in
it. An unsharded flat tensor (``NO_SHARD``, or one rank) has a layout over one
chunk, held whole by every rank. A parameter tied to another one in the same
unit is stored once, under its first name, the one the unwrapped model's
``named_parameters()`` yields (torch's state dicts name its optimizer state so);
its other names are ``aliases``.

[Note: state-dict hand-over]
Under the default (``FULL_STATE_DICT`` without ``rank0_only`` or ``offload_to_cpu``)
fsdp builds ``state_dict()`` itself (``_state_dict.py``). Any other setting
(recorded on each instance as ``_state_dict_type`` and ``_state_dict_config`` by
``ckpt.state_dict_type``) hands the instance's four state-dict hooks over to
``ckpt.fsdp_methods``. While those run, the instance's state dict holds each of
its flat units' shards under ``unit.key`` (also under ``use_orig_params=True``,
where the original parameters are hidden for the duration), and the keys of the
wrapped module's contents lie below :func:`wrapped_prefix`. A ``load_state_dict``
pre-hook that puts a tensor of ``shard_numel`` elements under ``unit.key`` loads it
into the shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from flatparam import FlatParameter, ShardLayout, ShardPiece, unpad_flat
from fsdp._runtime._collectives import all_gather_into
from fsdp._runtime._common import (
    FLAT_PARAM,
    FROZEN_FLAT_PARAM,
    FSDP_PREFIX,
    TrainingState,
    clean_fqn,
)
from fsdp._wrapper._flat_param_unit import FlatParamUnit
from fsdp._wrapper._fsdp_state import FSDPState, get_fsdp_state
from fsdp.api import ShardingStrategy

__all__ = [
    "FlatUnit",
    "UnitParam",
    "UnitSharding",
    "assert_idle",
    "buffer_orig_dtypes",
    "flat_units",
    "gather_flat",
    "instance_flat_units",
    "wrapped_prefix",
]


@dataclass(frozen=True)
class UnitParam:
    """One original parameter inside a unit's flat tensor: ``flat[start:end].view(shape)``."""

    fqn: str  # its name in the unwrapped model ("blocks.0.fc1.weight"), below the unit's prefix
    aliases: tuple[str, ...]  # the other names of the same tied parameter, same prefix
    shape: torch.Size
    start: int  # offset in the unpadded flat tensor, inclusive
    end: int  # exclusive

    @property
    def numel(self) -> int:
        """Elements of the parameter: ``end - start``."""
        return self.end - self.start


@dataclass(frozen=True, eq=False)
class UnitSharding:
    """The ranks a unit's flat tensor is split over (or replicated on, when unsharded)."""

    group: Any  # dist.ProcessGroup of the unit's collectives
    rank: int  # this rank in ``group``
    world_size: int  # ranks in ``group``
    strategy: ShardingStrategy  # the FSDP instance's sharding strategy (NO_SHARD on one rank)
    device: torch.device  # the compute device: where forward runs and collectives happen


@dataclass(frozen=True, eq=False)
class FlatUnit:
    """One flat tensor of an FSDP instance, as a tool sees it (see [Note: flat units])."""

    prefix: str  # the instance's name prefix in the unwrapped model ("" or "blocks.0.")
    key: str  # the flat tensor's state-dict key (prefix + "_flat_param" or "_flat_param_frozen")
    params: tuple[UnitParam, ...]  # in flat order
    layout: ShardLayout  # how the flat tensor splits over ranks (one chunk if unsharded)
    sharding: UnitSharding
    flat_param: nn.Parameter  # this rank's chunk (the whole flat tensor if unsharded), 1-D
    orig_params: tuple[nn.Parameter, ...] | None  # use_orig_params: the originals, in flat order

    @property
    def sharded(self) -> bool:
        """Whether ranks hold different chunks (False: every rank holds the whole tensor)."""
        return self.layout.world_size > 1

    @property
    def shard_index(self) -> int:
        """Which of ``layout``'s chunks this rank holds (0 when unsharded)."""
        return self.sharding.rank if self.sharded else 0

    @property
    def trainable(self) -> bool:
        """False for a frozen part or a unit of frozen parameters: no gradient, no optimizer."""
        return self.flat_param.requires_grad

    def local_pieces(self) -> tuple[ShardPiece, ...]:
        """The parameter slices this rank's chunk holds (all of them when unsharded).

        Under ``use_orig_params=True`` ``orig_params[piece.param_index]`` is this rank's
        piece as a 1-D view of ``flat_param[piece.shard_offset :][: piece.numel]``
        (when sharded), so an optimizer's per-element state of it lies there too.
        """
        return tuple(self.layout.pieces(self.shard_index))

    def fqns(self) -> list[str]:
        """The parameters' names in flat order (aliases not included)."""
        return [p.fqn for p in self.params]


def _join(module_name: str, name: str) -> str:
    return clean_fqn(f"{module_name}.{name}" if module_name else name)


def _module_order(module: nn.Module) -> dict[str, int]:
    """Unwrapped module path below ``module`` -> its place in ``named_modules()`` pre-order."""
    order: dict[str, int] = {}
    for path, _ in module.named_modules(remove_duplicate=False):
        order.setdefault(clean_fqn(path + ".").rstrip(".") if path else "", len(order))
    return order


def _params_of(unit: FlatParamUnit, prefix: str, module: nn.Module) -> tuple[UnitParam, ...]:
    """The unit's parameters (``module``: the instance's); a tied one under torch's name
    for it (see [Note: flat units])."""
    flat: FlatParameter = unit.flat_param
    order = _module_order(module) if flat._shared_param_infos else {}
    uses: dict[tuple[int, str], list[tuple[str, str]]] = {}
    for shared in flat._shared_param_infos:
        key = (id(shared.prim_module), shared.prim_param_name)
        uses.setdefault(key, []).append((shared.module_name, shared.param_name))
    out: list[UnitParam] = []
    for index, info in enumerate(flat._param_infos):
        start, end = unit.layout.param_bounds(index)
        names = [(info.module_name, info.param_name)]
        names += uses.get((id(info.module), info.param_name), [])
        # The flat parameter records a tied parameter under the use it met first, which
        # for a tie across units is the owner's own (the LM head before the embedding
        # that a nested unit holds). A stable sort on the module's place puts first the
        # use that ``named_parameters()`` yields, the name torch's state dicts give it.
        names.sort(key=lambda use: order.get(clean_fqn(use[0] + ".").rstrip("."), len(order)))
        fqn, *aliases = [prefix + _join(m, n) for m, n in names]
        out.append(
            UnitParam(
                fqn=fqn,
                aliases=tuple(aliases),
                shape=flat._param_shapes[index],
                start=start,
                end=end,
            )
        )
    return tuple(out)


def _state_of(instance: nn.Module) -> FSDPState:
    state = get_fsdp_state(instance)
    if state is None:
        raise TypeError(
            f"expected an FSDP instance (FullyShardedDataParallel), got "
            f"{type(instance).__name__}; use flat_units(model) for a model holding several"
        )
    return state


def instance_flat_units(instance: nn.Module, prefix: str = "") -> list[FlatUnit]:
    """The flat units of one FSDP instance (none, one, or two with a frozen part).

    Names are ``prefix`` followed by the parameter's name below the instance, with
    fsdp's wrapper levels removed; a state-dict hook passes its own ``prefix``.
    """
    state = _state_of(instance)
    if state.unit is None:
        return []
    strategy = getattr(instance, "sharding_strategy", ShardingStrategy.FULL_SHARD)
    out: list[FlatUnit] = []
    for part, key in zip(state.unit.parts(), (FLAT_PARAM, FROZEN_FLAT_PARAM), strict=False):
        cfg = part.config
        orig = part.orig
        out.append(
            FlatUnit(
                prefix=prefix,
                key=prefix + key,
                params=_params_of(part, prefix, state.module),
                layout=part.layout,
                sharding=UnitSharding(
                    group=cfg.group,
                    rank=cfg.rank,
                    world_size=cfg.world_size,
                    strategy=strategy,
                    device=cfg.compute_device,
                ),
                flat_param=part.flat_param,
                orig_params=None if orig is None else tuple(orig.params),
            )
        )
    return out


def flat_units(model: nn.Module) -> list[FlatUnit]:
    """Every flat unit of the FSDP instances in ``model``, in module (pre-)order.

    Each instance's main unit comes before its frozen part. Parameters outside every
    instance (ignored modules, a model with no fsdp) are in no unit: they are whole
    on every rank, in ``model.named_parameters()``. Reading the result is free of
    communication; the values are read when called, so call it again after
    changing the model.
    """
    out: list[FlatUnit] = []
    for name, module in model.named_modules():
        if get_fsdp_state(module) is not None:
            prefix = clean_fqn(name + ".") if name else ""
            out.extend(instance_flat_units(module, prefix))
    return out


def gather_flat(unit: FlatUnit, shard: Tensor) -> Tensor:
    """The full unpadded flat tensor (1-D, ``layout.full_numel``) from every rank's ``shard``.

    ``shard`` is laid out like ``unit.flat_param`` (this rank's padded chunk, e.g. an
    Adam moment of it), in any dtype. A collective over ``unit.sharding.group`` when
    the unit is sharded (call it on every rank, for the same units in the same
    order); an unsharded unit's ``shard`` is already whole and is returned as is.
    The result is on the compute device.
    """
    if not unit.sharded:
        return shard
    if shard.numel() != unit.layout.shard_numel:
        raise ValueError(
            f"gather_flat: {unit.key} has shards of {unit.layout.shard_numel} elements on "
            f"every rank, got a tensor of {shard.numel()} on rank {unit.sharding.rank}; pass "
            "a tensor laid out like unit.flat_param"
        )
    device = unit.sharding.device
    padded = torch.empty(unit.layout.padded_numel, dtype=shard.dtype, device=device)
    all_gather_into(padded, shard.detach().reshape(-1).to(device), unit.sharding.group).wait()
    return unpad_flat(padded, unit.layout)


def wrapped_prefix(prefix: str) -> str:
    """Where ``nn.Module.state_dict`` puts the keys of what the FSDP instance at
    ``prefix`` wraps (its own module's parameters, buffers and children)."""
    return prefix + FSDP_PREFIX


def assert_idle(instance: nn.Module, what: str) -> None:
    """Raise :class:`~fsdp.TrainingStateError` unless the FSDP instance is between steps.

    ``what`` names the operation in the message ("state_dict"). Inside forward,
    backward or ``summon_full_params`` a unit's shard is not the storage in use.
    """
    _state_of(instance).assert_state(TrainingState.IDLE, what)


def buffer_orig_dtypes(instance: nn.Module, prefix: str = "") -> dict[str, torch.dtype]:
    """State-dict keys of the instance's buffers that mixed precision cast, to the dtype
    they had before, so a state dict can hold them as the unwrapped model does.

    Keys are ``prefix`` followed by the buffer's name below the instance, unwrapped.
    """
    state = _state_of(instance)
    if not state.buffer_orig_dtypes:
        return {}
    where = {id(m): name for name, m in state.module.named_modules()}
    out: dict[str, torch.dtype] = {}
    for (module, name), dtype in state.buffer_orig_dtypes.items():
        module_name = where.get(id(module))
        if module_name is not None:
            out[prefix + _join(module_name, name)] = dtype
    return out
