"""The run's configuration as a file: ``--config run.toml`` in, ``config.toml`` out.

A config file holds TrainConfig's fields under their own names (``lr = 0.001``,
``mixed_precision = "bf16"``; dashes work too), flat or in any tables (``[model]``),
which only group them for the reader. Options on the command line override it.

Every run writes its resolved configuration (defaults, file and command line
together) to ``RUN/config.toml`` in the same form, and each checkpoint keeps it too
(in its trainer state), so a run folder says how it was trained and ``--config
RUN/config.toml`` trains that configuration again. What only concerns one
invocation (``--resume``, ``--overwrite``, ``--move-aside-damaged``, the test hooks)
is left out of it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, no-redef, unused-ignore]

from .config import TrainConfig, field_groups

__all__ = [
    "INVOCATION_ONLY",
    "ConfigFileError",
    "changes",
    "config_record",
    "over_saved",
    "read_config_file",
    "write_config_file",
]

# Fields that describe one invocation, not the run: never written to config.toml.
INVOCATION_ONLY = frozenset(
    {
        "resume",
        "overwrite",
        "move_aside_damaged",
        "inject_sigint_at_step",
        "inject_crash_at_step",
        "inject_hang_at_step",
        "inject_rank",
    }
)


class ConfigFileError(ValueError):
    """A --config file that cannot be used, with what is wrong in it and where."""


def _field_types() -> dict[str, Any]:
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


def _convert(name: str, tp: Any, value: Any, where: str) -> Any:
    """A TOML value as the field's type, or a ConfigFileError saying what fits."""
    optional = isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union
    if optional:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = args[0]
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigFileError(f"{where}: {name} = {value!r}: choose one of {list(choices)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where}: {name} = {value!r}: write true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigFileError(f"{where}: {name} = {value!r}: write a whole number")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigFileError(f"{where}: {name} = {value!r}: write a number")
        return float(value)
    if tp is Path:
        if not isinstance(value, str):
            raise ConfigFileError(f'{where}: {name} = {value!r}: write a path as a "string"')
        return Path(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigFileError(f'{where}: {name} = {value!r}: write a "string"')
        return value
    raise AssertionError(f"no conversion for {name}: {tp}")


def _flatten(table: Mapping[str, Any], where: str, out: dict[str, Any]) -> None:
    fields = _field_types()
    for key, value in table.items():
        name = key.replace("-", "_")
        if name in fields:
            if name in out:
                raise ConfigFileError(f"{where}: {name} is set twice")
            out[name] = _convert(name, fields[name], value, where)
        elif isinstance(value, dict):
            _flatten(value, where, out)  # a table only groups its keys
        else:
            raise ConfigFileError(
                f"{where}: unknown option {key!r}; the keys are train.py's options without "
                "the leading dashes (train.py --help lists them)"
            )


def read_config_file(path: Path) -> dict[str, Any]:
    """Field name -> value from a TOML file, checked against TrainConfig's types."""
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigFileError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"--config {path}: cannot be read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"--config {path}: not valid TOML ({exc})") from None
    out: dict[str, Any] = {}
    _flatten(table, f"--config {path}", out)
    return out


def over_saved(
    cfg: TrainConfig, saved: Mapping[str, Any], explicit: set[str], where: str
) -> dict[str, Any]:
    """``cfg``'s field values with every field this invocation did not set itself
    (``explicit``: the command line's and --config's) taken from ``saved``, a run's
    config.toml: a resumed run keeps its configuration except what was asked."""
    fields = _field_types()
    values = {name: getattr(cfg, name) for name in fields}
    for name, value in saved.items():
        if name in fields and name not in explicit and name not in INVOCATION_ONLY:
            values[name] = _convert(name, fields[name], value, where)
    return values


def _plain(value: Any) -> Any:
    """A field value as TOML/JSON holds it (paths as strings, absolute)."""
    if isinstance(value, Path):
        return str(value.absolute())
    return value


def config_record(cfg: TrainConfig) -> dict[str, Any]:
    """The run's configuration as plain values, invocation-only fields left out; what
    config.toml and the checkpoints hold (None: unset, e.g. --strategy default)."""
    return {
        f.name: _plain(getattr(cfg, f.name))
        for f in dataclasses.fields(TrainConfig)
        if f.name not in INVOCATION_ONLY
    }


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value} has no TOML spelling here")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    raise TypeError(f"cannot write {value!r} to TOML")


def write_config_file(cfg: TrainConfig, path: Path, header: str) -> None:
    """config.toml: one table per group of options (as in --help), unset options as
    comments; ``header`` is a comment on top (what wrote it, when)."""
    record = config_record(cfg)
    lines = [f"# {line}" for line in header.splitlines()]
    lines.append("# train.py --config FILE reads this; options on the command line override it.")
    for group, names in field_groups(TrainConfig).items():
        kept = [n for n in names if n in record]
        if not kept:
            continue
        lines += ["", f"[{group.replace(' ', '_')}]"]
        for name in kept:
            value = record[name]
            if value is None:
                lines.append(f"# {name} = (unset)")
            else:
                lines.append(f"{name} = {_toml_value(value)}")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(path)


def changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """``'lr 0.003 -> 0.001'`` for each option whose value differs (keys of both)."""
    return [
        f"{name} {before[name]} -> {after[name]}"
        for name in after
        if name in before and before[name] != after[name]
    ]
