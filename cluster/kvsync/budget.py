"""How long one engine step may wait for a remote drafter.

Owns: ``DraftBudget`` — the deadline of a KVSync propose (all its RPCs together), derived from the
measured target step time: ``factor`` × the median of the recent target forwards, within
[``floor_s``, ``cap_s``]. The median (not a mean) keeps one long prefill chunk from inflating the
budget. Waiting longer than a few target steps for K drafts never pays: a drafter that slow loses
more than speculation gains, so on the deadline the step goes plain (lossless) instead.
Ignores: what happens on the deadline (``cluster.kvsync.client``), measuring (the controller reports
each target forward).
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class DraftBudget:
    factor: float = 4.0  # budget = factor × typical target step
    floor_s: float = 0.02  # never tighter: RPC + scheduling jitter on a fast step
    cap_s: float = 2.0  # never looser (also the budget before any step was measured)
    window: int = 16  # recent target forwards the median is taken over
    _steps: deque = field(default_factory=deque, repr=False)

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.floor_s <= 0 or self.cap_s < self.floor_s or self.window < 1:
            raise ValueError("DraftBudget needs factor > 0, 0 < floor_s <= cap_s and window >= 1")
        self._steps = deque(maxlen=self.window)

    def observe(self, forward_s: float) -> None:
        if forward_s >= 0:
            self._steps.append(float(forward_s))

    @property
    def seconds(self) -> float:
        if not self._steps:
            return self.cap_s
        return min(self.cap_s, max(self.floor_s, self.factor * statistics.median(self._steps)))
