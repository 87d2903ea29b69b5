"""Session-wide test configuration: hypothesis profiles and the rank forkserver.

Hypothesis profiles (pick one with ``HYPOTHESIS_PROFILE=<name>``):
- ``ci`` (default): no deadline (a 2-core CI box shared with multi-rank tests
  makes per-example timings meaningless) and a modest number of examples, so
  property tests stay a small part of the suite's time.
- ``dev``: fewer examples still, for a quick local loop.
- ``thorough``: many examples, for hunting a bug or before a release.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    deadline=None,
    max_examples=50,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", deadline=None, max_examples=10, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", deadline=None, max_examples=1000, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the rank forkserver in the background if any collected test can use it.

    A test module that runs ranks imports ``tests.ranks``; if none was collected
    (e.g. only single-process tests selected), no forkserver is started at all.
    Otherwise its few seconds of imports overlap with the tests that run first.
    """
    if "tests.ranks" in sys.modules and session.items and not session.config.option.collectonly:
        from tests.ranks import warm_up

        warm_up()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the forkserver so that no process outlives the test session."""
    if "tests.ranks" in sys.modules:
        from tests.ranks import shutdown

        shutdown()


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--long``: the differential fuzzer's long run (``tests/fuzz``, ``nox -s fuzz``)."""
    parser.addoption(
        "--long",
        action="store_true",
        help="tests/fuzz: thousands of random examples per front end instead of CI's fixed few",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--long``: the fuzzer's long run is one test per front end and world size that
    runs for an hour or more; each example still has its own limit (``run_ranks``)."""
    if not config.getoption("--long"):
        return
    for item in items:
        if item.nodeid.startswith("tests/fuzz/"):
            item.add_marker(pytest.mark.timeout(6 * 3600))
