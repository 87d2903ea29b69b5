"""The forms of an FQN-keyed optimizer state dict that torch's state-dict API takes.

``get_optimizer_state_dict`` returns, and ``set_optimizer_state_dict`` takes, one dict
for any number of optimizers, keyed by parameter names (FQNs)::

    {"state": {"fc.weight": {"step": ..., "exp_avg": ...}, ...},
     "param_groups": [{"lr": 0.01, ..., "params": ["fc.weight", "fc.bias"]}, ...]}

or, with ``flatten_optimizer_state_dict=True``, the same as one level of dotted keys::

    {"state.fc.weight.step": ..., "state.fc.weight.exp_avg": ...,
     "param_groups.fc.weight.lr": 0.01, "param_groups.fc.bias.lr": 0.01, ...}

(every parameter repeats its group's hyperparameters, so the dict no longer depends
on how parameters are grouped; nested state dicts flatten level by level). This
module converts between these: :func:`merge` several optimizers' dicts into one,
:func:`split` out what one optimizer holds, :func:`flatten` and :func:`unflatten`,
and :func:`rename_tied` puts a tied parameter's state under the name we give it.
Nothing here communicates or knows a wrapper; the names come from the front ends
(``_state_dict_api/front_ends.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "GroupNames",
    "check_form",
    "check_groups",
    "copy_value",
    "flatten",
    "is_flattened",
    "merge",
    "rename_tied",
    "split",
    "unflatten",
]

_STATE = "state"
_GROUPS = "param_groups"
_PARAMS = "params"


@dataclass(frozen=True)
class GroupNames:
    """One parameter group of a live optimizer, by parameter name."""

    names: tuple[str, ...]  # the FQNs of the group's parameters, in the group's order
    # Those whose state this rank must load: the ones that require a gradient (under
    # ZeRO only those this rank owns, as a sharded state dict holds only theirs).
    needs_state: frozenset[str]
    keys: tuple[str, ...]  # the group's hyperparameter names ("lr", "betas", ...)


def merge(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One state dict holding several optimizers' (an empty part, e.g. another rank's
    ``rank0_only`` result, adds nothing)."""
    state: dict[str, Any] = {}
    groups: list[Any] = []
    for part in parts:
        if not part:
            continue
        state.update(part[_STATE])
        groups.extend(part[_GROUPS])
    return {_STATE: state, _GROUPS: groups}


def is_flattened(state_dict: Mapping[str, Any]) -> bool:
    """Whether ``state_dict`` is in the flattened form (torch tells them apart the same
    way: the nested form has a ``"state"`` entry)."""
    return _STATE not in state_dict


def _flatten_value(out: dict[str, Any], key: str, value: Any) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten_value(out, f"{key}.{k}", v)
        return
    if not isinstance(value, (Tensor, int, float)):
        raise NotImplementedError(
            f"{key} is a {type(value).__name__}: flattening optimizer state_dict only "
            "supports tensor, int, float, dict states now (as torch's); pass "
            "flatten_optimizer_state_dict=False for this optimizer"
        )
    out[key] = value


