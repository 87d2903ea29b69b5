"""Sessions for the monorepo: tests, compat, gpu, typecheck, lint, build, bench.

torch is installed first in every session as ``torch==2.13.0`` from whatever index pip
is configured with. Nothing here picks the CPU or a CUDA build: on Linux, PyPI's
default ``torch`` wheel is the CUDA build (several GB, with its CUDA libraries). Set
``FSDP_TORCH_SPEC`` to choose, e.g. the CPU build:
``FSDP_TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"``,
or a CUDA one with its index (``.../whl/cu128``) on a GPU box.

The four packages install under the distribution names ``shardkit-flatparam``,
``shardkit-zero-optim``, ``shardkit-fsdp`` and ``shardkit-ckpt`` (PyPI has an unrelated
``ckpt``); the import names are ``flatparam``, ``zero_optim``, ``fsdp`` and ``ckpt``.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import tempfile
import zipfile
from pathlib import Path

import nox
import nox.command

ROOT = Path(__file__).parent
# Dependency order: each package only needs the ones before it. Import names; the
# distributions are "shardkit-" + the name with dashes (tools/install_check.py).
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
    "peft==0.21.2",  # tests/fsdp/test_lora.py: LoRA on a Llama under use_orig_params=True
    "packaging",  # tests/test_distribution_names.py runs tools/install_check.py --pins
    "tomli; python_version < '3.11'",  # tomllib's backport, for the tests that read TOML
]
# safetensors: ckpt imports it (typed); the packages themselves are not installed here.
TYPE_DEPS = ["mypy==2.4.1", "pytest==9.2.0", "hypothesis==6.170.15", "numpy", "safetensors==0.8.0"]
# What examples/train.py needs beyond the stack (its end-to-end test runs in `tests`).
# TensorBoard is optional: train.py writes its event files only when it is installed.
EXAMPLE_DEPS = ["rich==15.0.0", "matplotlib==3.11.2", "tomli; python_version < '3.11'"]
LINT_DEPS = ["ruff==0.17.6"]
# The compat session: Lightning and accelerate driving our FSDP through torch's names
# (tests/compat).
COMPAT_DEPS = ["lightning==2.6.6", "accelerate==1.15.0"]

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
    """PyTorch Lightning over our FSDP on 2 gloo ranks: Fabric and Trainer with FSDPStrategy
    (FSDP1), Fabric with ModelParallelStrategy (FSDP2's fully_shard): train, save, resume;
    losses against the uninterrupted run and torch's own implementation."""
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
    minimal = sorted(str(p) for p in (examples / "minimal").glob("*.py"))
    session.run("mypy", "--strict", *minimal, env={"MYPYPATH": str(examples / "minimal")})


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
        # --no-index: our packages and their siblings come from dist/ alone (should a
        # shardkit-* name ever appear on PyPI, it is not ours); their third-party
        # dependencies (safetensors) from the index first. Wheel names spell the
        # distribution with underscores.
        (wheel,) = dist.glob(f"shardkit_{name}-*.whl")
        others = _third_party_requirements(dist)
        if others:
            session.run(py, "-m", "pip", "install", "-q", *others, external=True)
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


def _third_party_requirements(dist: Path) -> list[str]:
    """The requirements of our wheels in ``dist`` that are neither torch nor ours nor
    an extra's (read from each wheel's METADATA)."""
    found: set[str] = set()
    for wheel in dist.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            text = archive.read(meta).decode()
        for line in text.splitlines():
            if line.startswith("Requires-Dist:"):
                req = line.split(":", 1)[1].strip()
                if "extra ==" not in req and not req.startswith(("torch", "shardkit-")):
                    found.add(req)
    return sorted(found)


def _check_versions(session: nox.Session) -> None:
    """Every sibling pin admits the sibling's current version."""
    session.install("packaging")
    session.run("python", str(ROOT / "tools" / "install_check.py"), "--pins", str(ROOT))


def _stack_stamp(*extra: str) -> str:
    """A digest of everything ``_install_stack`` installs: our packages' files, the torch
    spec and ``extra``; equal digests mean a reinstall would change nothing."""
    digest = hashlib.sha256(shlex.join([*TORCH, *extra]).encode())
    for name in PACKAGES:
        for path in sorted((ROOT / "packages" / name).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(ROOT)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


@nox.session
def train(session: nox.Session) -> None:
    """examples/train.py on 2 ranks (its own launcher) with the whole stack installed;
    the installation is skipped when nothing in it changed since the last call.
    Arguments after ``--`` go to train.py: ``nox -s train -- --nproc-per-node 4
    --wrapper ddp``. Ctrl-C is passed on and waited for (the ranks save a checkpoint),
    and nox reports the session as interrupted."""
    stamp_file = Path(session.virtualenv.location) / ".tinygpt-stack"
    stamp = _stack_stamp(*EXAMPLE_DEPS)
    if stamp_file.is_file() and stamp_file.read_text() == stamp:
        session.log("the stack is installed and unchanged: not reinstalling")
    else:
        _install_stack(session, *EXAMPLE_DEPS)
        stamp_file.write_text(stamp)
    args = list(session.posargs)
    if not any(a.split("=")[0] == "--nproc-per-node" for a in args):
        args = ["--nproc-per-node", "2", *args]
    try:
        session.run(
            "python", str(ROOT / "examples" / "train.py"), *args,
            env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
            interrupt_timeout=None,  # let the ranks finish their step and checkpoint
        )  # fmt: skip
    except nox.command.CommandFailed as exc:
        if exc.return_code in (130, 143):  # stopped by SIGINT or SIGTERM after a checkpoint
            raise KeyboardInterrupt from None  # nox: "Session train interrupted."
        raise


@nox.session
def fuzz(session: nox.Session) -> None:
    """The differential fuzzer's long run (issue 32): 2,100 new examples per front end
    (1,400 at 2 ranks, 700 at 4) against DDP; every one must train like DDP or raise.
    ``FUZZ_PROGRESS=<file>`` writes one line per example there as it runs."""
    _install_stack(session, *TEST_DEPS)
    session.run(
        "pytest", "tests/fuzz/test_fuzz.py", "--long", "-x", *session.posargs,
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks against torch's own implementations, printed as ratio tables. Arguments
    after ``--`` go to ``python -m benchmarks``: ``nox -s bench -- scale --quick``, or
    ``nox -s bench -- slow-link --rates 1gbit`` (as root: it makes a network namespace), or
    ``nox -s bench -- failover`` or ``nox -s bench -- two-level`` (as root: simulated
    machines)."""
    # EXAMPLE_DEPS: the failover benchmark runs examples/train.py.
    _install_stack(session, "numpy", *EXAMPLE_DEPS)
    session.run("python", "-m", "benchmarks", *session.posargs, env={"OMP_NUM_THREADS": "1"})
