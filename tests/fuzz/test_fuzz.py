"""The differential fuzzer (issue 32): every knob either trains like DDP or raises.

Hypothesis draws examples from ``_space.py`` (model, plan, a schedule of knobs and
calls by hand per step) and ``_run.py`` runs each on its ranks against DDP. The
suite runs a bounded number per front end and world size (``FUZZ_EXAMPLES``,
default below); ``nox -s fuzz`` (or ``pytest tests/fuzz --long``) runs thousands.
A failing example prints a standalone reproduction; the ones found so far are
kept in ``test_fuzz_regressions.py``.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, note, settings

from tests.fuzz._run import check_example
from tests.fuzz._space import Example, examples

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "12"))


def _settings(world_size: int) -> settings:
    n = EXAMPLES if world_size == 2 else max(1, EXAMPLES // 2)
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=os.environ.get("FUZZ_RANDOM") is None,  # CI: the same examples each run
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("front_end", ["fully_shard", "fsdp1"])
def test_trains_like_ddp_or_raises(front_end: str, world_size: int) -> None:
    @_settings(world_size)
    @given(examples(front_end, world_size))
    def run(example: Example) -> None:
        check_example(example, note)

    run()
