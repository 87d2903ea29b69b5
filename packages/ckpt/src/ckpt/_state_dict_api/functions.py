"""torch's recommended state-dict API, for our wrappers too: ``get_state_dict`` and family.

``ckpt.get_state_dict``, ``set_state_dict``, ``get_model_state_dict``,
``set_model_state_dict``, ``get_optimizer_state_dict``, ``set_optimizer_state_dict``
and ``StateDictOptions`` (torch's own class) have the signatures and the meaning of
``torch.distributed.checkpoint.state_dict``'s, and work on every model and optimizer
those do, and on ours: ``fsdp.FullyShardedDataParallel`` (either ``use_orig_params``)
and ``zero_optim.ZeroRedundancyOptimizer`` under DDP. So a script switches from
torch's by its import alone::

    from ckpt import StateDictOptions, get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optim)  # FQN keys, DTensor chunks
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    ...
    msd, osd = get_state_dict(model, optim)  # the template on a fresh model
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)

``ckpt.torch_compat.install()`` (which ``fsdp.torch_compat.install()`` and
``zero_optim.torch_compat.install()`` call) puts these functions under torch's names,
for code that imports torch's.

What happens per kind of model and optimizer is [Note: state-dict front ends]; what
this module adds is the same for all: checking the options, one state dict for
several optimizers (each takes its parameters' part back, ``_wrappers/optim_dict_forms.py``),
the flattened optimizer form, ``broadcast_from_rank0`` (``_state_dict_api/rank0_broadcast.py``) and
the checks torch makes, with torch's words. A call that involves none of our wrappers
is torch's own function, unchanged.

[Note: every rank passes a state dict, or only rank 0]
Loading our wrappers is a collective (chunks move between ranks), so a rank that
has nothing to load cannot simply return, as torch's does for an empty dict: the
others would wait for it. Each ``set_*`` call first shares, in one small
all-gather, which ranks passed an empty dict. All empty: nothing to load. Some
empty: every rank raises the same error naming them, unless ``broadcast_from_rank0``
is set, where only rank 0's dict counts.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.nn.modules.module import _IncompatibleKeys

from ckpt._comm import Comm, global_rank, on_device
from ckpt._state_dict_api.front_ends import (
    TORCH,
    TORCH_FALLBACK,
    Keeper,
    OptimizerFrontEnd,
    comm_device,
    model_front_end,
    optimizer_front_end,
)
from ckpt._state_dict_api.rank0_broadcast import Path, broadcast_from_rank0
from ckpt._wrappers.fqns import root_prefix, tied_names
from ckpt._wrappers.optim_dict_forms import (
    flatten,
    is_flattened,
    merge,
    rename_tied,
    split,
    unflatten,
)

__all__ = [
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]


def _options(options: StateDictOptions | None, what: str) -> StateDictOptions:
    if options is None:
        return StateDictOptions()
    if not isinstance(options, StateDictOptions):
        raise TypeError(
            f"{what}: options must be a StateDictOptions (torch.distributed.checkpoint."
            f"state_dict.StateDictOptions, also ckpt.StateDictOptions), got "
            f"{type(options).__name__}"
        )
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError(
            f"{what}: full_state_dict must be True when broadcast_from_rank0 is True "
            "(rank 0 holds the full state dict it broadcasts): pass "
            "StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)"
        )
    return options


def _optimizers(
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
) -> tuple[torch.optim.Optimizer, ...]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    return tuple(optimizers)


def _warn_submodules(submodules: set[nn.Module] | None) -> None:
    if submodules:
        warnings.warn(
            "Getting submodules only model/optim state_dict is deprecated (as in torch); "
            "filter the state dict that get_state_dict returns instead",
            FutureWarning,
            stacklevel=3,
        )


def _rank0_only(options: StateDictOptions) -> bool:
    """torch's ``full_state_dict`` with ``cpu_offload``: the result on rank 0 only."""
    return options.full_state_dict and options.cpu_offload


