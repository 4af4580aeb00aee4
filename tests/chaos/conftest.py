"""Chaos suite fixtures: options, the figures report, and one Ray + Serve session for the modules.

Options (give ``tests/chaos`` on the command line so pytest reads them here):
``--fuzz-examples N`` sets the FakeEngine fuzz count (CI default 200; the real-model fuzz runs
N // 7, at least 30); ``--chaos-report PATH`` writes the measured figures as JSON.

Apps are deployed lazily into one Serve instance for this package (``serve_app(name)``), so a module
that needs only the FakeEngine app does not load the real model. The two-node module starts its own
cluster, so it is ordered first and its cluster is gone before the shared session starts.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.report import ChaosReport
from tests.chaos.service import ChaosService

CI_FUZZ_EXAMPLES = 200
MIN_REAL_FUZZ_EXAMPLES = 30


def pytest_collection_modifyitems(config, items):
    """The two-node test starts its own Ray cluster and driver: run it first among the chaos
    tests, before the package's shared Ray session starts (other packages keep their order)."""
    here = Path(__file__).parent
    two = [it for it in items if it.path.parent == here and it.path.name == "test_two_nodes.py"]
    if not two:
        return
    rest = [it for it in items if it not in two]
    first = next((i for i, it in enumerate(rest) if it.path.parent == here), len(rest))
    items[:] = rest[:first] + two + rest[first:]


@pytest.fixture(scope="session")
def fuzz_examples(pytestconfig) -> tuple[int, int]:
    """(FakeEngine examples, real-model examples)."""
    n = pytestconfig.getoption("--fuzz-examples", default=None) or CI_FUZZ_EXAMPLES
    return n, max(MIN_REAL_FUZZ_EXAMPLES, n // 7)


@pytest.fixture(scope="session")
def chaos_report(pytestconfig):
    report = ChaosReport()
    yield report
    path = pytestconfig.getoption("--chaos-report", default=None)
    if path:
        report.write(path)


@pytest.fixture(scope="package")  # gone before other packages' tests start their own Ray
def chaos_service():
    service = ChaosService()
    try:
        yield service
    finally:
        service.close()
