"""Run control for ``specserve map``: one progress bar per phase (with time left) and the time
budget (``--max-minutes``).

Owns: the deadline every phase checks between units of work (a request, a cell) and the phase
bars on stderr. Why between units: a unit is short (seconds), and stopping inside one would leave
a half-measured number. Ignores: what the units are.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager


class OutOfTime(Exception):
    """The ``--max-minutes`` budget is spent; the phase stops and keeps what it measured."""


class Budget:
    def __init__(self, max_minutes: float | None, show: bool = True) -> None:
        self.t0 = time.monotonic()
        self.deadline = None if not max_minutes else self.t0 + 60.0 * max_minutes
        self.show = show

    def left_s(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def check(self) -> None:
        left = self.left_s()
        if left is not None and left <= 0:
            raise OutOfTime(f"--max-minutes spent after {time.monotonic() - self.t0:.0f}s")

    @contextmanager
    def phase(self, name: str, total: int):
        """A progress bar for one phase: ``bar.update()`` per unit; tqdm shows the time left."""
        from tqdm import tqdm

        bar = tqdm(total=max(total, 1), desc=name, unit="run", file=sys.stderr, disable=not self.show,
                   dynamic_ncols=True, leave=True)
        try:
            yield bar
        finally:
            bar.close()
