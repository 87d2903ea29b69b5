"""Every code block in every README runs, or says it is a fragment.

A reader copies the blocks of a README into a script; one that names something it
never defines, or that needs a process group it never starts, fails them. So each
fenced block of README.md, examples/**/README.md and packages/*/README.md is one of:

- a ``python`` block, extracted and executed here: in a fresh process without a
  process group, in an empty working folder; or, when its first line is a comment
  ``# torchrun ... --nproc-per-node N ...``, on N ranks with torchrun's environment
  (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so that its own
  ``dist.init_process_group("gloo")`` works as under torchrun;
- any block whose first line is ``# fragment: WHY`` (shell commands, output, a piece
  of a larger script, something needing GPUs or a download): shown, not run. The
  reason says where the real thing is tested, where it is.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ranks import run_ranks

ROOT = Path(__file__).resolve().parent.parent
_FENCE = re.compile(r"^```([\w+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_FRAGMENT = re.compile(r"^#\s*fragment:\s*\S")
_TORCHRUN = re.compile(r"^#\s*torchrun\b.*--nproc[-_]per[-_]node[ =](\d+)")
_SKIP_DIRS = {".git", ".nox", ".venv", ".ci-venv", "runs", "node_modules", "build", "dist"}


@dataclass(frozen=True)
class Block:
    """One fenced code block of a README."""

    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.code.lstrip("\n").split("\n", 1)[0].strip()

    @property
    def fragment(self) -> bool:
        return bool(_FRAGMENT.match(self.first_line))

    @property
    def ranks(self) -> int | None:
        """N for a ``# torchrun ... --nproc-per-node N`` block; None: one process."""
        match = _TORCHRUN.match(self.first_line)
        return int(match.group(1)) if match else None


def readmes() -> list[Path]:
    found = []
    for path in sorted(ROOT.rglob("README.md")):
        if not _SKIP_DIRS.intersection(path.relative_to(ROOT).parts):
            found.append(path)
    return found


def blocks() -> list[Block]:
    out = []
    for path in readmes():
        text = path.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            out.append(Block(path, line, match.group(1).lower(), match.group(2)))
    return out


RUNNABLE = [b for b in blocks() if b.lang == "python" and not b.fragment]


def test_every_block_runs_or_is_marked_a_fragment() -> None:
    assert {p.relative_to(ROOT).as_posix() for p in readmes()} >= {
        "README.md",
        "examples/README.md",
        "examples/minimal/README.md",
        "packages/flatparam/README.md",
        "packages/zero_optim/README.md",
        "packages/fsdp/README.md",
        "packages/ckpt/README.md",
    }
    unmarked = [
        f"{b.where}: a ```{b.lang or '(no language)'} block starting {b.first_line!r}"
        for b in blocks()
        if not b.fragment and b.lang != "python"
    ]
    assert not unmarked, (
        "blocks that are neither python (run by this test) nor marked '# fragment: why' "
        "on their first line:\n" + "\n".join(unmarked)
    )
    # What must run, runs here: the first block of each package README and the
    # top README's "Use it in your script".
    for name in ("README.md", *(f"packages/{p}/README.md" for p in _PACKAGES)):
        first = next(b for b in blocks() if b.path == ROOT / name and b.lang == "python")
        assert not first.fragment, f"{first.where}: the first python block must run"


_PACKAGES = ("flatparam", "zero_optim", "fsdp", "ckpt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run_block(code: str, where: str, workdir: str, port: int, torchrun: bool) -> None:
    """One rank: drop the harness's process group, then run the block as a script
    would, as ``__main__`` in ``workdir``, under torchrun's environment if asked."""
    import torch.distributed as dist

    # Every rank must be through the harness's init before any drops its group: a rank
    # that closed its sockets while a peer still connected failed that peer's init
    # ("Connection closed by peer", seen once in CI).
    dist.barrier()
    dist.destroy_process_group()
    os.chdir(workdir)
    if torchrun:  # RANK, WORLD_SIZE and LOCAL_RANK are the harness's already
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    exec(compile(code, where, "exec"), {"__name__": "__main__"})
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_readme_python_block_runs(block: Block, tmp_path: Path) -> None:
    ranks = block.ranks
    run_ranks(
        _run_block,
        ranks or 1,
        block.code,
        block.where,
        str(tmp_path),
        _free_port(),
        ranks is not None,
        timeout=120,
    )


_CONFLICT = re.compile(r"^(<{7} |={7}$|>{7} )", re.M)


def test_no_merge_conflict_markers() -> None:
    """A merge's leftovers in a README (both sides kept, markers and all) read as text
    and break no block, so nothing else would notice them."""
    found = [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for path in readmes()
        for text in [path.read_text(encoding="utf-8")]
        for m in _CONFLICT.finditer(text)
    ]
    assert not found, "merge conflict markers left in:\n" + "\n".join(found)
