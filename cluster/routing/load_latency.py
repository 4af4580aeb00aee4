"""Load latency: how slow each path is for a segment at a given in-flight count, as measured.

Owns: the in-flight count of each path and its time integral (``InFlightMeter``), so that a
completed request is charged the mean load it ran under; per (path, segment) a recency-weighted
straight-line fit of normalized latency (end-to-end seconds per generated token, queueing and
prefill included) against that load (``LoadLatencyModel``); and the comparison the router's
overflow rule asks for: which path would serve the next request of a segment sooner, given both
paths' in-flight counts now (a new request runs under about the current count plus itself).
Why the mean load over a request's life and not the count at its arrival: in a burst the first
arrivals find an empty engine but run beside every later one, so the count at arrival says little
about the load a request actually met (a batch of 16 arriving together shares one latency).
Why: the two engines do different work per request on different segments (on CPU a long summarize
prompt costs the BatchEngine far more per slot than a short chat turn, and the SpecEngine's cost
depends on the segment's acceptance rate), so filling them in proportion to their configured
``max_num_seqs`` can put most of a burst on the slower side. Completed requests say which side is
slower; nothing has to be calibrated beforehand.
Ignores: where the counts come from (the Router deployment observes its own forwarded requests)
and the rest of the route decision (``cluster.routing.policy``).

Fit: weighted least squares of y = a + b·n with every earlier observation's weight multiplied by
``decay`` when a new one arrives (recent load regimes dominate). The slope is clamped at >= 0 (more
load never makes a path faster); when the observed counts barely spread, the slope cannot be
estimated and latency is taken as proportional to the count (y = ȳ·n / n̄), the pessimistic
extrapolation for a path that has only been seen lightly loaded.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable


MIN_SPREAD = 1.0  # variance of the observed in-flight counts needed to trust a fitted slope


@dataclass(slots=True)
class _PathLoad:
    count: int = 0
    area: float = 0.0  # ∫ count dt up to ``since``
    since: float = 0.0


@dataclass(slots=True, frozen=True)
class LoadMark:
    """Where a request entered: its path, the time, and the path's load integral then."""

    path: object
    t: float
    area: float


class InFlightMeter:
    """Requests in flight per path and ∫ count dt, for the mean load over a request's life."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._loads: dict[object, _PathLoad] = {}

    def _advance(self, path: object) -> tuple[_PathLoad, float]:
        now = self._clock()
        load = self._loads.setdefault(path, _PathLoad(since=now))
        load.area += load.count * (now - load.since)
        load.since = now
        return load, now

    def count(self, path: object) -> int:
        load = self._loads.get(path)
        return 0 if load is None else load.count

    def enter(self, path: object) -> LoadMark:
        load, now = self._advance(path)
        load.count += 1
        return LoadMark(path, now, load.area)

    def mean_load(self, mark: LoadMark) -> float:
        """Mean in-flight count on the mark's path since it entered (the request itself included)."""
        load, now = self._advance(mark.path)
        if now <= mark.t:
            return float(load.count)
        return (load.area - mark.area) / (now - mark.t)

    def leave(self, mark: LoadMark) -> None:
        load, _now = self._advance(mark.path)
        load.count -= 1


@dataclass(slots=True)
class LatencyFit:
    """Decayed sums for one (path, segment): weight, Σn, Σy, Σn², Σny, and an undecayed count."""

    w: float = 0.0
    sn: float = 0.0
    sy: float = 0.0
    snn: float = 0.0
    sny: float = 0.0
    count: int = 0

    def add(self, n: float, y: float, decay: float) -> None:
        self.w = self.w * decay + 1.0
        self.sn = self.sn * decay + n
        self.sy = self.sy * decay + y
        self.snn = self.snn * decay + n * n
        self.sny = self.sny * decay + n * y
        self.count += 1

    def line(self) -> tuple[float, float]:
        """(a, b) of y = a + b·n."""
        mean_n, mean_y = self.sn / self.w, self.sy / self.w
        var_n = self.snn / self.w - mean_n * mean_n
        if var_n >= MIN_SPREAD:
            b = max(0.0, (self.sny / self.w - mean_n * mean_y) / var_n)
        else:
            b = mean_y / max(mean_n, 1.0)
        return mean_y - b * mean_n, b

    def predict(self, n: float) -> float:
        a, b = self.line()
        return max(0.0, a + b * n)


class LoadLatencyModel:
    """Normalized latency per (path key, segment); path keys are opaque (the policy uses ``Path``)."""

    def __init__(self, decay: float = 0.95) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self._fits: dict[tuple[object, str], LatencyFit] = {}
        self._lock = threading.Lock()

    def observe(self, path: object, segment: str, load: float, e2e_s: float, tokens: int) -> None:
        """One completed request: ``load`` the mean in-flight count on its path while it ran
        (itself included)."""
        if load <= 0.0 or e2e_s < 0.0 or tokens < 1:
            return  # nothing generated (or a bad clock): says nothing about per-token latency
        with self._lock:
            fit = self._fits.setdefault((path, segment), LatencyFit())
            fit.add(float(load), e2e_s / tokens, self.decay)

    def samples(self, path: object, segment: str) -> int:
        fit = self._fits.get((path, segment))
        return 0 if fit is None else fit.count

    def predict(self, path: object, segment: str, in_flight: int) -> float | None:
        """Seconds per generated token for a request running under ``in_flight`` requests (itself
        included); None: unseen."""
        with self._lock:
            fit = self._fits.get((path, segment))
            return None if fit is None else fit.predict(float(in_flight))

    def faster(self, segment: str, a: tuple[object, int], b: tuple[object, int],
               min_samples: int) -> bool | None:
        """Is path ``a[0]`` at in-flight ``a[1]`` predicted strictly faster than ``b[0]`` at ``b[1]``?
        None when either path has fewer than ``min_samples`` completions of the segment."""
        if min(self.samples(a[0], segment), self.samples(b[0], segment)) < max(min_samples, 1):
            return None
        pa, pb = self.predict(a[0], segment, a[1]), self.predict(b[0], segment, b[1])
        return pa is not None and pb is not None and pa < pb

    def snapshot(self) -> dict[str, dict[str, dict[str, float]]]:
        """segment -> path -> {samples, a, b} (a: s/token at no load, b: s/token per request)."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        with self._lock:
            for (path, segment), fit in sorted(self._fits.items(), key=lambda kv: (kv[0][1], str(kv[0][0]))):
                a, b = fit.line()
                name = getattr(path, "value", str(path))
                out.setdefault(segment, {})[name] = {"samples": fit.count, "a": a, "b": b}
        return out
