"""Models whose parameters are ``DTensor`` s (fully_shard's, ours or torch's), in torch's
state-dict forms: a front end of [Note: state-dict front ends].

Such a model's own ``state_dict()`` already is the sharded form (the parameters'
``DTensor`` s, under their names), and a plain optimizer over it holds ``DTensor``
state of the same placements, so the sharded forms need no conversion at all. The
full forms are each ``DTensor``'s ``full_tensor()`` (a collective), and a full tensor
goes back into a parameter, or into optimizer state, as this rank's part of it: the
same placements, cut locally (``distribute_tensor`` with no source rank: every rank
holds the whole tensor by then, so nothing is sent). torch's own functions take other
routes for such models; on CPU in torch 2.13 their full optimizer state dicts do not
load back (a ``KeyError`` in torch's unflattening, with its own ``fully_shard`` too),
which these conversions avoid.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.modules.module import _IncompatibleKeys

from ckpt._comm import Comm, global_rank, on_device
from ckpt._wrappers.fqns import (
    groups_by_name,
    load_by_fqn,
    names_by_group,
    param_names,
    root_prefix,
    state_by_fqn,
    tied_names,
)
from ckpt._wrappers.fsdp1_optim import init_optim_state
from ckpt._wrappers.optim_dict_forms import GroupNames, rename_tied

__all__ = ["DTensorModels", "has_dtensor_params"]


def has_dtensor_params(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a ``DTensor``."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def _full(value: Any, cpu: bool) -> Any:
    """A ``DTensor`` as its full tensor (collective), on the CPU if ``cpu``."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if cpu and isinstance(value, Tensor):
        value = value.cpu()
    return value


def _as_like(value: Any, like: Tensor) -> Any:
    """``value`` in the layout of ``like`` (a parameter): a full tensor of a ``DTensor``
    parameter's shape becomes this rank's part of it, cut locally."""
    if not isinstance(like, DTensor) or isinstance(value, DTensor):
        return value
    if not isinstance(value, Tensor) or value.shape != like.shape:
        return value  # a step count, or a mistake the loader names
    full = value.to(device=like.device_mesh.device_type, dtype=value.dtype)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


