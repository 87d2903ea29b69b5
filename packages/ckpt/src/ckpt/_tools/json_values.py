"""Non-tensor checkpoint values as JSON values, for ``ckpt inspect --json --values``.

A script reading the program's JSON must get numbers as numbers and lists as lists,
not Python ``repr()`` strings to parse again. JSON has fewer types than what
``torch.load(weights_only=True)`` returns, so the rest is spelled as small tagged
objects, each with one key naming what it is:

==========================  ===============================================
Python                      JSON
==========================  ===============================================
None, bool, int, str        themselves
float                       itself; nan/inf/-inf as ``{"float": "nan"}``
list, tuple, torch.Size     array
dict with str keys          object
other dict (int keys, ...)  ``{"mapping": [[key, value], ...]}``
set, frozenset              ``{"set": [...]}``
bytes                       ``{"bytes": n, "hex": "..."}`` (hex up to 256)
tensor                      ``{"tensor": {"shape", "dtype", "values"?}}``
                            (values up to 64 elements)
torch.dtype, torch.device   ``{"dtype": "float32"}``, ``{"device": "cpu"}``
enum member                 ``{"enum": "pkg.Cls.NAME", "value": ...}``
dataclass                   ``{"type": "pkg.Cls", "fields": {...}}``
anything else               ``{"type": "pkg.Cls", "str": str(value)}``
==========================  ===============================================
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["json_value"]

_INLINE_ELEMENTS = 64
_INLINE_BYTES = 256


def _type_name(value: object) -> str:
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__}"


def json_value(value: Any) -> Any:
    """``value`` as something ``json.dumps(..., allow_nan=False)`` writes (table above)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": str(value)}
    if isinstance(value, torch.Tensor):
        described: dict[str, Any] = {
            "shape": list(value.shape),
            "dtype": str(value.dtype).removeprefix("torch."),
        }
        if value.numel() <= _INLINE_ELEMENTS:
            described["values"] = json_value(value.detach().cpu().tolist())
        return {"tensor": described}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, enum.Enum):
        return {"enum": f"{_type_name(value)}.{value.name}", "value": json_value(value.value)}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value):
            return {k: json_value(v) for k, v in value.items()}
        return {"mapping": [[json_value(k), json_value(v)] for k, v in value.items()]}
    if isinstance(value, list | tuple):
        return [json_value(v) for v in value]
    if isinstance(value, set | frozenset):
        return {"set": [json_value(v) for v in sorted(value, key=repr)]}
    if isinstance(value, bytes | bytearray):
        shown: dict[str, Any] = {"bytes": len(value)}
        if len(value) <= _INLINE_BYTES:
            shown["hex"] = bytes(value).hex()
        return shown
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "type": _type_name(value),
            "fields": {
                f.name: json_value(getattr(value, f.name)) for f in dataclasses.fields(value)
            },
        }
    return {"type": _type_name(value), "str": str(value)}
