"""Run the benchmarks: ``python -m benchmarks [NAME ...] [--quick] [--repeats N] [--list]``.

Without names, every ``benchmarks/bench_*.py`` module runs, in name order;
``NAME`` is a module name with or without its ``bench_`` prefix, dashes or
underscores (``bench_zero`` or ``zero``; ``slow-link`` or ``slow_link``). Each
module's tables are printed as soon as it finishes. ``nox -s bench`` runs this
with ``OMP_NUM_THREADS=1``, and any arguments after ``--`` are passed here
(``nox -s bench -- zero --quick``).

A module may also define ``add_arguments(group) -> list[argparse.Action]``, its
own flags (listed under its name by ``--help``; they have no defaults here, and
the ones given reach it as ``Options.flags``; a flag two modules define, such as
``--sizes``, is parsed by the first one's definition and reaches both), and
``preflight(options)``, which runs for every chosen module before any benchmark
starts and raises ``SystemExit`` with the fix when the module cannot run on this
machine.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from types import ModuleType

from benchmarks.common import Options


def available() -> list[str]:
    """Module names of every benchmark, sorted."""
    return sorted(p.stem for p in Path(__file__).parent.glob("bench_*.py"))


def module_name(name: str) -> str:
    """``slow-link``, ``slow_link`` or ``bench_slow_link`` as ``bench_slow_link``."""
    name = name.replace("-", "_")
    return name if name.startswith("bench_") else f"bench_{name}"


class _SharedFlags:
    """A module's argument group in which a flag an earlier module defined is that one."""

    def __init__(self, parser: argparse.ArgumentParser, group: argparse._ArgumentGroup) -> None:
        self._parser = parser
        self._group = group

    def add_argument(self, *names: str, **kwargs: object) -> argparse.Action:
        existing = self._parser._option_string_actions.get(names[0])
        if existing is not None:
            return existing
        return self._group.add_argument(*names, **kwargs)  # type: ignore[arg-type]


def main(argv: list[str]) -> int:
    """Parse ``argv``, run the chosen benchmarks, print their tables; the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--repeats", type=int, default=1, help="runs per variant, pooled")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    names = available()
    modules: dict[str, ModuleType] = {}
    owner: dict[str, list[str]] = {}  # a module flag's dest -> the modules defining it
    for name in names:
        modules[name] = module = importlib.import_module(f"benchmarks.{name}")
        add = getattr(module, "add_arguments", None)
        if add is not None:
            group = parser.add_argument_group(f"{name} flags", argument_default=argparse.SUPPRESS)
            for action in add(_SharedFlags(parser, group)):
                owner.setdefault(action.dest, []).append(name)
    args = parser.parse_args(argv)
    if args.list:
        for name in names:
            print(f"{name}: {modules[name].DESCRIPTION}")
        return 0
    chosen = []
    for name in args.names or names:
        full = module_name(name)
        if full not in names:
            parser.error(f"no benchmark {name!r}; available: {', '.join(names)}")
        chosen.append(full)
    given = {dest: value for dest, value in vars(args).items() if dest in owner}
    for dest in given:
        if not set(owner[dest]) & set(chosen):
            flag = "--" + dest.replace("_", "-")
            parser.error(
                f"{flag} is a flag of {' and '.join(owner[dest])}, which is not among those chosen"
            )
    options = {
        name: Options(
            quick=args.quick,
            repeats=args.repeats,
            flags={d: v for d, v in given.items() if name in owner[d]},
        )
        for name in chosen
    }
    for name in chosen:
        preflight = getattr(modules[name], "preflight", None)
        if preflight is not None:
            preflight(options[name])
    for name in chosen:
        module = modules[name]
        print(f"== {name}: {module.DESCRIPTION}", flush=True)
        start = time.monotonic()
        for table in module.run(options[name]):
            print()
            print(table.render(), flush=True)
        print(f"\n({name} took {time.monotonic() - start:.0f} s)\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
