"""The step-time cost model of ``specserve map``: fitted from the sweep, it predicts each path's
per-request latency — and so the crossover — at concurrencies that were not run.

Owns: the model and its least-squares fit. One engine step with b sequences running, feeding n
tokens in all, takes s = a + β·n + δ·b_spec seconds: a fixed part (weights read once per step),
a part per token fed (compute), and the drafting each speculative sequence does per step (δ;
zero on the plain path). A plain sequence feeds 1 token and commits 1 per step; a speculative one
feeds w = K+1 and commits E (its mean acceptance length, from the profile). So
TPOT_plain(c) = s(b=min(c, cap_plain), n=b)  and  TPOT_spec(c) = s(b=min(c, cap_spec), n=b·w) / E,
where cap is the path's sequences at once (max_num_seqs × replicas). Beyond cap requests wait in
waves; the median request's end-to-end time is then its service time × (c/cap + 1)/2.
a, β, δ are machine constants shared by all segments (fitted on every cell's TPOT p50 at once,
non-negative); E and w are per segment. Ignores: prefill (it cancels in the ratio for the same
rows) and CPU contention between the two paths' processes (each path is swept alone).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


@dataclass(slots=True, frozen=True)
class PathShape:
    """What the model needs to know of one path for one segment."""

    cap: int  # sequences running at once
    tokens_fed: float  # per sequence per step: 1 (plain) or K+1 (speculative)
    committed: float  # per sequence per step: 1 (plain) or the mean acceptance length
    drafts: bool  # pays δ per sequence per step

    def __post_init__(self) -> None:
        if self.cap < 1 or self.tokens_fed <= 0 or self.committed <= 0:
            raise ValueError(f"bad path shape {self}")


@dataclass(slots=True, frozen=True)
class CostModel:
    a: float  # seconds per step
    beta: float  # seconds per token fed
    delta: float  # seconds of drafting per speculative sequence per step

    def tpot(self, shape: PathShape, c: float) -> float:
        b = min(c, shape.cap)
        step = self.a + self.beta * b * shape.tokens_fed + (self.delta * b if shape.drafts else 0.0)
        return step / shape.committed

    def latency(self, shape: PathShape, c: float) -> float:
        """Median per-output-token latency of a request, waves included."""
        waves = max(1.0, (c / shape.cap + 1.0) / 2.0) if c > shape.cap else 1.0
        return self.tpot(shape, c) * waves

    def ratio(self, spec: PathShape, plain: PathShape, c: float) -> float:
        return self.latency(spec, c) / self.latency(plain, c)

    def crossover(self, spec: PathShape, plain: PathShape, max_c: int = 1024) -> float | None:
        """The smallest concurrency (to 0.01, log-interpolated between integers) where speculation
        stops being faster; None when it never does up to ``max_c``; 1.0 when it never pays."""
        prev = self.ratio(spec, plain, 1)
        if prev >= 1.0:
            return 1.0
        for c in range(2, max_c + 1):
            r = self.ratio(spec, plain, c)
            if r >= 1.0:
                x0, x1 = math.log2(c - 1), math.log2(c)
                return round(2.0 ** (x0 + (1.0 - prev) / (r - prev) * (x1 - x0)), 2)
            prev = r
        return None


def fit(points: list[tuple[PathShape, float, float]]) -> CostModel | None:
    """Least squares of (a, β, δ) >= 0 from (shape, concurrency, measured TPOT seconds) points;
    None with fewer than three. TPOT·E = a + β·b·w + δ·b·[spec] is linear in the parameters."""
    import numpy as np

    pts = [(sh, c, t) for sh, c, t in points if t and t > 0]
    if len(pts) < 3:
        return None
    X = np.array([[1.0, min(c, sh.cap) * sh.tokens_fed, min(c, sh.cap) if sh.drafts else 0.0] for sh, c, _ in pts])
    y = np.array([t * sh.committed for sh, _, t in pts])
    active = [0, 1, 2]
    while True:  # drop a column whose coefficient comes out negative and refit (tiny NNLS)
        coef, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        neg = [active[i] for i, v in enumerate(coef) if v < 0]
        if not neg:
            break
        active = [i for i in active if i != neg[0]]
        if not active:
            return None
    full = [0.0, 0.0, 0.0]
    for i, v in zip(active, coef):
        full[i] = float(v)
    return CostModel(*full)


def r_squared(model: CostModel, points: list[tuple[PathShape, float, float]]) -> float | None:
    ys = [t for _, _, t in points]
    if len(ys) < 2:
        return None
    mean = sum(ys) / len(ys)
    tot = sum((y - mean) ** 2 for y in ys)
    res = sum((t - model.tpot(sh, c)) ** 2 for sh, c, t in points)
    return round(1.0 - res / tot, 4) if tot > 0 else None
