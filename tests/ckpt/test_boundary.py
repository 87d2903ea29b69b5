"""ckpt uses fsdp only through its public names: a ratchet on the private imports.

The modules listed in ``KNOWN_DEBT`` still import ``fsdp._*`` (they predate the public
``fsdp.shards`` API and move off it with the boundary refactor); any other ckpt module
importing a private module of a sibling package fails this test, and so does a listed
module once it no longer needs its entry (remove it from the list).
"""

from __future__ import annotations

import ast
from pathlib import Path

CKPT = Path(__file__).resolve().parents[2] / "packages" / "ckpt" / "src" / "ckpt"
SIBLINGS = ("fsdp", "zero_optim", "flatparam")
KNOWN_DEBT = {
    "_fsdp_model_state.py",
    "_fsdp_optim_state.py",
    "_fsdp_units.py",
    "_optim_state.py",
    "_unit_exchange.py",
    "_zero_state.py",
}


def _private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] in SIBLINGS and any(p.startswith("_") for p in parts[1:]):
                found.append(name)
    return found


def test_ckpt_imports_no_private_sibling_module_beyond_the_known_debt() -> None:
    offenders = {
        p.name: imports for p in sorted(CKPT.glob("*.py")) if (imports := _private_imports(p))
    }
    new = {name: imports for name, imports in offenders.items() if name not in KNOWN_DEBT}
    assert not new, f"use fsdp's public API (fsdp.shards, fsdp.api), not {new}"
    paid = KNOWN_DEBT - offenders.keys()
    assert not paid, f"{sorted(paid)} no longer import private modules: drop them from KNOWN_DEBT"
