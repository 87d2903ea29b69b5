"""Run the benchmarks: ``python -m benchmarks [NAME ...] [--quick] [--repeats N] [--list]``.

Without names, every ``benchmarks/bench_*.py`` module runs, in name order;
``NAME`` is a module name with or without its ``bench_`` prefix
(``bench_zero`` or ``zero``). Each module's tables are printed as soon as it
finishes. ``nox -s bench`` runs this with ``OMP_NUM_THREADS=1``, and any
arguments after ``--`` are passed here (``nox -s bench -- zero --quick``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from benchmarks.common import Options


def available() -> list[str]:
    """Module names of every benchmark, sorted."""
    return sorted(p.stem for p in Path(__file__).parent.glob("bench_*.py"))


def main(argv: list[str]) -> int:
    """Parse ``argv``, run the chosen benchmarks, print their tables; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--repeats", type=int, default=1, help="runs per variant, pooled")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)
    names = available()
    if args.list:
        for name in names:
            module = importlib.import_module(f"benchmarks.{name}")
            print(f"{name}: {module.DESCRIPTION}")
        return 0
    chosen = []
    for name in args.names or names:
        full = name if name.startswith("bench_") else f"bench_{name}"
        if full not in names:
            parser.error(f"no benchmark {name!r}; available: {', '.join(names)}")
        chosen.append(full)
    options = Options(quick=args.quick, repeats=args.repeats)
    for name in chosen:
        module = importlib.import_module(f"benchmarks.{name}")
        print(f"== {name}: {module.DESCRIPTION}", flush=True)
        start = time.monotonic()
        for table in module.run(options):
            print()
            print(table.render(), flush=True)
        print(f"\n({name} took {time.monotonic() - start:.0f} s)\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
