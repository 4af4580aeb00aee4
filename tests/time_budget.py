"""The suite's time: printed at the end of every run, and a budget that fails the run when passed.

Owns: the wall-clock time of the whole run (from the session's start, as CI waits for it), the
``--time-budget SECONDS`` option (``make test`` gives 1200: CI stops at 90 minutes, and the suite
must leave room for set-up and growth), and, when the run passes its budget, a failing exit status
with the slowest tests named (set-up, call and teardown added up per test, workers included).
Ignores: what the tests check, and how they are spread over workers (``tests.worker_groups``).
"""
from __future__ import annotations

import time
from collections import defaultdict

import pytest

SLOWEST_SHOWN = 15


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("specserve").addoption(
        "--time-budget", type=float, default=None, metavar="SECONDS",
        help="fail the run, naming the slowest tests, when the whole suite takes longer than this")


class SuiteClock:
    """A plugin of the controlling process (never of an xdist worker): the run's clock and what
    each test cost."""

    def __init__(self, budget_s: float | None) -> None:
        self.budget_s = budget_s
        self.start = time.monotonic()
        self.per_test: dict[str, float] = defaultdict(float)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.start

    def over_budget(self) -> bool:
        return self.budget_s is not None and self.elapsed_s > self.budget_s

    def slowest(self, n: int = SLOWEST_SHOWN) -> list[tuple[str, float]]:
        return sorted(self.per_test.items(), key=lambda kv: -kv[1])[:n]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.per_test[report.nodeid.split("@", 1)[0]] += report.duration  # "@group": xdist's suffix

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.over_budget() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        line = f"suite time {self.elapsed_s:.0f} s"
        if self.budget_s is not None:
            line += f" (budget {self.budget_s:.0f} s)"
        terminalreporter.write_sep("=", line)
        if self.over_budget():
            terminalreporter.write_line(
                f"FAILED: the suite took {self.elapsed_s:.0f} s, over its budget of {self.budget_s:.0f} s; "
                "the slowest tests (set-up + call + teardown):", red=True)
            for nodeid, seconds in self.slowest():
                terminalreporter.write_line(f"  {seconds:8.1f} s  {nodeid}")


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # an xdist worker's tests are counted by the controller
        config.pluginmanager.register(SuiteClock(config.getoption("--time-budget")), "specserve-suite-clock")
