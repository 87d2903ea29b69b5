"""Which code makes torch's state-dict forms for a model and for each optimizer over it.

[Note: state-dict front ends]
torch's ``get_state_dict`` family (``torch.distributed.checkpoint.state_dict``) gives
one form for every kind of model: parameter names without wrapper prefixes (FQNs),
sharded values as ``DTensor`` s, optimizer state keyed by those names. Here each kind
of model, or of optimizer, is a *front end* that makes and takes that form, and the
public functions (``_state_dict_api/functions.py``) do what does not depend on the kind:
the options, several optimizers, the flattened optimizer form, ``broadcast_from_rank0``
and the checks. The first front end in :data:`MODEL_FRONT_ENDS` that owns a model
handles it, and the first in :data:`OPTIMIZER_FRONT_ENDS` that owns an optimizer (given
its model) handles that optimizer:

* :class:`ZeroOptimizers`: ``zero_optim.ZeroRedundancyOptimizer`` over any model
  (DDP usually; the model itself goes to the next front end that owns it);
* :class:`Fsdp1Models`: models holding our ``fsdp.FullyShardedDataParallel`` (FSDP1,
  either ``use_orig_params``) and the optimizers over them, through ckpt's SHARDED and
  FULL state dicts (``_wrappers/fsdp1_model.py``, ``_wrappers/fsdp1_optim.py``);
* :class:`DTensorModels` (``_wrappers/fully_shard.py``): models whose parameters are
  ``DTensor`` s (``fully_shard``'s, ours or torch's, and tensor-parallel ones) and the
  plain optimizers over them: their own ``state_dict()`` is already the sharded form;
* :class:`TorchModels`: everything else (plain modules, DDP, torch's own FSDP1) by
  torch's own functions, as they were before :func:`ckpt.torch_compat.install`
  replaced them.

Another kind of model is one more class implementing :class:`ModelFrontEnd` and
:class:`OptimizerFrontEnd`, inserted in both lists before ``TORCH_FALLBACK``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint import state_dict as torch_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.nn.modules.module import _IncompatibleKeys

from ckpt._comm import Comm, device_of, on_device
from ckpt._state_dict_api.rank0_broadcast import DROP
from ckpt._wrappers.fqns import (
    group_names,
    groups_by_name,
    load_by_fqn,
    names_by_group,
    root_prefix,
    state_by_fqn,
)
from ckpt._wrappers.fsdp1_optim import (
    fsdp_optim_state_dict,
    init_optim_state,
    load_fsdp_optim_state_dict,
    param_names_by_group,
)
from ckpt._wrappers.fsdp1_state_dict_type import state_dict_type
from ckpt._wrappers.fully_shard import DTensorModels
from ckpt._wrappers.optim_dict_forms import GroupNames
from ckpt._wrappers.optim_state import has_fsdp
from ckpt._wrappers.sharded_chunks import to_dtensor
from ckpt._wrappers.zero import load_zero_optim_state_dict, zero_optim_state_dict
from fsdp import unwrapped_name
from fsdp.api import (
    FullStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictType,
)
from fsdp.units import FlatUnit, flat_units
from zero_optim import ZeroRedundancyOptimizer

__all__ = [
    "DTENSOR",
    "FSDP1",
    "MODEL_FRONT_ENDS",
    "OPTIMIZER_FRONT_ENDS",
    "TORCH",
    "TORCH_FALLBACK",
    "ZERO",
    "Keeper",
    "ModelFrontEnd",
    "OptimizerFrontEnd",
    "TorchFunctions",
    "comm_device",
    "model_front_end",
    "optimizer_front_end",
]

Keeper = Callable[[str, Tensor], Any]
"""(name, full tensor from rank 0) -> what this rank keeps, or ``DROP``; see
``_state_dict_api/rank0_broadcast.py``. For a model the name is the state-dict key, for an optimizer
the parameter's FQN (the tensor is one of its state values)."""


class ModelFrontEnd(Protocol):
    """Makes and takes a kind of model's state dict in torch's form (FQN keys)."""

    def owns_model(self, model: nn.Module) -> bool:
        """Whether this front end handles ``model``."""
        ...

    def model_state_dict(
        self, model: nn.Module, options: StateDictOptions, submodules: set[nn.Module] | None
    ) -> dict[str, Any]:
        """``get_model_state_dict(model, submodules=, options=)``: a collective."""
        ...

    def load_model_state_dict(
        self, model: nn.Module, state_dict: dict[str, Any], options: StateDictOptions
    ) -> _IncompatibleKeys:
        """Load ``state_dict``: sharded, full, or what :meth:`model_keeper` kept of rank 0's."""
        ...

    def model_keeper(self, model: nn.Module) -> Keeper:
        """What a rank keeps of a full state dict that rank 0 broadcasts."""
        ...