def _check_model(state_dict: Mapping[str, Any], options: StateDictOptions, what: str) -> None:
    if (
        not state_dict
        and options.strict
        and not (
            options.ignore_frozen_params or _rank0_only(options) or options.broadcast_from_rank0
        )
    ):
        raise RuntimeError(
            f"{what} on rank {global_rank()}: The option indicates that model state_dict is "
            "required to save or load, but model state_dict is empty. Pass the model "
            "whose parameters you want (the root), or strict=False to allow it"
        )


def _check_optim(state_dict: Mapping[str, Any], options: StateDictOptions, what: str) -> None:
    if not state_dict and not (_rank0_only(options) or options.broadcast_from_rank0):
        raise RuntimeError(
            f"{what} on rank {global_rank()}: The option indicates that model state_dict is "
            "required to save, or load but optim state_dict is empty. Pass the state dict "
            "that get_optimizer_state_dict returned on this rank"
        )


# --- getting ------------------------------------------------------------------------


def _get_optim(
    model: nn.Module,
    optims: tuple[torch.optim.Optimizer, ...],
    front_ends: list[OptimizerFrontEnd],
    options: StateDictOptions,
) -> dict[str, Any]:
    parts = []
    for front_end, optim in zip(front_ends, optims, strict=True):
        front_end.init_state(model, optim)
        parts.append(front_end.optimizer_state_dict(model, optim, options))
    if _rank0_only(options) and global_rank() != 0:
        return {}
    merged = merge(parts)
    return flatten(merged) if options.flatten_optimizer_state_dict else merged


