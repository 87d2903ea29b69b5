"""Sessions for the monorepo: tests, compat, gpu, typecheck, lint, build, bench.

torch is installed first in every session as ``torch==2.13.0`` (a CPU build that
lies on local disk on our machines); set ``FSDP_TORCH_SPEC`` to install another
build, e.g. ``FSDP_TORCH_SPEC="torch==2.13.0 --index-url ..."`` on a GPU box.
"""

from __future__ import annotations

import os
import shlex
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
# Dependency order: each package only needs the ones before it.
PACKAGES = ["flatparam", "zero_optim", "fsdp", "ckpt"]
TORCH = shlex.split(os.environ.get("FSDP_TORCH_SPEC", "torch==2.13.0"))
# transformers: tests/fsdp/test_transformers.py builds GPT-2 and Llama from configs (no
# download); it declares no torch dependency, so the pinned torch stays.
TEST_DEPS = [
    "pytest==9.2.0",
    "pytest-timeout==2.4.0",
    "hypothesis==6.170.15",
    "numpy",
    "transformers==5.23.0",
]
TYPE_DEPS = ["mypy==2.4.1", "pytest==9.2.0", "hypothesis==6.170.15", "numpy"]
# What examples/train.py needs beyond the stack (its end-to-end test runs in `tests`).
EXAMPLE_DEPS = ["rich==15.0.0", "matplotlib==3.11.2"]
LINT_DEPS = ["ruff==0.17.6"]
# The compat session: Lightning driving our FSDP through torch's names (tests/compat).
COMPAT_DEPS = ["lightning==2.6.6"]

nox.options.sessions = ["tests", "typecheck", "lint"]
nox.options.reuse_existing_virtualenvs = True


def _package_paths() -> list[str]:
    return [str(ROOT / "packages" / name) for name in PACKAGES]


def _install_stack(session: nox.Session, *extra: str) -> None:
    """torch first (pinned), then our packages together so siblings resolve locally."""
    session.install(*TORCH)
    session.install(*_package_paths(), *extra)


@nox.session
def tests(session: nox.Session) -> None:
    """All four packages installed (not editable) and pytest over tests/."""
    _install_stack(session, *TEST_DEPS, *EXAMPLE_DEPS)
    # tests/compat needs lightning: the compat session runs it.
    session.run(
        "pytest", "tests", "--ignore=tests/compat", *session.posargs,
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip


@nox.session
def compat(session: nox.Session) -> None:
    """PyTorch Lightning (Fabric and Trainer, FSDPStrategy) over our FSDP on 2 gloo ranks:
    train, save, resume; losses against the uninterrupted run and torch's FSDP1."""
    _install_stack(session, *TEST_DEPS, *COMPAT_DEPS)
    session.run("pytest", "tests/compat", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session
def gpu(session: nox.Session) -> None:
    """tests/gpu on a machine with CUDA: NCCL at world size 1, gloo with CUDA tensors,
    NCCL across GPUs when there are 2+, examples/train.py ours vs torch on CUDA. Install
    a CUDA torch with FSDP_TORCH_SPEC."""
    _install_stack(session, *TEST_DEPS, *EXAMPLE_DEPS)
    # All skipped is not a pass: without CUDA this session fails, with the fix.
    session.run(
        "python", "-c",
        "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'nox -s gpu: torch "
        "sees no CUDA device; run it on a GPU machine with a CUDA build of torch, set "
        "with FSDP_TORCH_SPEC (see the README)')",
    )  # fmt: skip
    session.run("pytest", "tests/gpu", "-rs", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every package's src, each package on its own."""
    session.install(*TORCH)
    session.install(*TYPE_DEPS, *EXAMPLE_DEPS)
    for name in PACKAGES:
        session.run("mypy", "--strict", str(ROOT / "packages" / name / "src" / name))
    examples = ROOT / "examples"
    session.run(
        "mypy", "--strict", str(examples / "train.py"), str(examples / "tinygpt"),
        str(examples / "data" / "make_corpus.py"),
        env={"MYPYPATH": f"{examples}:{examples / 'data'}"},
    )  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format check over the whole tree."""
    session.install(*LINT_DEPS)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def build(session: nox.Session) -> None:
    """hatch builds a wheel and sdist per package; each wheel is installed alone
    in a fresh venv with only its declared dependencies and imported there."""
    session.install("hatch")
    dist = Path(tempfile.mkdtemp(prefix="dist-"))
    for name in PACKAGES:
        with session.chdir(ROOT / "packages" / name):
            session.run("hatch", "build", "-t", "wheel", "-t", "sdist", str(dist))
    session.log(f"built: {sorted(p.name for p in dist.iterdir())}")
    _check_versions(session)
    for name in PACKAGES:
        venv = Path(tempfile.mkdtemp(prefix=f"venv-{name}-"))
        session.run("python", "-m", "venv", str(venv), external=True)
        py = str(venv / "bin" / "python")
        session.run(py, "-m", "pip", "install", "-q", *TORCH, external=True)
        # --no-index: our packages and their siblings come from dist/ alone. PyPI holds an
        # unrelated "ckpt" with a higher version that an index lookup would prefer.
        (wheel,) = dist.glob(f"{name}-*.whl")
        session.run(
            py,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--find-links",
            str(dist),
            str(wheel),
            external=True,
        )
        session.run(
            py,
            str(ROOT / "tools" / "install_check.py"),
            name,
            wheel.name.split("-")[1],
            external=True,
        )


def _check_versions(session: nox.Session) -> None:
    """Every sibling pin admits the sibling's current version."""
    session.install("packaging")
    session.run("python", str(ROOT / "tools" / "install_check.py"), "--pins", str(ROOT))


@nox.session
def train(session: nox.Session) -> None:
    """examples/train.py under torchrun, 2 ranks on CPU unless told otherwise, with the
    whole stack installed. Arguments after ``--`` go to train.py, except
    ``--nproc-per-node N``, which goes to torchrun: ``nox -s train -- --nproc-per-node 4
    --wrapper ddp``."""
    _install_stack(session, *EXAMPLE_DEPS)
    nproc, args = "2", list(session.posargs)
    for i, arg in enumerate(args):
        if arg.startswith("--nproc-per-node="):
            nproc = arg.split("=", 1)[1]
            del args[i]
            break
        if arg == "--nproc-per-node" and i + 1 < len(args):
            nproc = args[i + 1]
            del args[i : i + 2]
            break
    session.run(
        "torchrun", "--standalone", f"--nproc-per-node={nproc}",
        str(ROOT / "examples" / "train.py"), *args,
        env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
    )  # fmt: skip


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks against torch's own implementations, printed as ratio tables."""
    _install_stack(session, "numpy")
    session.run("python", "-m", "benchmarks", *session.posargs, env={"OMP_NUM_THREADS": "1"})