class OptimizerFrontEnd(Protocol):
    """Makes and takes a kind of optimizer's state dict in torch's form (FQN keys)."""

    def owns_optimizer(self, model: nn.Module, optim: torch.optim.Optimizer) -> bool:
        """Whether this front end handles ``optim`` (which steps ``model``'s parameters)."""
        ...

    def init_state(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        """Create the state of an optimizer that never stepped, so that a state dict has
        tensors for DCP to fill (no rank has state: a step that changes nothing)."""
        ...

    def optimizer_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, options: StateDictOptions
    ) -> dict[str, Any]:
        """The nested form (``"state"``, ``"param_groups"``) of ``optim``'s state dict, or
        ``{}`` on a rank that gets nothing (``rank0_only``). A collective."""
        ...

    def load_optimizer_state_dict(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        state_dict: dict[str, Any],
        options: StateDictOptions,
    ) -> None:
        """Load the nested form holding exactly ``optim``'s groups (see ``split``)."""
        ...

    def param_groups(self, model: nn.Module, optim: torch.optim.Optimizer) -> list[GroupNames]:
        """``optim``'s parameter groups by FQN."""
        ...

    def optimizer_keeper(self, model: nn.Module, optim: torch.optim.Optimizer) -> Keeper:
        """What a rank keeps of rank 0's optimizer state values it receives."""
        ...


@dataclasses.dataclass(frozen=True)
class TorchFunctions:
    """torch's own state-dict functions, as imported before anything replaced them."""

    get_model_state_dict: Callable[..., Any]
    get_optimizer_state_dict: Callable[..., Any]
    get_state_dict: Callable[..., Any]
    set_model_state_dict: Callable[..., Any]
    set_optimizer_state_dict: Callable[..., Any]
    set_state_dict: Callable[..., Any]


# Held in an object, not as module globals, so that ckpt.torch_compat's rebinding of
# module globals that hold torch's functions never touches these.
TORCH = TorchFunctions(
    **{f.name: getattr(torch_state_dict, f.name) for f in dataclasses.fields(TorchFunctions)}
)


def _keep_whole(name: str, full: Tensor) -> Tensor:
    return full


def comm_device(model: nn.Module) -> torch.device:
    """Where this rank's collectives for ``model``'s state dicts put their bytes: the
    model's CUDA device under NCCL, the CPU otherwise."""
    device = device_of({"model": model})
    if dist.is_initialized() and str(dist.get_backend()) == "nccl" and device is not None:
        return device
    return torch.device("cpu")


def _no_rank_has_state(model: nn.Module, has_state: bool) -> bool:
    comm = Comm.of(None)
    with on_device(comm_device(model)):
        return not any(comm.all_gather(has_state))


def _renamed_optim(state_dict: dict[str, Any], rename: Callable[[str], str]) -> dict[str, Any]:
    if not state_dict:
        return state_dict
    groups = [{**g, "params": [rename(n) for n in g["params"]]} for g in state_dict["param_groups"]]
    return {
        "state": {rename(k): v for k, v in state_dict["state"].items()},
        "param_groups": groups,
    }