def get_model_state_dict(
    model: nn.Module,
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """The model's state dict, keyed by FQNs (parameter names of the unwrapped model).

    ``options.full_state_dict``: whole tensors (with ``cpu_offload``: on rank 0 only,
    ``{}`` elsewhere); else sharded ``DTensor`` s, which DCP saves each shard of once
    and reshards on load. ``ignore_frozen_params`` leaves parameters that do not
    require a gradient out. A collective: call it on every rank.
    """
    options = _options(options, "get_model_state_dict")
    front_end = model_front_end(model)
    if front_end is TORCH_FALLBACK:
        result: dict[str, Any] = TORCH.get_model_state_dict(
            model, submodules=submodules, options=options
        )
        return result
    _warn_submodules(submodules)
    state = front_end.model_state_dict(model, options, submodules)
    _check_model(state, options, "get_model_state_dict")
    return state


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> dict[str, Any]:
    """The optimizers' state in one dict keyed by the FQNs of ``model``'s parameters.

    ``{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}``, or with
    ``flatten_optimizer_state_dict`` one level of ``"state.<fqn>.<name>"`` and
    ``"param_groups.<fqn>.<name>"`` keys. An optimizer that never stepped gets its
    state first (one step changing nothing), so the result can be a template for
    ``dcp.load``. A collective: call it on every rank.
    """
    options = _options(options, "get_optimizer_state_dict")
    optims = _optimizers(optimizers)
    front_ends = [optimizer_front_end(model, o) for o in optims]
    if all(f is TORCH_FALLBACK for f in front_ends):
        result: dict[str, Any] = TORCH.get_optimizer_state_dict(
            model, optims, submodules=submodules, options=options
        )
        return result
    _warn_submodules(submodules)
    state = _get_optim(model, optims, front_ends, options)
    _check_optim(state, options, "get_optimizer_state_dict")
    return state


def get_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(get_model_state_dict(model), get_optimizer_state_dict(model, optimizers))``.

    The model's and the optimizers' state dicts, keyed by FQNs whatever wraps the
    model, sharded or full as ``options`` say; see the two functions. A collective.
    """
    options = _options(options, "get_state_dict")
    optims = _optimizers(optimizers)
    model_end = model_front_end(model)
    optim_ends = [optimizer_front_end(model, o) for o in optims]
    if model_end is TORCH_FALLBACK and all(f is TORCH_FALLBACK for f in optim_ends):
        result: tuple[dict[str, Any], dict[str, Any]] = TORCH.get_state_dict(
            model, optims, submodules=submodules, options=options
        )
        return result
    _warn_submodules(submodules)
    model_state = model_end.model_state_dict(model, options, submodules)
    optim_state = _get_optim(model, optims, optim_ends, options)
    _check_model(model_state, options, "get_state_dict")
    if optims:
        _check_optim(optim_state, options, "get_state_dict")
    return model_state, optim_state


# --- setting ------------------------------------------------------------------------


def _who_passed(model: nn.Module, given: tuple[bool, ...]) -> list[tuple[bool, ...]]:
    """Every rank's ``given`` flags (see [Note: every rank passes a state dict, or only rank 0])."""
    comm = Comm.of(None)
    with on_device(comm_device(model)):
        return comm.all_gather(given)


def _load_or_not(
    passed: list[bool], options: StateDictOptions, what: str, which: str, use: str
) -> bool:
    """Whether there is a ``which`` state dict to load, the same answer on every rank."""
    if options.broadcast_from_rank0:
        return passed[0]
    if all(passed) or not any(passed):
        return all(passed)
    empty = [r for r, p in enumerate(passed) if not p]
    hint = (
        "with full_state_dict=True and cpu_offload=True, get_state_dict gives the full "
        "state dict to rank 0 alone: load it with StateDictOptions(full_state_dict=True, "
        "broadcast_from_rank0=True)"
        if options.full_state_dict
        else f"pass every rank the state dict that {use} returned on that rank"
    )
    raise ValueError(
        f"{what}: rank{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} passed "
        f"an empty {which} state dict and the other ranks did not; loading is a "
        f"collective, so every rank loads or none does: {hint}"
    )


def _keep_optim_value(keepers: Mapping[str, Keeper]) -> Any:
    def keep(path: Path, tensor: Tensor) -> Any:
        if len(path) >= 3 and path[0] == "state" and path[1] in keepers:
            return keepers[path[1]](path[1], tensor)
        return tensor

    return keep


def _load_optims(
    model: nn.Module,
    optims: tuple[torch.optim.Optimizer, ...],
    front_ends: list[OptimizerFrontEnd],
    state_dict: dict[str, Any],
    *,
    options: StateDictOptions,
    what: str,
) -> None:
    groups = [f.param_groups(model, o) for f, o in zip(front_ends, optims, strict=True)]
    flattened = bool(state_dict) and is_flattened(state_dict)
    renames = tied_names(model, root_prefix(model))

    def nest() -> bool:
        """The flattened form nested (the optimizers' groups say how), a tied parameter
        under our name ([Note: a tied parameter's name] in ``_wrappers/fqns.py``); whether it was
        flattened."""
        nonlocal state_dict
        state_dict = dict(rename_tied(state_dict, renames, what))
        if flattened:
            state_dict = merge([unflatten(state_dict, g, what) for g in groups])
        return flattened

    if not options.broadcast_from_rank0:
        nest()
    else:
        # Only rank 0 has the dict: it nests it, and every rank learns whether it was
        # flattened, or rank 0's error (see [Note: one decision, every rank] in _comm.py).
        with on_device(comm_device(model)):
            flattened = Comm.of(None).run_on_coordinator("nest the optimizer state dict", nest)
        keepers: dict[str, Keeper] = {}
        for front_end, optim, optim_groups in zip(front_ends, optims, groups, strict=True):
            keeper = front_end.optimizer_keeper(model, optim)
            for g in optim_groups:
                keepers.update(dict.fromkeys(g.names, keeper))
        state_dict = broadcast_from_rank0(
            state_dict, _keep_optim_value(keepers), comm_device(model), what
        )
    for front_end, optim, optim_groups in zip(front_ends, optims, groups, strict=True):
        # torch checks strictness only for the nested form it is given.
        part = split(
            state_dict,
            optim_groups,
            strict=options.strict and not flattened,
            rank=global_rank(),
            what=what,
        )
        front_end.load_optimizer_state_dict(model, optim, part, options)


def _load_model(
    model: nn.Module, state_dict: dict[str, Any], options: StateDictOptions, what: str
) -> _IncompatibleKeys:
    front_end = model_front_end(model)
    if options.broadcast_from_rank0:
        keep = front_end.model_keeper(model)
        state_dict = broadcast_from_rank0(
            state_dict, lambda path, t: keep(path[0], t), comm_device(model), what
        )
        options = dataclasses.replace(options, broadcast_from_rank0=False)
    return front_end.load_model_state_dict(model, state_dict, options)


def set_model_state_dict(
    model: nn.Module,
    model_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> _IncompatibleKeys:
    """Load an FQN-keyed model state dict (sharded or full, from any wrapper and world size).

    With ``broadcast_from_rank0`` only rank 0's (full) dict is read; every rank keeps
    its shard. Returns the missing and unexpected keys (``strict=False``). A collective.
    """
    what = "set_model_state_dict"
    options = _options(options, what)
    front_end = model_front_end(model)
    if front_end is TORCH_FALLBACK:
        result: _IncompatibleKeys = TORCH.set_model_state_dict(
            model, model_state_dict, options=options
        )
        return result
    (passed,) = zip(*_who_passed(model, (bool(model_state_dict),)), strict=True)
    if not _load_or_not(list(passed), options, what, "model", "get_model_state_dict"):
        if not options.broadcast_from_rank0:
            _check_model(model_state_dict, options, what)
        return _IncompatibleKeys([], [])
    return _load_model(model, model_state_dict, options, what)


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    optim_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load an FQN-keyed optimizer state dict (nested or flattened, sharded or full).

    Each optimizer takes the state and hyperparameters of its own parameters. With
    ``strict`` a parameter that requires a gradient but has no saved state is an
    error. A collective.
    """
    what = "set_optimizer_state_dict"
    options = _options(options, what)
    optims = _optimizers(optimizers)
    front_ends = [optimizer_front_end(model, o) for o in optims]
    if all(f is TORCH_FALLBACK for f in front_ends):
        TORCH.set_optimizer_state_dict(model, optims, optim_state_dict, options=options)
        return
    (passed,) = zip(*_who_passed(model, (bool(optim_state_dict),)), strict=True)
    if _load_or_not(list(passed), options, what, "optimizer", "get_optimizer_state_dict"):
        _load_optims(model, optims, front_ends, optim_state_dict, options=options, what=what)
    elif not options.broadcast_from_rank0:
        _check_optim(optim_state_dict, options, what)


def set_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: StateDictOptions | None = None,
) -> _IncompatibleKeys:
    """Load the optimizers' and the model's state dicts (in that order, as torch's).

    What :func:`set_optimizer_state_dict` and :func:`set_model_state_dict` do; an
    empty ``model_state_dict`` (on every rank) loads the optimizers only. Returns
    the model's missing and unexpected keys. A collective.
    """
    what = "set_state_dict"
    options = _options(options, what)
    optims = _optimizers(optimizers)
    model_end = model_front_end(model)
    optim_ends = [optimizer_front_end(model, o) for o in optims]
    if model_end is TORCH_FALLBACK and all(f is TORCH_FALLBACK for f in optim_ends):
        result: _IncompatibleKeys = TORCH.set_state_dict(
            model,
            optims,
            model_state_dict=model_state_dict,
            optim_state_dict=optim_state_dict,
            options=options,
        )
        return result
    flags = _who_passed(model, (bool(model_state_dict), bool(optim_state_dict)))
    load_model = _load_or_not([f[0] for f in flags], options, what, "model", "get_state_dict")
    load_optims = optims and _load_or_not(
        [f[1] for f in flags], options, what, "optimizer", "get_state_dict"
    )
    if optims and not load_optims and not options.broadcast_from_rank0:
        _check_optim(optim_state_dict, options, what)
    if load_optims:
        _load_optims(model, optims, optim_ends, optim_state_dict, options=options, what=what)
    if not load_model:
        return _IncompatibleKeys([], [])
    return _load_model(model, model_state_dict, options, what)
