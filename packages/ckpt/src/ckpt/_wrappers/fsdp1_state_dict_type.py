"""Selecting a model's state-dict type: ``state_dict_type`` and its set/get halves.

The setting is recorded on every FSDP instance in the model (as torch's FSDP does:
``_wrappers.fsdp1_state_dict_type``, ``_state_dict_config``, ``_optim_state_dict_config``), and from
then on that instance's ``state_dict``/``load_state_dict`` hooks produce and accept the
chosen type (see [Note: state-dict types live in ckpt] in fsdp). The model itself need
not be an FSDP instance (``DDP(FSDP(...))``, a plain module holding FSDP children);
a model with no FSDP instance is left alone, since its state dict has only one form.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator

from torch import nn

from fsdp import FullyShardedDataParallel, to_fsdp_type
from fsdp.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

__all__ = ["get_state_dict_type", "set_state_dict_type", "state_dict_type"]

_CONFIG: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


class _ConfigMismatchError(TypeError, RuntimeError):
    """A config of another state-dict type: torch's FSDP raises ``RuntimeError``, ours
    raised ``TypeError``; both catch it."""


class _SettingsMismatchError(RuntimeError, AssertionError):
    """FSDP instances of one model with different state-dict settings: torch's FSDP
    raises ``AssertionError`` (documented), ours raised ``RuntimeError``; both catch it."""


def _default_settings() -> StateDictSettings:
    return StateDictSettings(
        StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()
    )


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> StateDictSettings:
    """Make every FSDP instance in ``module`` use ``state_dict_type``; return the old setting.

    Call on the root (the whole model), so that every instance agrees: a sharded
    state dict is assembled instance by instance. The configs default to the type's
    own (``FullStateDictConfig()`` etc.) and must be of the type's class, so that a
    ``FullStateDictConfig(rank0_only=True)`` is never silently ignored under
    ``SHARDED_STATE_DICT``.
    """
    # torch's types (Lightning passes them) become ours; anything else is a TypeError.
    state_dict_type = to_fsdp_type(state_dict_type, StateDictType, "state_dict_type")
    if state_dict_config is not None:
        state_dict_config = to_fsdp_type(state_dict_config, StateDictConfig, "state_dict_config")
    if optim_state_dict_config is not None:
        optim_state_dict_config = to_fsdp_type(
            optim_state_dict_config, OptimStateDictConfig, "optim_state_dict_config"
        )
    config_cls, optim_cls = _CONFIG[state_dict_type]
    config = config_cls() if state_dict_config is None else state_dict_config
    optim_config = optim_cls() if optim_state_dict_config is None else optim_state_dict_config
    if type(config) is not config_cls:
        raise _ConfigMismatchError(
            f"{state_dict_type.name} takes a {config_cls.__name__} as state_dict_config, got "
            f"{type(config).__name__} (Expected state_dict_config of type {config_cls} but got "
            f"{type(config)}, in torch's words)"
        )
    if type(optim_config) is not optim_cls:
        raise _ConfigMismatchError(
            f"{state_dict_type.name} takes a {optim_cls.__name__} as optim_state_dict_config, "
            f"got {type(optim_config).__name__} (Expected optim_state_dict_config of type "
            f"{optim_cls} but got {type(optim_config)}, in torch's words)"
        )
    previous = get_state_dict_type(module)
    for instance in FullyShardedDataParallel.fsdp_modules(module):
        instance._state_dict_type = state_dict_type
        instance._state_dict_config = config
        instance._optim_state_dict_config = optim_config
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The state-dict setting of the FSDP instances in ``module`` (FULL if it has none).

    Raises an ``AssertionError`` (also a ``RuntimeError``) if the instances disagree (a
    setting made on a nested instance only); select the type on the root module instead.
    """
    found: StateDictSettings | None = None
    for instance in FullyShardedDataParallel.fsdp_modules(module):
        mine = StateDictSettings(
            instance._state_dict_type,
            instance._state_dict_config,
            instance._optim_state_dict_config,
        )
        if found is None:
            found = mine
        elif mine != found:
            raise _SettingsMismatchError(
                f"All FSDP modules must have the same state dict settings. Got {mine} and "
                f"{found}: a setting was made on a nested instance only; call "
                "set_state_dict_type on the root module"
            )
    return _default_settings() if found is None else found


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> Generator[None, None, None]:
    """:func:`set_state_dict_type` inside the context; the previous setting after it.

    ::

        with ckpt.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            sd = model.state_dict()  # DTensor per original parameter
    """
    previous = set_state_dict_type(
        module, state_dict_type, state_dict_config, optim_state_dict_config
    )
    try:
        yield
    finally:
        set_state_dict_type(
            module,
            previous.state_dict_type,
            previous.state_dict_config,
            previous.optim_state_dict_config,
        )
