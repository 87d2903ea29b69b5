"""Checks run by ``nox -s build`` against installed wheels and sibling pins.

``python install_check.py NAME VERSION`` runs inside a venv that holds only NAME's
wheel and its declared dependencies: it imports NAME, checks that the installed
version is the one just built, and fails if importing it pulled in one of our
packages that NAME does not declare. NAME is the import name (``zero_optim``); the
distribution is ``DISTRIBUTIONS[NAME]`` (``shardkit-zero-optim``): PyPI holds
unrelated projects under some of the bare names (``ckpt``).

``python install_check.py --pins ROOT`` checks that every sibling pin in
``packages/*/pyproject.toml`` admits the sibling's current version.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
from pathlib import Path

import tomllib

OURS = ("flatparam", "zero_optim", "fsdp", "ckpt")
# Import name -> distribution name (pyproject's [project] name), as pip spells it.
DISTRIBUTIONS = {name: "shardkit-" + name.replace("_", "-") for name in OURS}
_IMPORT_NAMES = {dist: name for name, dist in DISTRIBUTIONS.items()}


def _canonical(dist: str) -> str:
    """PEP 503's normalised form: ``Shardkit_Zero.Optim`` -> ``shardkit-zero-optim``."""
    return re.sub(r"[-_.]+", "-", dist).lower()


def check_import(name: str, version: str) -> None:
    module = importlib.import_module(name)
    if module.__version__ != version:
        raise SystemExit(
            f"imported {name} {module.__version__} from {module.__file__}, not {version}"
        )
    requires = importlib.metadata.requires(DISTRIBUTIONS[name]) or []
    declared = {
        _IMPORT_NAMES.get(_canonical(re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0]), "")
        for r in requires
    }
    allowed = (declared | {name}) & set(OURS)
    stray = [p for p in OURS if p in sys.modules and p not in allowed]
    if stray:
        raise SystemExit(f"importing {name} imported {stray}, which it does not declare")
    installed = []
    for p in OURS:
        try:
            importlib.metadata.version(DISTRIBUTIONS[p])
            installed.append(DISTRIBUTIONS[p])
        except importlib.metadata.PackageNotFoundError:
            pass
    # Declared dependencies are only the direct ones; transitive siblings are fine.
    print(f"{name} {module.__version__}: imports alone; our packages installed: {installed}")


def check_pins(root: Path) -> None:
    from packaging.requirements import Requirement

    versions = {}
    for p in OURS:
        text = (root / "packages" / p / "src" / p / "_version.py").read_text()
        match = re.search(r'__version__ = "([^"]+)"', text)
        if match is None:
            raise SystemExit(f"packages/{p}: _version.py has no __version__")
        versions[p] = match.group(1)
    for p in OURS:
        meta = tomllib.loads((root / "packages" / p / "pyproject.toml").read_text())
        if meta["project"]["name"] != DISTRIBUTIONS[p]:
            raise SystemExit(
                f"packages/{p}/pyproject.toml names the distribution "
                f"{meta['project']['name']!r}; it must be {DISTRIBUTIONS[p]!r}"
            )
        for dep in meta["project"]["dependencies"]:
            req = Requirement(dep)
            sibling = _IMPORT_NAMES.get(_canonical(req.name))
            if sibling is None and _canonical(req.name).replace("-", "_") in OURS:
                raise SystemExit(
                    f"packages/{p} depends on {req.name!r}, the bare name of one of ours: "
                    f"write {DISTRIBUTIONS[_canonical(req.name).replace('-', '_')]!r} (PyPI's "
                    f"{req.name!r}, if any, is another project)"
                )
            if sibling is not None and not req.specifier.contains(versions[sibling]):
                raise SystemExit(
                    f"packages/{p} pins {dep}, but {sibling} is at {versions[sibling]}"
                )
    print(f"sibling pins are consistent: {versions}")


if __name__ == "__main__":
    if sys.argv[1] == "--pins":
        check_pins(Path(sys.argv[2]))
    else:
        check_import(sys.argv[1], sys.argv[2])
