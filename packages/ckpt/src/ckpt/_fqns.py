"""A model's parameter names in torch's state-dict form (FQNs): without the prefixes of
wrappers around the whole model, grouped as an optimizer groups them. Shared by the
state-dict front ends ([Note: state-dict front ends])."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from ckpt._optim_dict_forms import GroupNames
from fsdp import unwrapped_name

__all__ = ["group_names", "only_submodules", "root_prefix"]


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