class DTensorModels:
    """Models with ``DTensor`` parameters, and the plain optimizers over them."""

    def owns_model(self, model: nn.Module) -> bool:
        return has_dtensor_params(model)

    def owns_optimizer(self, model: nn.Module, optim: torch.optim.Optimizer) -> bool:
        return has_dtensor_params(model)

    # ---------------------------------------------------------------- model

    def model_state_dict(
        self, model: nn.Module, options: StateDictOptions, submodules: set[nn.Module] | None
    ) -> dict[str, Any]:
        def frozen(prefix: str) -> set[str]:
            named = model.named_parameters(remove_duplicate=False)
            return {n.removeprefix(prefix) for n, p in named if not p.requires_grad}

        state = state_by_fqn(model, options, submodules, frozen)
        if options.full_state_dict:
            state = {k: _full(v, options.cpu_offload) for k, v in state.items()}
            if options.cpu_offload and global_rank() != 0:
                return {}  # full and offloaded: on rank 0 only, as torch's
        elif options.cpu_offload:
            state = {k: _offload(v) for k, v in state.items()}
        return state

    def load_model_state_dict(
        self, model: nn.Module, state_dict: dict[str, Any], options: StateDictOptions
    ) -> _IncompatibleKeys:

        prefix = root_prefix(model)
        current = model.state_dict()
        given = {
            k: _as_like(v, current[prefix + k]) if prefix + k in current else v
            for k, v in state_dict.items()
        }
        return load_by_fqn(model, given, options.strict, prefix)

    def model_keeper(self, model: nn.Module) -> Any:

        prefix = root_prefix(model)
        current = model.state_dict()

        def keep(name: str, full: Tensor) -> Any:
            like = current.get(prefix + name)
            return _as_like(full, like) if isinstance(like, Tensor) else full

        return keep

    # ---------------------------------------------------------------- optimizer

    def init_state(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        comm = Comm.of(None)
        with on_device(torch.device("cpu")):
            if not any(comm.all_gather(bool(optim.state))):
                init_optim_state(optim)

    def optimizer_state_dict(
        self, model: nn.Module, optim: torch.optim.Optimizer, options: StateDictOptions
    ) -> dict[str, Any]:
        prefix = root_prefix(model)
        full = options.full_state_dict
        state: dict[str, Any] = {}
        groups = []
        for group, names in zip(optim.param_groups, names_by_group(model, optim), strict=True):
            fqns = [n.removeprefix(prefix) for n in names]
            for p, fqn in zip(group["params"], fqns, strict=True):
                values = optim.state.get(p)
                if not values:
                    continue
                if full:
                    state[fqn] = {k: _full(v, options.cpu_offload) for k, v in values.items()}
                elif options.cpu_offload:
                    state[fqn] = {k: _offload(v) for k, v in values.items()}
                else:
                    state[fqn] = dict(values)
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": fqns})
        rank0_only = full and (options.cpu_offload or options.broadcast_from_rank0)
        if rank0_only and global_rank() != 0:
            return {}
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(
        self,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        state_dict: dict[str, Any],
        options: StateDictOptions,
    ) -> None:

        prefix = root_prefix(model)
        state_dict = dict(
            rename_tied(state_dict, tied_names(model, prefix), "set_optimizer_state_dict")
        )
        params = _params_by_fqn(model, prefix)
        by_id = {id(p): i for i, p in enumerate(p for g in optim.param_groups for p in g["params"])}
        state: dict[int, Any] = {}
        for fqn, values in state_dict.get("state", {}).items():
            p = params.get(fqn)
            if p is None:
                raise KeyError(
                    f"optimizer state for {fqn!r}, which is not a parameter of the model; "
                    "load the optimizer state of this model (its parameter names)"
                )
            state[by_id[id(p)]] = {k: _as_like(v, p) for k, v in values.items()}
        # ``optim.load_state_dict`` pairs a group's ids with its parameters by position,
        # so they are listed in the optimizer's order, whatever order the state dict
        # names them in (a checkpoint of another wrapper lists its own).
        groups = []
        current = names_by_group(model, optim)
        for i, (given, names) in enumerate(zip(state_dict["param_groups"], current, strict=True)):
            fqns = [n.removeprefix(prefix) for n in names]
            if sorted(given["params"]) != sorted(fqns):
                raise ValueError(
                    f"optimizer param group {i} holds {sorted(given['params'])} in the state "
                    f"dict, {sorted(fqns)} in the optimizer"
                )
            ids = [by_id[id(params[n])] for n in fqns]
            groups.append({**{k: v for k, v in given.items() if k != "params"}, "params": ids})
        optim.load_state_dict({"state": state, "param_groups": groups})

    def param_groups(self, model: nn.Module, optim: torch.optim.Optimizer) -> list[GroupNames]:
        return groups_by_name(model, optim, root_prefix(model))

    def optimizer_keeper(self, model: nn.Module, optim: torch.optim.Optimizer) -> Any:

        prefix = root_prefix(model)
        params = _params_by_fqn(model, prefix)

        def keep(name: str, full: Tensor) -> Any:
            p = params.get(name)
            return _as_like(full, p) if p is not None else full

        return keep


def _params_by_fqn(model: nn.Module, prefix: str) -> dict[str, nn.Parameter]:
    """Each parameter of ``model`` under its FQN (the first of its names), ``prefix`` removed."""
    names = param_names(model)
    return {names[id(p)].removeprefix(prefix): p for p in model.parameters() if id(p) in names}


def _offload(value: Any) -> Any:
    """A tensor (or ``DTensor``) on the CPU, sharded as it is."""
    if isinstance(value, Tensor) and value.device.type != "cpu":
        return value.cpu()
    return value