class Fsdp1Models:
    """Models holding our FullyShardedDataParallel (FSDP1) and their optimizers.

    A model's state dict is ckpt's SHARDED one (``DTensor`` dimension-0 chunks per
    original parameter) or its FULL one, selected on every FSDP instance for the
    call; loading always goes through the SHARDED loader, which takes chunks, other
    ``DTensor`` layouts, ``ShardedTensor`` s and full tensors alike. The optimizer
    state is ``fsdp_optim_state_dict``'s, the same for ``use_orig_params`` True and
    False. torch's FSDP1 selects the same configs for these options.
    """

    def owns_model(self, model: nn.Module) -> bool:
        return has_fsdp(model)

    def owns_optimizer(self, model: nn.Module, optim: torch.optim.Optimizer) -> bool:
        return has_fsdp(model)

    # ---------------------------------------------------------------- model

    def model_state_dict(
        self, model: nn.Module, options: StateDictOptions, submodules: set[nn.Module] | None
    ) -> dict[str, Any]:
        sd_type = StateDictType.SHARDED_STATE_DICT
        config: StateDictConfig = ShardedStateDictConfig(offload_to_cpu=options.cpu_offload)
        if options.full_state_dict:
            # rank0_only with cpu_offload: only rank 0 holds a full copy in host memory.
            sd_type = StateDictType.FULL_STATE_DICT
            config = FullStateDictConfig(
                offload_to_cpu=options.cpu_offload, rank0_only=options.cpu_offload
            )
        with state_dict_type(model, sd_type, config):
            return state_by_fqn(model, options, submodules, partial(self._frozen_names, model))

    def _frozen_names(self, model: nn.Module, prefix: str) -> set[str]:
        frozen: set[str] = set()
        held: set[int] = set()
        for unit in flat_units(model):
            held.add(id(unit.flat_param))
            held.update(id(p) for p in unit.orig_params or ())
            if not unit.trainable:
                for e in unit.params:
                    frozen.update(n.removeprefix(prefix) for n in (e.fqn, *e.aliases))
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in held and not p.requires_grad:
                frozen.add(unwrapped_name(name).removeprefix(prefix))
        return frozen

    def load_model_state_dict(
        self, model: nn.Module, state_dict: dict[str, Any], options: StateDictOptions
    ) -> _IncompatibleKeys:
        with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            return load_by_fqn(model, state_dict, options.strict, root_prefix(model))

    def _units_by_name(self, model: nn.Module) -> dict[str, tuple[FlatUnit, torch.Size]]:
        prefix = root_prefix(model)
        out: dict[str, tuple[FlatUnit, torch.Size]] = {}
        for unit in flat_units(model):
            for e in unit.params:
                for name in (e.fqn, *e.aliases):
                    out[name.removeprefix(prefix)] = (unit, e.shape)
        return out

    def _chunk_keeper(self, model: nn.Module) -> Keeper:
        """A full tensor of a sharded unit's parameter's shape becomes this rank's
        ``Shard(0)`` chunk (the form the SHARDED loaders take without a gather)."""
        units = self._units_by_name(model)

        def keep(name: str, full: Tensor) -> Any:
            found = units.get(name)
            if found is None or not found[0].sharded or full.shape != found[1]:
                return full
            return to_dtensor(full, found[0].sharding.group, full.device)

        return keep

    def model_keeper(self, model: nn.Module) -> Keeper:
        return self._chunk_keeper(model)

    # ---------------------------------------------------------------- optimizer

    def init_state(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        # Under use_orig_params a rank whose pieces are all empty has no state while
        # the others do: the state dicts are collectives, so the ranks decide together.
        if _no_rank_has_state(model, bool(optim.state)):
            init_optim_state(optim)

    def optimizer_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, options: StateDictOptions
    ) -> dict[str, Any]:
        full = options.full_state_dict
        result = fsdp_optim_state_dict(
            model,
            optim,
            sharded=not full,
            # torch's FSDP1 keeps the full optimizer state on rank 0 alone also when it
            # is to be broadcast back from there.
            rank0_only=full and (options.cpu_offload or options.broadcast_from_rank0),
            offload_to_cpu=options.cpu_offload,
        )
        prefix = root_prefix(model)
        return _renamed_optim(result, lambda n: n.removeprefix(prefix)) if prefix else result

    def load_optimizer_state_dict(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        state_dict: dict[str, Any],
        options: StateDictOptions,
    ) -> None:
        prefix = root_prefix(model)
        if prefix:
            state_dict = _renamed_optim(state_dict, lambda n: prefix + n)
        optim.load_state_dict(
            load_fsdp_optim_state_dict(model, optim, state_dict, "set_optimizer_state_dict")
        )

    def param_groups(self, model: nn.Module, optim: torch.optim.Optimizer) -> list[GroupNames]:
        prefix = root_prefix(model)
        rows = [
            [(n.removeprefix(prefix), t) for n, t in row]
            for row in param_names_by_group(model, optim)
        ]
        return group_names(optim, rows)

    def optimizer_keeper(self, model: nn.Module, optim: torch.optim.Optimizer) -> Keeper:
        return self._chunk_keeper(model)


class ZeroOptimizers:
    """zero_optim.ZeroRedundancyOptimizer: each rank's state is that of the parameters
    it owns (the ZeRO partition), whole.

    Sharded (``full_state_dict=False``), each rank gives its own parameters' state
    under their FQNs, plain tensors that no other rank has, which DCP writes once and
    reads back at any world size; full, every rank's part is gathered (to rank 0 only
    with ``cpu_offload``, as torch's ``full_state_dict`` does for a non-FSDP model).
    Loading takes either form, or an FSDP model's (``DTensor`` chunks are gathered),
    and each rank keeps what it owns.
    """

    def owns_optimizer(self, model: nn.Module, optim: torch.optim.Optimizer) -> bool:
        return isinstance(optim, ZeroRedundancyOptimizer)

    def init_state(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        assert isinstance(optim, ZeroRedundancyOptimizer)
        # The state lives in the local optimizer, and a rank may own no parameter, so
        # the ranks decide together; the step that creates it is a collective anyway.
        if _no_rank_has_state(model, bool(optim.optim.state)):
            init_optim_state(optim)

    def optimizer_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, options: StateDictOptions
    ) -> dict[str, Any]:
        assert isinstance(optim, ZeroRedundancyOptimizer)
        return zero_optim_state_dict(
            model,
            optim,
            full=options.full_state_dict,
            rank0_only=options.full_state_dict and options.cpu_offload,
            offload_to_cpu=options.cpu_offload,
        )

    def load_optimizer_state_dict(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        state_dict: dict[str, Any],
        options: StateDictOptions,
    ) -> None:
        assert isinstance(optim, ZeroRedundancyOptimizer)
        load_zero_optim_state_dict(model, optim, state_dict)

    def param_groups(self, model: nn.Module, optim: torch.optim.Optimizer) -> list[GroupNames]:
        assert isinstance(optim, ZeroRedundancyOptimizer)
        owned = {id(p) for p in optim.params_per_rank[optim.rank]}
        return groups_by_name(
            model, optim, needs_state=lambda p: p.requires_grad and id(p) in owned
        )

    def optimizer_keeper(self, model: nn.Module, optim: torch.optim.Optimizer) -> Keeper:
        assert isinstance(optim, ZeroRedundancyOptimizer)
        names = {
            id(p): n
            for group, row in zip(optim.param_groups, names_by_group(model, optim), strict=True)
            for p, n in zip(group["params"], row, strict=True)
        }
        owned = {names[id(p)] for p in optim.params_per_rank[optim.rank]}

        def keep(name: str, full: Tensor) -> Any:
            return full if name in owned else DROP

        return keep