def flatten(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The flattened form of a nested optimizer state dict (not modified)."""
    out: dict[str, Any] = {}
    for fqn, entry in state_dict[_STATE].items():
        _flatten_value(out, f"{_STATE}.{fqn}", entry)
    for group in state_dict[_GROUPS]:
        for fqn in group[_PARAMS]:
            for k, v in group.items():
                if k != _PARAMS:
                    out[f"{_GROUPS}.{fqn}.{k}"] = v
    return out


def _owner(rest: str, names: set[str]) -> tuple[str, str] | None:
    """(fqn, remainder) for ``rest`` = ``fqn + "." + remainder`` with fqn in ``names``;
    the longest fqn wins (``a.b`` before ``a`` when both are names)."""
    cut = len(rest)
    while (cut := rest.rfind(".", 0, cut)) > 0:
        if rest[:cut] in names:
            return rest[:cut], rest[cut + 1 :]
    return None


def rename_tied(
    state_dict: Mapping[str, Any], renames: Mapping[str, str], what: str
) -> Mapping[str, Any]:
    """``state_dict`` (either form) with every tied parameter's other names (``renames``'
    keys) replaced by the one we give it (their values), see [Note: a tied parameter's
    name] in ``_wrappers/fqns.py``; not modified, returned as is when there is nothing to rename.
    """
    if not renames or not state_dict:
        return state_dict
    if is_flattened(state_dict):
        out: dict[str, Any] = {}
        aliases = set(renames)
        for key, value in state_dict.items():
            head, _, rest = key.partition(".")
            found, ours = _owner(rest, aliases), key
            if found is not None:
                alias, name = found[0], renames[found[0]]
                ours = f"{head}.{name}.{found[1]}"
                if ours in state_dict:
                    raise ValueError(_both(what, alias, name))
            out[ours] = value
        return out
    out = dict(state_dict)
    state = state_dict.get(_STATE)
    if isinstance(state, Mapping) and any(alias in state for alias in renames):
        out[_STATE] = dict(state)
        for alias, name in renames.items():
            if alias in state:
                if name in state:
                    raise ValueError(_both(what, alias, name))
                out[_STATE][name] = out[_STATE].pop(alias)
    groups = state_dict.get(_GROUPS)
    if isinstance(groups, list):
        out[_GROUPS] = [
            {**group, _PARAMS: [renames.get(n, n) for n in group[_PARAMS]]}
            if isinstance(group, Mapping) and isinstance(group.get(_PARAMS), list)
            else group
            for group in groups
        ]
    return out


def _both(what: str, alias: str, name: str) -> str:
    return (
        f"{what}: the optimizer state dict holds state under both {name!r} and {alias!r}, "
        "which name one tied parameter; keep one of them (torch's name is the first "
        "that model.named_parameters() yields)"
    )


def _nest(entries: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dotted, value in entries.items():
        *parents, last = dotted.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def unflatten(flat: Mapping[str, Any], groups: Sequence[GroupNames], what: str) -> dict[str, Any]:
    """The nested form of a flattened state dict, for an optimizer with ``groups``.

    Entries of parameters the optimizer does not have are left out, as torch's does.
    """
    names = {n for g in groups for n in g.names}
    per_param: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        head, _, rest = key.partition(".")
        if head not in (_STATE, _GROUPS):
            raise ValueError(
                f"{what}: {key!r} is neither 'state.<parameter>.<name>' nor "
                "'param_groups.<parameter>.<name>': not a flattened optimizer state dict "
                "(from flatten_optimizer_state_dict=True)"
            )
        found = _owner(rest, names)
        if found is None:
            continue
        fqn, name = found
        (per_param if head == _STATE else hyper).setdefault(fqn, {})[name] = value
    state = {fqn: _nest(per_param[fqn]) for g in groups for fqn in g.names if fqn in per_param}
    out_groups: list[dict[str, Any]] = []
    for index, g in enumerate(groups):
        entry: dict[str, Any] = {}
        for k in g.keys:
            values = [hyper[n][k] for n in g.names if k in hyper.get(n, {})]
            if not values:
                raise ValueError(
                    f"{what}: the flattened state dict has no 'param_groups.<parameter>.{k}' "
                    f"for any parameter of group {index} ({', '.join(g.names[:3])}...): it was "
                    "saved from an optimizer with other parameters or hyperparameters"
                )
            if any(not _equal(v, values[0]) for v in values[1:]):
                raise RuntimeError(
                    f"{what}: All the parameters in the same parameter group should have "
                    f"the same saved param_group value, but {k} differs within group "
                    f"{index}: {[v for v in values if not _equal(v, values[0])][:1]} and "
                    f"{values[0]}; regroup the optimizer as it was saved"
                )
            entry[k] = values[0]
        entry[_PARAMS] = list(g.names)
        out_groups.append(entry)
    return {_STATE: state, _GROUPS: out_groups}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and torch.equal(a, b)
    return bool(a == b)


def split(
    state_dict: Mapping[str, Any],
    groups: Sequence[GroupNames],
    *,
    strict: bool,
    rank: int,
    what: str,
) -> dict[str, Any]:
    """What one optimizer (``groups``) takes from a state dict of one or more optimizers.

    Each group takes its hyperparameters from the saved group that holds its
    parameters and its parameters' state by name. With ``strict`` a parameter that
    needs state but has none saved is an error (torch's words).
    """
    saved_state = state_dict[_STATE]
    saved_groups = state_dict[_GROUPS]
    if any(not isinstance(k, str) for k in saved_state):
        raise ValueError(
            f"{what}: the optimizer state dict is keyed by parameter ids "
            f"({list(saved_state)[:3]}...), as optimizer.state_dict() keys it; load one "
            "keyed by parameter names (FQNs), as get_optimizer_state_dict returns it, or "
            "convert it first with FullyShardedDataParallel.rekey_optim_state_dict(osd, "
            "OptimStateKeyType.PARAM_NAME, model, optim=optim)"
        )
    state: dict[str, Any] = {}
    out_groups: list[dict[str, Any]] = []
    for index, g in enumerate(groups):
        source = next(
            (s for s in saved_groups if any(n in s[_PARAMS] for n in g.names)),
            None,
        )
        if source is None and not g.names:
            empty = [s for s in saved_groups if not s[_PARAMS]]
            source = empty[0] if len(empty) == 1 else None
        if source is None:
            raise ValueError(
                f"{what}: parameter group {index} of the optimizer "
                f"({', '.join(g.names[:3]) or 'no parameters'}...) matches no parameter "
                "group of the state dict: it was saved from an optimizer over other "
                "parameters; build the optimizer over the same parameters"
            )
        entry = {k: v for k, v in source.items() if k != _PARAMS}
        entry[_PARAMS] = list(g.names)
        out_groups.append(entry)
        for fqn in g.names:
            if fqn in saved_state:
                state[fqn] = saved_state[fqn]
            elif strict and fqn in g.needs_state:
                raise RuntimeError(
                    f"{what} on rank {rank}: Missing optimizer state for parameter '{fqn}' "
                    "in checkpoint. The parameter requires gradients but has no saved "
                    "optimizer state. To load anyway, use StateDictOptions(strict=False)."
                )
    return {_STATE: state, _GROUPS: out_groups}


def copy_value(value: Any, device: torch.device | None) -> Any:
    """A state value copied for a state dict: a tensor detached onto ``device`` (default:
    its own), anything else deep-copied, so the result never aliases the optimizer's."""
    if isinstance(value, Tensor):
        return value.detach().to(device or value.device, copy=True)
    return copy.deepcopy(value)


def check_form(named: Any, what: str) -> None:
    """Raise unless ``named`` is an FQN-keyed optimizer state dict (nested form)."""
    if not isinstance(named, Mapping) or "state" not in named or "param_groups" not in named:
        raise ValueError(
            f"{what}: expected an optimizer state dict with 'state' and 'param_groups' keyed "
            "by parameter names (from optim_state_dict); got "
            f"{sorted(named) if isinstance(named, Mapping) else type(named).__name__}"
        )


def check_groups(named: Mapping[str, Any], current: Sequence[Sequence[str]], what: str) -> None:
    """Raise unless ``named``'s parameter groups hold the FQNs ``current`` (an optimizer's
    groups, in any order within a group) and it has state for no other parameter."""
    saved = named["param_groups"]
    if len(saved) != len(current):
        raise ValueError(
            f"{what}: the optimizer state dict has {len(saved)} parameter groups, this "
            f"optimizer has {len(current)}; build the optimizer with the same groups"
        )
    for g, (group, names) in enumerate(zip(saved, current, strict=True)):
        got, want = set(group["params"]), set(names)
        if got != want:
            raise ValueError(
                f"{what}: parameter group {g} differs: missing from the state dict "
                f"{sorted(want - got)[:10]}, unexpected {sorted(got - want)[:10]}"
            )
    unexpected = sorted(set(named["state"]) - {n for names in current for n in names})
    if unexpected:
        raise ValueError(
            f"{what}: the optimizer state dict has state for parameters this optimizer does "
            f"not have (not in the model, or left out of its parameter groups, e.g. frozen): "
            f"{unexpected[:10]}"
        )
