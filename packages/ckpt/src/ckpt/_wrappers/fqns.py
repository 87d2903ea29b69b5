"""A model's parameter names in torch's state-dict form (FQNs): without the prefixes of
wrappers around the whole model, grouped as an optimizer groups them, and a tied
parameter's other names. Shared by the state-dict front ends ([Note: state-dict front
ends]) and ckpt's adapters.

[Note: a tied parameter's name]
A parameter reachable under several names (an embedding tied to the LM head) has one
optimizer state. torch's state-dict API keys it by the first name the model's
``named_parameters()`` yields (``transformer.wte.weight``), and so do we: the names
come from :func:`param_names` (``fully_shard``, DDP + zero_optim, plain
models) and ``fsdp.units`` (FSDP1, whose ``UnitParam.fqn`` is that name). Before issue
33 ours keyed it by the last one (``lm_head.weight``) for ``fully_shard``, DDP +
zero_optim and an FSDP1 tie across units, so neither side loaded the other's
checkpoint. Every load takes either name: the state-dict API and FSDP1's and ZeRO's
loaders through :func:`tied_names` and ``optim_dict_forms.rename_tied``,
``ckpt.load`` by :func:`adopt_saved_names` on its template. A model state dict holds
a tied parameter under all its names, as torch's does.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.nn.modules.module import _IncompatibleKeys

from ckpt._wrappers.optim_dict_forms import GroupNames
from fsdp import unwrapped_name
from fsdp.units import flat_units

__all__ = [
    "adopt_saved_names",
    "ddp_prefix",
    "group_names",
    "groups_by_name",
    "load_by_fqn",
    "names_by_group",
    "only_submodules",
    "param_names",
    "root_prefix",
    "state_by_fqn",
    "tied_names",
]


def root_prefix(model: nn.Module) -> str:
    """The key prefix of wrappers around the whole model that FQNs leave out: DDP's
    ``module.``, ``torch.compile``'s ``_orig_mod.`` (fsdp's own levels are already
    gone from its names)."""
    prefix = ""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            level, inner = "module.", getattr(model, "module", None)
        elif type(model).__name__ == "OptimizedModule":
            level, inner = "_orig_mod.", getattr(model, "_orig_mod", None)
        else:
            return prefix
        if not isinstance(inner, nn.Module):
            return prefix
        prefix, model = prefix + level, inner


def state_by_fqn(
    model: nn.Module,
    options: StateDictOptions,
    submodules: set[nn.Module] | None,
    frozen: Callable[[str], set[str]],
    keep_vars: bool = False,
) -> dict[str, Any]:
    """``model.state_dict()`` keyed by FQN: :func:`root_prefix` removed, the names
    ``frozen(prefix)`` gives left out under ``ignore_frozen_params``, and the
    ``submodules=`` filter applied. Values as the model's own state dict holds them;
    with ``keep_vars`` the parameters themselves, not detached aliases: only for a
    caller that reads their memory and hands them to nobody (a save's capture, where
    the thousand ``detach()`` calls of a ``DTensor`` model were a sixth of a repeated
    save)."""
    prefix = root_prefix(model)
    with torch.no_grad():
        raw = model.state_dict(keep_vars=keep_vars)
    state = {k.removeprefix(prefix): v for k, v in raw.items()}
    if options.ignore_frozen_params:
        left_out = frozen(prefix)
        state = {k: v for k, v in state.items() if k not in left_out}
    if submodules:
        state = only_submodules(model, state, submodules, options, prefix)
    return state


def load_by_fqn(
    model: nn.Module, state_dict: Mapping[str, Any], strict: bool, prefix: str
) -> _IncompatibleKeys:
    """``model.load_state_dict`` of an FQN-keyed ``state_dict`` (``prefix``, from
    :func:`root_prefix`, put back), reporting the keys it found amiss as FQNs too."""
    with torch.no_grad():
        result = model.load_state_dict(
            {prefix + k: v for k, v in state_dict.items()}, strict=strict
        )
    return _IncompatibleKeys(
        [k.removeprefix(prefix) for k in result.missing_keys],
        [k.removeprefix(prefix) for k in result.unexpected_keys],
    )


def group_names(
    optim: torch.optim.Optimizer, names: list[list[tuple[str, bool]]]
) -> list[GroupNames]:
    """``names``: per group, (FQN, whether this rank must load state for it)."""
    return [
        GroupNames(
            names=tuple(n for n, _ in row),
            needs_state=frozenset(n for n, needed in row if needed),
            keys=tuple(k for k in group if k != "params"),
        )
        for group, row in zip(optim.param_groups, names, strict=True)
    ]


def groups_by_name(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    prefix: str = "",
    needs_state: Callable[[nn.Parameter], bool] = lambda p: p.requires_grad,
) -> list[GroupNames]:
    """``optim``'s parameter groups by FQN (``prefix`` removed), each parameter marked
    by ``needs_state`` (default: it trains) as one this rank loads state for."""
    rows = [
        [
            (n.removeprefix(prefix), needs_state(p))
            for n, p in zip(names, group["params"], strict=True)
        ]
        for names, group in zip(names_by_group(model, optim), optim.param_groups, strict=True)
    ]
    return group_names(optim, rows)


def ddp_prefix(model: nn.Module) -> str:
    """DDP's ``module.`` where ``model`` is a DDP, else nothing."""
    return "module." if isinstance(model, nn.parallel.DistributedDataParallel) else ""