class TorchModels:
    """Every other model and optimizer: torch's own functions do the work."""

    def owns_model(self, model: nn.Module) -> bool:
        return True

    def owns_optimizer(self, model: nn.Module, optim: torch.optim.Optimizer) -> bool:
        return True

    def model_state_dict(
        self, model: nn.Module, options: StateDictOptions, submodules: set[nn.Module] | None
    ) -> dict[str, Any]:
        result: dict[str, Any] = TORCH.get_model_state_dict(
            model, submodules=submodules, options=options
        )
        return result

    def load_model_state_dict(
        self, model: nn.Module, state_dict: dict[str, Any], options: StateDictOptions
    ) -> _IncompatibleKeys:
        # After a broadcast (ours: see model_keeper) the dict is full on every rank.
        full = options.full_state_dict or options.broadcast_from_rank0
        options = dataclasses.replace(options, full_state_dict=full, broadcast_from_rank0=False)
        result: _IncompatibleKeys = TORCH.set_model_state_dict(model, state_dict, options=options)
        return result

    def model_keeper(self, model: nn.Module) -> Keeper:
        # Our broadcast, not torch's: torch's raises a strict load's missing keys on
        # rank 0 alone, leaving the other ranks waiting for its next tensor.
        return _keep_whole

    def init_state(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        pass  # torch's get_optimizer_state_dict does it

    def optimizer_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, options: StateDictOptions
    ) -> dict[str, Any]:
        nested = dataclasses.replace(options, flatten_optimizer_state_dict=False)
        return dict(TORCH.get_optimizer_state_dict(model, optim, options=nested))

    def load_optimizer_state_dict(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        state_dict: dict[str, Any],
        options: StateDictOptions,
    ) -> None:
        # Already nested, split, and (with broadcast_from_rank0) full on every rank.
        full = options.full_state_dict or options.broadcast_from_rank0
        nested = dataclasses.replace(
            options,
            flatten_optimizer_state_dict=False,
            broadcast_from_rank0=False,
            full_state_dict=full,
        )
        TORCH.set_optimizer_state_dict(model, optim, state_dict, options=nested)

    def param_groups(self, model: nn.Module, optim: torch.optim.Optimizer) -> list[GroupNames]:
        return groups_by_name(model, optim)

    def optimizer_keeper(self, model: nn.Module, optim: torch.optim.Optimizer) -> Keeper:
        return _keep_whole


FSDP1 = Fsdp1Models()
ZERO = ZeroOptimizers()
DTENSOR = DTensorModels()
TORCH_FALLBACK = TorchModels()

# In order; see [Note: state-dict front ends].
MODEL_FRONT_ENDS: list[ModelFrontEnd] = [FSDP1, DTENSOR, TORCH_FALLBACK]
OPTIMIZER_FRONT_ENDS: list[OptimizerFrontEnd] = [ZERO, FSDP1, DTENSOR, TORCH_FALLBACK]


def model_front_end(model: nn.Module) -> ModelFrontEnd:
    """The front end that handles ``model``."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be an nn.Module (the model the optimizers step), got "
            f"{type(model).__name__}"
        )
    return next(f for f in MODEL_FRONT_ENDS if f.owns_model(model))


def optimizer_front_end(model: nn.Module, optim: torch.optim.Optimizer) -> OptimizerFrontEnd:
    """The front end that handles ``optim`` over ``model``."""
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError(
            f"optimizers must be a torch.optim.Optimizer or an iterable of them, got a "
            f"{type(optim).__name__}"
        )
    return next(f for f in OPTIMIZER_FRONT_ENDS if f.owns_optimizer(model, optim))
