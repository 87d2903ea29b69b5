"""Distribution names that install our packages, not someone else's.

PyPI holds an unrelated project called ``ckpt`` (and any bare name may be taken
later), so the four distributions share the prefix ``shardkit-`` while the import
names stay ``flatparam``, ``zero_optim``, ``fsdp`` and ``ckpt``. These tests hold the
pyproject files, the sibling pins and every "pip install" a user is told to type
(error messages, READMEs) to that.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
OURS = ("flatparam", "zero_optim", "fsdp", "ckpt")
# "pip install ckpt" or "pip install --upgrade zero_optim": a bare name of ours.
_BARE_INSTALL = re.compile(
    r"pip install (?:-U |--upgrade )?[\"'`]?(flatparam|zero[_-]optim|fsdp|ckpt)(?:\[\w+\])?\b(?!/)"
)


def _user_facing_files() -> list[Path]:
    """Package sources, READMEs, examples and the noxfile: where install lines live."""
    files = [ROOT / "README.md", ROOT / "noxfile.py", *sorted((ROOT / "examples").rglob("*.md"))]
    files += sorted((ROOT / "examples").rglob("*.py"))
    for name in OURS:
        files.append(ROOT / "packages" / name / "README.md")
        files += sorted((ROOT / "packages" / name / "src").rglob("*.py"))
    return files


def test_distributions_are_prefixed_and_pins_name_them() -> None:
    for name in OURS:
        meta = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())
        assert meta["project"]["name"] == "shardkit-" + name.replace("_", "-"), name
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "install_check.py"), "--pins", str(ROOT)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "sibling pins are consistent" in done.stdout


def test_install_check_refuses_a_bare_sibling_pin(tmp_path: Path) -> None:
    # A copy of the tree's metadata with ckpt depending on the bare "fsdp".
    for name in OURS:
        pkg = tmp_path / "packages" / name
        (pkg / "src" / name).mkdir(parents=True)
        src = ROOT / "packages" / name
        (pkg / "src" / name / "_version.py").write_text(
            (src / "src" / name / "_version.py").read_text()
        )
        text = (src / "pyproject.toml").read_text()
        if name == "ckpt":
            text = text.replace('"shardkit-fsdp>=0.1,<0.2"', '"fsdp>=0.1,<0.2"')
        (pkg / "pyproject.toml").write_text(text)
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "install_check.py"), "--pins", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert done.returncode != 0
    assert "depends on 'fsdp', the bare name of one of ours: write 'shardkit-fsdp'" in (
        done.stderr
    ), done.stderr


def test_no_install_line_names_a_bare_package() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _user_facing_files()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _BARE_INSTALL.search(line)
    ]
    assert not found, "install lines that would fetch another project:\n" + "\n".join(found)
    # And the pattern does catch what it must.
    assert _BARE_INSTALL.search("which is not installed: pip install ckpt")
    assert _BARE_INSTALL.search("pip install --upgrade zero_optim")
    assert not _BARE_INSTALL.search("pip install ./packages/ckpt")
    assert not _BARE_INSTALL.search("pip install shardkit-ckpt")


def test_installed_under_the_prefixed_names() -> None:

    for name in OURS:
        dist = "shardkit-" + name.replace("_", "-")
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{dist} is not installed: pip install ./packages/{name}")
        assert version == importlib.import_module(name).__version__, dist


def test_declared_torch_floors_are_the_readmes() -> None:
    # The README's "Which torch versions" table gives each floor with its reason;
    # the pyproject files must declare the same.
    text = (ROOT / "README.md").read_text()
    table = dict(re.findall(r"^\| `(\w+)` \| >= ([\d.]+) \|", text, re.M))
    assert set(table) == set(OURS), table
    for name in OURS:
        meta = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())
        torch_req = [d for d in meta["project"]["dependencies"] if d.startswith("torch")]
        assert torch_req == [f"torch>={table[name]}"], (name, torch_req)