def param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its FQN without wrapper prefixes (DDP's ``module.``, FSDP's); a
    tied parameter's is the first of its names, as torch's ([Note: a tied parameter's
    name] above)."""
    prefix = ddp_prefix(model)
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), unwrapped_name(name).removeprefix(prefix))
    return names


def names_by_group(model: nn.Module, zero: torch.optim.Optimizer) -> list[list[str]]:
    """Per parameter group of ``zero`` (any optimizer over ``model``): its parameters' FQNs."""
    names = param_names(model)
    out: list[list[str]] = []
    for group in zero.param_groups:
        row = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"the {type(zero).__name__} holds a parameter of shape {tuple(p.shape)} that "
                    "is not a parameter of the model; pass the model it was built from"
                )
            row.append(names[id(p)])
        out.append(row)
    return out


def only_submodules(
    model: nn.Module,
    state: dict[str, Any],
    submodules: set[nn.Module],
    options: StateDictOptions,
    prefix: str,
) -> dict[str, Any]:
    """The deprecated ``submodules=`` filter, with torch's meaning."""
    wanted = {id(m) for m in submodules}
    prefixes = [
        unwrapped_name(name + ".").removeprefix(prefix)
        for name, m in model.named_modules()
        if id(m) in wanted and name
    ]
    out: dict[str, Any] = {}
    for key, value in state.items():
        for p in prefixes:
            if key.startswith(p):
                out[key if options.keep_submodule_prefixes else key[len(p) :]] = value
    return out


def tied_names(model: nn.Module, prefix: str = "") -> dict[str, str]:
    """Each other name of a tied parameter -> the name torch gives it, the first that
    ``named_parameters()`` yields (see [Note: a tied parameter's name]); names unwrapped,
    ``prefix`` removed. Empty for a model without ties (the usual case). No collective.

    A FlatParameter unit's ties come from ``fsdp.units`` (its original parameters are
    no parameters of the model under ``use_orig_params=False``); every other from
    ``named_parameters(remove_duplicate=False)``, which yields each name of a tied
    parameter.
    """
    out: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        fqn = unwrapped_name(name).removeprefix(prefix)
        if first.setdefault(id(p), fqn) != fqn:
            out[fqn] = first[id(p)]
    for unit in flat_units(model):
        for e in unit.params:
            for alias in e.aliases:
                out[alias.removeprefix(prefix)] = e.fqn.removeprefix(prefix)
    return out


def adopt_saved_names(
    state_dict: dict[str, Any],
    state: Mapping[str, Any],
    model_of: Callable[[torch.optim.Optimizer], nn.Module],
    saved: Collection[str],
) -> None:
    """Rename, in ``ckpt.load``'s template ``state_dict`` (``state``'s entries as DCP
    state dicts), a tied parameter's optimizer state to the name the checkpoint uses
    where that is another of its names (a checkpoint keyed by the last name, see
    [Note: a tied parameter's name]), so DCP reads it; the optimizer's load takes
    either name. ``model_of``: the model an optimizer in ``state`` steps; ``saved``:
    the checkpoint's DCP keys. No collective; every rank renames alike (the same
    checkpoint, the same model).
    """
    for entry, obj in state.items():
        template = state_dict.get(entry)
        if not isinstance(obj, torch.optim.Optimizer) or not isinstance(template, dict):
            continue
        named = template.get("state")
        if not isinstance(named, dict):
            continue
        try:
            model = model_of(obj)
        except ValueError:
            continue  # no model beside it: its adapter has said so already
        # The adapters' names drop the wrappers around the whole model, or keep them.
        renames = {**tied_names(model), **tied_names(model, root_prefix(model))}
        if not renames:
            continue
        head = f"{entry}.state."
        ours = {name: [a for a, n in renames.items() if n == name] for name in named}
        for name, aliases in ours.items():
            if not aliases or any(k.startswith(f"{head}{name}.") for k in saved):
                continue
            for alias in aliases:
                if any(k.startswith(f"{head}{alias}.") for k in saved):
                    named[alias] = named.pop(name)
                    break
