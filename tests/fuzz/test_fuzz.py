"""The differential fuzzer (issue 32): every knob either trains like DDP or raises.

Hypothesis draws examples from ``_space.py`` (model, plan, a schedule of knobs and
calls by hand per step) and ``_run.py`` runs each on its ranks against DDP. The
suite runs a fixed, bounded set per front end and world size; ``nox -s fuzz``
(``pytest tests/fuzz --long``) draws thousands of new ones (``FUZZ_EXAMPLES``
overrides either count).
A failing example prints a standalone reproduction; the ones found so far are
kept in ``test_fuzz_regressions.py``.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, note, settings

from tests.fuzz._run import check_example
from tests.fuzz._space import Example, examples

CI_EXAMPLES = 12  # per front end at 2 ranks (half as many at 4): about a minute each
LONG_EXAMPLES = 1400  # --long: 1,400 at 2 ranks and 700 at 4, per front end


def _settings(world_size: int, long: bool) -> settings:
    base = int(os.environ.get("FUZZ_EXAMPLES", LONG_EXAMPLES if long else CI_EXAMPLES))
    return settings(
        max_examples=base if world_size == 2 else max(1, base // 2),
        deadline=None,
        derandomize=not long,  # CI: the same examples every run; --long: new ones each time
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("front_end", ["fully_shard", "fsdp1"])
def test_trains_like_ddp_or_raises(
    front_end: str, world_size: int, request: pytest.FixtureRequest
) -> None:
    long = bool(request.config.getoption("--long"))

    progress = os.environ.get("FUZZ_PROGRESS")  # a file: one line per example run

    @_settings(world_size, long)
    @given(examples(front_end, world_size))
    def run(example: Example) -> None:
        outcome = "equal to DDP"

        def record(line: str) -> None:
            nonlocal outcome
            outcome = line
            note(line)

        try:
            check_example(example, record)
        except AssertionError:
            outcome = "FAILED"
            raise
        finally:
            if progress:
                with open(progress, "a") as f:
                    f.write(f"{front_end} {world_size}: {outcome[:160]}\n")

    run()
