"""The suite's two profiles: ``short`` (``make test``, what CI runs) and ``long`` (``make test-long``).

Owns: the ``--profile`` choice's effect on collection (a test marked ``long`` runs in the long
profile only, and the short run says how many it left out), and the ``profile`` fixture with which a
test sizes its prompt set or matrix (``profile.pick(short=6, long=24)``).
Ignores: what any test checks. Why: CI has 90 minutes on 2 cores and the suite must stay far inside
them, so the short profile checks every claim once on a set sized to run in minutes, and the long
profile repeats the same claims on the bigger sets and the longer matrices (more prompts, more
drafters, end-to-end benchmark runs) — the same assertions, never looser ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest

LEFT_OUT = pytest.StashKey[int]()  # long-profile tests a short run deselected


@dataclass(frozen=True)
class Profile:
    name: str  # "short" | "long"

    @property
    def long(self) -> bool:
        return self.name == "long"

    def pick(self, short, long):
        """``short`` in the short profile, ``long`` in the long one."""
        return long if self.long else short


def _profile(config: pytest.Config) -> Profile:
    return Profile(config.getoption("--profile"))


@pytest.fixture(scope="session")
def profile(request) -> Profile:
    return _profile(request.config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _profile(config).long:
        return
    kept, left = [], []
    for item in items:
        (left if item.get_closest_marker("long") else kept).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept
        config.stash[LEFT_OUT] = len(left)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    left = config.stash.get(LEFT_OUT, 0)
    if left:
        terminalreporter.write_line(f"short profile: {left} long-profile tests left to `make test-long` (--profile long)")
