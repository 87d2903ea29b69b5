"""ckpt uses its sibling packages only through their public names.

fsdp, zero_optim and flatparam are separate distributions that ckpt pins by version
ranges, so a ckpt module importing a private module of one of them (``fsdp._runtime._common``,
``zero_optim._partition``, ``flatparam._shard``) would break with any internal change in
a patch release. What ckpt needs about a wrapped model is in ``fsdp.units`` and
``fsdp.shards``; this test fails on any ckpt module that imports a private sibling
module, at module level or inside a function. The other way round, fsdp reaches ckpt
(lazily, for the state-dict types and optimizer state dicts) only through
``ckpt.fsdp_methods``; the second test holds fsdp and zero_optim to that.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[2] / "packages"
CKPT = PACKAGES / "ckpt" / "src" / "ckpt"
SIBLINGS = ("fsdp", "zero_optim", "flatparam")


def _private_imports(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module in SIBLINGS:  # from fsdp import _common
                names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            private = [p for p in parts[1:] if p.startswith("_") and p != "__version__"]
            if parts[0] in SIBLINGS and private:
                found.append(name)
    return found


def test_ckpt_imports_no_private_sibling_module() -> None:
    modules = sorted(CKPT.rglob("*.py"))  # the rooms' modules too
    assert len(modules) > 20, f"found only {len(modules)} ckpt modules under {CKPT}"
    offenders = {
        str(p.relative_to(CKPT)): imports
        for p in modules
        if (imports := _private_imports(p.read_text()))
    }
    assert not offenders, f"use fsdp's public API (fsdp.units, fsdp.shards, fsdp.api): {offenders}"


def test_the_check_sees_each_form_of_private_import() -> None:
    source = """
import fsdp._runtime._common
from fsdp._wrapper._fsdp_state import get_fsdp_state
from fsdp import _collectives
def later():
    from zero_optim._partition import partition
    import flatparam._shard as shard
from fsdp import FullyShardedDataParallel, __version__
from fsdp.units import flat_units
from ckpt._wrappers.sharded_chunks import chunk_bounds
"""
    assert _private_imports(source) == [
        "fsdp._runtime._common",
        "fsdp._wrapper._fsdp_state",
        "fsdp._collectives",
        "zero_optim._partition",
        "flatparam._shard",
    ]


def _ckpt_references(source: str) -> list[str]:
    """Static imports of ckpt and string literals naming a ckpt module (importlib)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("ckpt.")
            and " " not in node.value
        ):
            found.append(node.value)
    return [name for name in found if name.split(".")[0] == "ckpt"]


def test_fsdp_and_zero_optim_reach_ckpt_only_through_its_hand_over_module() -> None:
    sources = sorted((PACKAGES / "fsdp" / "src").rglob("*.py"))
    sources += sorted((PACKAGES / "zero_optim" / "src").rglob("*.py"))
    assert len(sources) > 20, f"found only {len(sources)} modules under {PACKAGES}"
    references = {p.name: refs for p in sources if (refs := _ckpt_references(p.read_text()))}
    wrong = {
        name: [r for r in refs if r != "ckpt.fsdp_methods"]
        for name, refs in references.items()
        if any(r != "ckpt.fsdp_methods" for r in refs)
    }
    assert not wrong, f"fsdp reaches ckpt only through ckpt.fsdp_methods: {wrong}"
    assert references, "fsdp no longer delegates to ckpt at all: update this test"
