"""Load latency: how long each path would take, per generated token, to serve the next request of a
segment, from what the Router saw its requests take.

Owns: the in-flight count of each path and the time integral of its running part
(``InFlightMeter``); per (path, segment) a recency-weighted straight-line fit of service time per
generated token against the number of requests running beside it (``LoadLatencyModel``); the
prediction for a new request from a path's in-flight count and capacity; and the comparison the
router's overflow rule asks for (which path would serve the next request of a segment sooner).
Why: the two engines do different work per request on different segments (on CPU a long summarize
prompt costs the BatchEngine far more per slot than a short chat turn, and the SpecEngine's cost
depends on the segment's acceptance rate), so filling them in proportion to their configured
``max_num_seqs`` can put most of a burst on the slower side. Completed requests say which side is
slower; nothing has to be calibrated beforehand.
Ignores: where the counts come from (the Router deployment observes its own forwarded requests)
and the rest of the route decision (``cluster.routing.policy``).

Model. A path runs at most C requests at once (its capacity: max_num_seqs x replicas); more wait
in its queue. Service time (end-to-end minus the engine-reported queue time) per generated token
at b running requests is fitted as S(b) = a + s·b. A request's b is the mean of min(in-flight, C)
over its service: not the count at its arrival, since in a burst the first arrivals find an empty
engine but run beside every later one. While it waited in the queue all C slots were busy, so that
part of the integral is C x queue time and is taken out. A new request joining n in flight
(m = n + 1) is predicted to take S(m) per token when m <= C, else S(C)·m/C: C slots drain the
m - C requests ahead of it at C per S(C) (queueing at the path's measured drain rate).

Shared hardware. Where the two paths' engines compete for the same cores or GPU (one CPU node: the
usual case here), a request's service time also grows with the *other* path's running requests,
which a per-path model cannot see: it then splits a burst between paths that are in fact equal and
the split runs slower than either. With ``shared`` the meter also integrates the other paths'
running counts over each request's service (o: the mean number running beside it on other paths)
and the fit is S(b, o) = a + s·b + t·o; a new request joining path P with n_P in flight while the
other path has n_Q is predicted at S(n_P + 1, n_Q). When the data cannot separate s from t (o
barely spread, or b and o moving together) the fit treats every running request alike,
S = a + s·(b + o): on shared hardware a request on the other path is work on the same cores.

Fit: weighted least squares with every earlier observation's weight multiplied by ``decay`` when a
new one arrives (recent load regimes dominate). The slope is clamped at >= 0 (more requests running
never make each faster); when the observed batch sizes barely spread, the slope cannot be
estimated and the per-token time is taken as proportional to the batch size (S = ȳ·b / b̄), the
pessimistic extrapolation for a path seen only lightly loaded.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

# (path, its in-flight count once a request joins, its capacity or None, requests running beside it
# on the other paths where they share hardware, else 0): what a prediction is made from
Joining = tuple[object, int, "int | None", int]


MIN_SPREAD = 1.0  # variance of the observed batch sizes needed to trust a fitted slope
MAX_CORRELATION2 = 0.9  # b and o correlated more than this (r²): their slopes are not separable


@dataclass(slots=True)
class _PathLoad:
    count: int = 0
    running_area: float = 0.0  # ∫ min(count, capacity) dt up to ``since``
    since: float = 0.0


@dataclass(slots=True, frozen=True)
class LoadMark:
    """Where a request entered: its path, the time, and every path's running integral then."""

    path: object
    t: float
    running_area: float
    areas: tuple[tuple[object, float], ...] = ()  # (path, running integral) of every path


@dataclass(slots=True, frozen=True)
class Served:
    """What a completed request saw: ``running`` requests on its own path (itself included) and
    ``beside`` on the other paths, on average over its ``service_s`` seconds of service."""

    running: float
    beside: float
    service_s: float


