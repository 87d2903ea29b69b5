"""A state dict's flattened keys, as DCP names them, at a save's every-step cost.

DCP keys a nested state dict by the dotted path of each value
(``optim.state.layers.0.weight.exp_avg``) and records each path, and a checkpoint's
keys must be exactly those its ``flatten_state_dict`` gives, or DCP's own load would
not find them. Its traversal asks of every value whether it is a container holding
tensors, through a few generic calls per value: for a model of 1,000 tensors and its
AdamW state, 6 ms of a 60-80 ms repeated save on one rank. Almost all of a model's and
an optimizer's state is mappings down to the values, which :func:`flatten` walks
itself; a list (where DCP decides whether the list is one value or a container by what
it holds) is handed to DCP's traversal, so those rules stay DCP's, and so is the whole
state dict when DCP reads with the rules of an older version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import traverse_state_dict

__all__ = ["KeyPath", "flatten"]

KeyPath = tuple[str | int, ...]  # a key's path in the nested state dict (DCP's mapping)


def flatten(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, KeyPath]]:
    """``flatten_state_dict(state_dict)``: the values by flattened key, and each key's
    path, in DCP's order."""
    if _version._derived_version is not None:
        return flatten_state_dict(dict(state_dict))
    flat: dict[str, Any] = {}
    paths: dict[str, KeyPath] = {}

    def put(key: str, path: KeyPath, value: Any) -> None:
        if key in flat:
            raise ValueError(f"duplicated flatten key {key}")
        flat[key] = value
        paths[key] = path

    def from_dcp(path: KeyPath, value: Any) -> None:
        put(".".join(map(str, path)), path, value)

    def walk(path: tuple[str, ...], value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk((*path, str(k)), v)
        elif isinstance(value, list):
            outer = path[:-1]
            traverse_state_dict({path[-1]: value}, lambda p, v: from_dcp(outer + p, v))
        else:
            put(".".join(path), path, value)

    for key, value in state_dict.items():
        walk((str(key),), value)
    return flat, paths
