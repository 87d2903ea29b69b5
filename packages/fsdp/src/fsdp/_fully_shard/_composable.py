"""Where torch's composable APIs look for ``fully_shard``: its registry and module states.

[Note: torch's composable registry]
torch's composable APIs (``fully_shard``, ``replicate``, ``checkpoint``) leave
two marks on each module they are applied to, and read each other's:

- a *registry*: an ordered dict in the module's ``__dict__`` under
  ``torch.distributed._composable.contract.REGISTRY_KEY``, keyed by the API's
  function name (``"fully_shard"``), which ``_get_registry(module)`` returns.
  torch's ``replicate()`` asks it (``_is_fully_sharded``) to leave the
  parameters of every ``fully_shard`` module to that API; without our entry it
  would also take the sharded ``DTensor`` parameters into its DDP reducer and
  all-reduce their local shards as if they were whole (a wrong result, no
  error). torch's ``fully_shard`` in turn skips modules registered as
  ``"replicate"``, and so does ours.
- a *state*: the module maps to its state object in
  ``torch.distributed._composable_state`` (``_insert_module_state`` /
  ``_get_module_state``), and in an ordered dict under ``contract.STATE_KEY``
  keyed by the API's function (what ``fully_shard.state(module)`` reads).

torch records both in its ``contract`` decorator, before the API runs; ours
records them once ``fully_shard`` has succeeded, so a refused call leaves no
mark and a module is never half registered.

Both are read from the module's own ``__dict__``, never through ``getattr``:
wrappers that forward unknown attributes to the module they wrap
(``CheckpointWrapper``, ``torch.compile``'s ``OptimizedModule``, FSDP1's
wrapper) would otherwise lend the inner module's registry to the wrapper, and a
wrapper around a sharded module would look sharded itself (issue 41: accelerate
shards the inner module, then its checkpoint wrapper). torch's ``contract``
checks ``__dict__`` the same way before it applies an API.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.distributed._composable.contract import (
    REGISTRY_KEY,
    STATE_KEY,
    RegistryItem,
)
from torch.distributed._composable_state import _get_module_state, _insert_module_state, _State

__all__ = ["API_NAME", "is_fully_sharded", "is_replicated", "register"]

API_NAME = "fully_shard"
"""The registry key torch's composable APIs look for (the function's ``__name__``)."""


def register(modules: Iterable[nn.Module], api: Callable[..., Any], state: _State) -> None:
    """Record ``api`` with ``state`` on every module of one call, as torch's ``contract`` does
    (one registry item and one state shared by the call's modules)."""
    item = RegistryItem()
    for module in modules:
        registry = module.__dict__.setdefault(REGISTRY_KEY, OrderedDict())
        registry.setdefault(API_NAME, item)
        states = module.__dict__.setdefault(STATE_KEY, OrderedDict())
        states.setdefault(api, state)
        if _get_module_state(module) is None:  # replicate() may have inserted its own
            _insert_module_state(module, state)


def _own_registry(module: nn.Module) -> dict[str, RegistryItem]:
    """The composable APIs applied to ``module`` itself (not to a module it wraps)."""
    registry = module.__dict__.get(REGISTRY_KEY)
    return registry if isinstance(registry, dict) else {}


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether a ``fully_shard`` (ours or torch's) was applied to ``module`` itself."""
    return API_NAME in _own_registry(module)


def is_replicated(module: nn.Module) -> bool:
    """Whether torch's ``replicate()`` manages ``module`` (``fully_shard`` leaves it alone)."""
    return "replicate" in _own_registry(module)