class InFlightMeter:
    """Requests in flight per path and ∫ min(count, capacity) dt, for the mean number of requests
    a request ran beside. ``capacities``: path -> requests it runs at once (absent: unbounded)."""

    def __init__(self, capacities: dict[object, int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacities = dict(capacities or {})
        self._clock = clock
        self._loads: dict[object, _PathLoad] = {}

    def _advance(self, path: object) -> tuple[_PathLoad, float]:
        now = self._clock()
        load = self._loads.setdefault(path, _PathLoad(since=now))
        cap = self.capacities.get(path)
        running = load.count if cap is None else min(load.count, cap)
        load.running_area += running * (now - load.since)
        load.since = now
        return load, now

    def count(self, path: object) -> int:
        load = self._loads.get(path)
        return 0 if load is None else load.count

    def _areas(self) -> tuple[tuple[object, float], ...]:
        return tuple((p, self._advance(p)[0].running_area) for p in list(self._loads))

    def enter(self, path: object) -> LoadMark:
        load, now = self._advance(path)
        load.count += 1
        return LoadMark(path, now, load.running_area, self._areas())

    def served(self, mark: LoadMark, queue_s: float = 0.0) -> Served:
        """What the mark's request ran beside: its service is the time since it entered less the
        first ``queue_s`` seconds it waited (clipped to that time; all its path's slots were busy
        then). On an unbounded path nothing queues. The other paths' running counts are averaged
        over the whole time since it entered (their part during its queueing is not known apart)."""
        load, now = self._advance(mark.path)
        cap = self.capacities.get(mark.path)
        elapsed = now - mark.t
        queue_s = min(max(queue_s, 0.0), elapsed) if cap is not None else 0.0
        service = elapsed - queue_s
        before = dict(mark.areas)
        other = sum(area - before.get(p, 0.0) for p, area in self._areas() if p != mark.path)
        beside = other / elapsed if elapsed > 0.0 else float(sum(
            self.count(p) for p in self._loads if p != mark.path))
        if service <= 0.0:
            return Served(float(load.count if cap is None else min(load.count, cap)), beside, 0.0)
        area = load.running_area - mark.running_area - (cap or 0) * queue_s
        return Served(max(1.0, area / service), beside, service)

    def leave(self, mark: LoadMark) -> None:
        load, _now = self._advance(mark.path)
        load.count -= 1


def _slope_line(mean_x: float, var_x: float, cov_xy: float, mean_y: float) -> tuple[float, float]:
    """(a, s) of y = a + s·x: least squares when x spread enough, else y proportional to x."""
    if var_x >= MIN_SPREAD:
        s = max(0.0, cov_xy / var_x)
    else:
        s = mean_y / max(mean_x, 1.0)
    return mean_y - s * mean_x, s


@dataclass(slots=True)
class LatencyFit:
    """Decayed sums for one (path, segment) — weight, Σb, Σo, Σy, Σb², Σo², Σbo, Σby, Σoy — and an
    undecayed count. b: requests running on the path; o: beside it on the other paths (0 unless
    the paths share hardware)."""

    w: float = 0.0
    sn: float = 0.0
    so: float = 0.0
    sy: float = 0.0
    snn: float = 0.0
    soo: float = 0.0
    sno: float = 0.0
    sny: float = 0.0
    soy: float = 0.0
    count: int = 0

    def add(self, n: float, y: float, decay: float, o: float = 0.0) -> None:
        self.w = self.w * decay + 1.0
        self.sn = self.sn * decay + n
        self.so = self.so * decay + o
        self.sy = self.sy * decay + y
        self.snn = self.snn * decay + n * n
        self.soo = self.soo * decay + o * o
        self.sno = self.sno * decay + n * o
        self.sny = self.sny * decay + n * y
        self.soy = self.soy * decay + o * y
        self.count += 1

    def plane(self) -> tuple[float, float, float]:
        """(a, s, t) of y = a + s·b + t·o."""
        w = self.w
        mn, mo, my = self.sn / w, self.so / w, self.sy / w
        vn, vo, cno = self.snn / w - mn * mn, self.soo / w - mo * mo, self.sno / w - mn * mo
        cny, coy = self.sny / w - mn * my, self.soy / w - mo * my
        if self.so == 0.0:  # nothing ever ran beside: the per-path line
            a, s = _slope_line(mn, vn, cny, my)
            return a, s, 0.0
        det = vn * vo - cno * cno
        if vn >= MIN_SPREAD and vo >= MIN_SPREAD and det > (1.0 - MAX_CORRELATION2) * vn * vo:
            s, t = (cny * vo - coy * cno) / det, (coy * vn - cny * cno) / det
            if s >= 0.0 and t >= 0.0:
                return my - s * mn - t * mo, s, t
        # not separable (or a slope came out negative): every running request alike, x = b + o
        a, s = _slope_line(mn + mo, vn + vo + 2.0 * cno, cny + coy, my)
        return a, s, s

    def line(self) -> tuple[float, float]:
        """(a, s) of y = a + s·b at no load beside (the plane's intercept and own-path slope)."""
        a, s, _t = self.plane()
        return a, s

    def predict(self, n: float, o: float = 0.0) -> float:
        a, s, t = self.plane()
        return max(0.0, a + s * n + t * o)


def queued_latency(service: Callable[[float], float], in_flight: int, capacity: int | None) -> float:
    """Per-token latency of a request that makes the path's count ``in_flight`` (itself included):
    S(m) within capacity, S(C)·m/C beyond it."""
    m = float(max(in_flight, 1))
    if capacity is None or m <= capacity:
        return service(m)
    return service(float(capacity)) * m / capacity


class LoadLatencyModel:
    """Service time per token per (path key, segment); path keys are opaque (the policy uses ``Path``)."""

    def __init__(self, decay: float = 0.95) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self._fits: dict[tuple[object, str], LatencyFit] = {}
        self._lock = threading.Lock()

    def observe(self, path: object, segment: str, running: float, service_s: float, tokens: int,
                beside: float = 0.0) -> None:
        """One completed request: ``running`` the mean number of requests running on its path while
        it was served (itself included), ``beside`` on the other paths (0 unless they share
        hardware), ``service_s`` its time less the time it queued."""
        if running <= 0.0 or service_s < 0.0 or tokens < 1 or beside < 0.0:
            return  # nothing generated (or a bad clock): says nothing about per-token time
        with self._lock:
            fit = self._fits.setdefault((path, segment), LatencyFit())
            fit.add(float(running), service_s / tokens, self.decay, float(beside))

    def samples(self, path: object, segment: str) -> int:
        fit = self._fits.get((path, segment))
        return 0 if fit is None else fit.count

    def predict(self, path: object, segment: str, in_flight: int, capacity: int | None,
                beside: int = 0) -> float | None:
        """Seconds per generated token, queueing included, for a request that makes the path's
        count ``in_flight`` while ``beside`` run on the other paths (counted only where they share
        hardware); None: the segment has not been seen on the path."""
        with self._lock:
            fit = self._fits.get((path, segment))
            if fit is None:
                return None
            return queued_latency(lambda m: fit.predict(m, float(beside)), in_flight, capacity)

    def faster(self, segment: str, a: "Joining", b: "Joining", min_samples: int,
               margin: float = 0.0) -> bool | None:
        """Is path ``a = (path, in_flight, capacity, beside)`` predicted faster than ``b`` by more
        than ``margin`` (a fraction of b's time; 0: strictly faster)? None when either path has
        fewer than ``min_samples`` completions of the segment."""
        if min(self.samples(a[0], segment), self.samples(b[0], segment)) < max(min_samples, 1):
            return None
        pa, pb = self.predict(a[0], segment, *a[1:]), self.predict(b[0], segment, *b[1:])
        return pa is not None and pb is not None and pa < pb * (1.0 - margin)

    def snapshot(self) -> dict[str, dict[object, dict[str, float]]]:
        """segment -> path key -> {samples, a, s, t}: service seconds per token ≈ a + s·(requests
        running on the path) + t·(requests running beside it on the other paths)."""
        out: dict[str, dict[object, dict[str, float]]] = {}
        with self._lock:
            for (path, segment), fit in sorted(self._fits.items(), key=lambda kv: (kv[0][1], str(kv[0][0]))):
                a, s, t = fit.plane()
                out.setdefault(segment, {})[path] = {"samples": fit.count, "a": a, "s": s, "t": t}
        return out
