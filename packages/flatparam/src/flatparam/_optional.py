"""Importing a sibling package that may not be installed.

fsdp and zero_optim hand some work to ckpt when it is installed (its state-dict
functions under torch's names) and do without it otherwise; each is installable
alone, so neither may require it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["import_optional"]


def import_optional(name: str, attribute: str) -> ModuleType | None:
    """Module ``name`` if it is installed and has ``attribute`` (an older version may
    not), else ``None``. An import error from inside the module is raised, not hidden."""
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if not missing or not (name == missing or name.startswith(missing + ".")):
            raise  # something the module itself imports is missing: say so
        return None
    return module if hasattr(module, attribute) else None
