"""Package-level promises: the README example runs, no torch.distributed, exports."""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path
from typing import Any

import pytest

import flatparam

PACKAGE = Path(__file__).resolve().parents[2] / "packages" / "flatparam"


def test_readme_example_runs_and_prints_what_it_says() -> None:
    readme = (PACKAGE / "README.md").read_text()
    match = re.search(r"```python\n(.*?)```", readme, re.S)
    assert match is not None
    code = match.group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    printed = out.getvalue().splitlines()
    claimed = [line.split("# ", 1)[1] for line in code.splitlines() if line.startswith("print(")]
    # each print's comment states its output (up to the prose after a colon)
    for line, claim in zip(printed, claimed, strict=True):
        assert line == claim.split(": ")[0].strip(), (line, claim)


def test_no_torch_distributed_import() -> None:
    for path in (PACKAGE / "src" / "flatparam").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n.startswith("torch.distributed") for n in names), (path, names)


def test_public_names_are_exported() -> None:
    expected = {
        "FlatParameter",
        "FlattenParamsWrapper",
        "ParamInfo",
        "SharedParamInfo",
        "ShardMetadata",
        "ShardLayout",
        "ShardPiece",
        "align_numel_for",
        "shard_flat",
        "pad_flat",
        "unpad_flat",
        "unshard_flat",
    }
    assert expected <= set(flatparam.__all__)
    assert all(hasattr(flatparam, name) for name in flatparam.__all__)


def test_import_optional_hides_only_the_missing_package(tmp_path: Path, monkeypatch: Any) -> None:
    from flatparam import import_optional

    assert import_optional("json", "dumps") is not None
    assert import_optional("json", "no_such_attribute") is None
    assert import_optional("no_such_package_here.sub", "x") is None
    (tmp_path / "broken_optional_pkg.py").write_text("import no_such_dependency_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_here"):
        import_optional("broken_optional_pkg", "x")
