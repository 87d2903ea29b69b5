"""Which run folder a ``--resume`` means when the options name another one.

[Note: resuming with changed options]
A run's default folder is named after the options that differ from the defaults
(``runs/fsdp``, ``runs/fsdp-bf16``, ``runs/fsdp-lr=0.001``). ``--resume --lr 0.001``
after ``nox -s train`` therefore names ``runs/fsdp-lr=0.001``, which holds nothing,
while the user means: continue ``runs/fsdp``, from here on with lr 0.001. So when the
named folder holds no checkpoint, the run folders under ``runs/`` are searched by
the ``config.toml`` each run writes: a candidate must agree with this invocation on
every folder-naming option that the command line does not give (those are the run's
identity), and among those the one agreeing on most of the given options wins (so
``--resume --wrapper ddp-zero --lr 0.001`` picks ``runs/ddp-zero`` over
``runs/fsdp``). One winner: that folder, and the options given that differ from its
config are the changes, printed at the resume. None, or a tie: the resume stops and
says which folders it considered (``--out-dir`` names one). Nothing is created on the
way, so a failed resume leaves no empty folder behind.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found, no-redef, unused-ignore]

from .checkpoint import list_checkpoints
from .config import TrainConfig, naming_fields
from .config_file import ConfigFileError, config_record, over_saved

__all__ = [
    "CONFIG_NAME",
    "RunFolder",
    "Settled",
    "find_run_folder",
    "read_run_config",
    "settle_run",
]

CONFIG_NAME = "config.toml"


@dataclass(frozen=True)
class RunFolder:
    """Where this invocation's run lives, and how it was found."""

    path: Path
    found_by_search: bool  # True: the options named another folder ([Note: resuming ...])
    notes: tuple[str, ...] = ()  # what to tell the user about the choice
    error: str | None = None  # the resume cannot go on: why, and what to do


def read_run_config(folder: Path) -> dict[str, Any] | None:
    """A run folder's config.toml as field -> value (tables flattened), or None."""
    try:
        table = tomllib.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def _has_checkpoints(cfg_like: TrainConfig, folder: Path) -> bool:
    root = cfg_like.checkpoint_dir or folder / "checkpoints"
    return bool(list_checkpoints(root))


def _candidates(runs_root: Path) -> Iterable[tuple[Path, dict[str, Any]]]:
    if not runs_root.is_dir():
        return
    for folder in sorted(p for p in runs_root.iterdir() if p.is_dir()):
        saved = read_run_config(folder)
        if saved is not None and list_checkpoints(folder / "checkpoints"):
            yield folder, saved


def find_run_folder(cfg: TrainConfig, given: Iterable[str]) -> RunFolder:
    """The folder of this invocation's run ([Note: resuming with changed options]).

    A fresh run, an explicit ``--out-dir``/``--checkpoint-dir`` and a resume whose
    named folder holds checkpoints take the named folder; only a resume that would
    find nothing there searches. Reads the filesystem, never writes it."""
    named = cfg.run_dir
    if (
        cfg.resume is None
        or cfg.out_dir is not None
        or cfg.checkpoint_dir is not None
        or _has_checkpoints(cfg, named)
    ):
        return RunFolder(named, found_by_search=False)
    given = set(given)
    current = config_record(cfg)
    identity = [n for n in naming_fields() if n not in given]
    changed = [n for n in naming_fields() if n in given]
    scored: list[tuple[int, Path]] = []
    for folder, saved in _candidates(named.parent):
        if all(saved.get(n) == current[n] for n in identity):
            scored.append((sum(saved.get(n) == current[n] for n in changed), folder))
    if not scored:
        return RunFolder(named, found_by_search=False)  # the resume says "no checkpoint"
    best = max(score for score, _ in scored)
    winners = [folder for score, folder in scored if score == best]
    if len(winners) > 1:
        names = ", ".join(str(w) for w in winners)
        return RunFolder(
            named,
            found_by_search=True,
            error=f"--resume: {named} holds no checkpoint, and these runs could be the one "
            f"meant, with the options given changed: {names}; name it with --out-dir",
        )
    (folder,) = winners
    return RunFolder(
        folder,
        found_by_search=True,
        notes=(
            f"--resume: {named} holds no checkpoint; continuing {folder}, the run these "
            "options differ from only in the ones given on the command line",
        ),
    )


@dataclass(frozen=True)
class Settled:
    """Rank 0's decision about this invocation's configuration, for every rank."""

    values: dict[str, Any] | None  # TrainConfig's field values; None when error is set
    notes: tuple[str, ...]  # to print: how the folder was found, what the resume changes
    error: str | None = None


def settle_run(cfg: TrainConfig, explicit: Iterable[str]) -> Settled:
    """This invocation's configuration, final: a resume continues its run folder's
    config.toml with only what this invocation sets itself changed, and says what
    that is ([Note: resuming with changed options]). Rank 0 alone (it reads files)."""
    explicit = set(explicit)
    folder = find_run_folder(cfg, explicit)
    if folder.error is not None:
        return Settled(None, folder.notes, folder.error)
    values = {name: getattr(cfg, name) for name in TrainConfig.__dataclass_fields__}
    notes = list(folder.notes)
    saved = read_run_config(folder.path) if cfg.resume is not None else None
    if saved is None:
        return Settled(values, tuple(notes))
    where = str(folder.path / CONFIG_NAME)
    try:
        values = over_saved(cfg, saved, explicit, where)
        if folder.found_by_search:
            values["out_dir"] = folder.path
        resumed = config_record(TrainConfig(**values))
    except (ConfigFileError, ValueError) as exc:
        return Settled(None, tuple(notes), f"{exc} (in {where}, the run's own configuration)")
    changed = [
        f"{name} {saved.get(name)} -> {resumed[name]}"
        for name in sorted(explicit)
        if name in resumed and saved.get(name) != resumed[name]
    ]
    if changed:
        notes.append(f"resuming {folder.path} with options changed: {', '.join(changed)}")
    return Settled(values, tuple(notes))
