"""The crossover concurrency of one segment: where fixed-speculative stops being faster than
fixed-plain (e2e p50), with its uncertainty.

Owns: the crossing point of the ratio r(c) = spec p50 / plain p50 over the measured levels —
linear in log2(c) between the last level where speculation wins (r < 1) and the next, from which
on it never does — and a bootstrap of it (each cell's per-request latencies resampled, seeded) for a 90%
interval. Ignores: how the latencies were measured (``sweep``) and concurrencies not run
(``cost_model``).
"""
from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass


class CrossoverKind(enum.Enum):
    WITHIN = "within"  # crossed between two measured levels
    BELOW = "below"  # plain already as fast at the lowest level: speculation never paid
    ABOVE = "above"  # speculation still faster at the highest level run


@dataclass(slots=True, frozen=True)
class Crossover:
    kind: CrossoverKind
    value: float | None  # concurrency (WITHIN), the lowest level (BELOW), None (ABOVE)

    def as_number(self) -> float:
        """For intervals: ABOVE counts as infinitely far, BELOW as the lowest level."""
        return math.inf if self.kind is CrossoverKind.ABOVE else float(self.value)


def find_crossover(levels: list[int], ratios: list[float]) -> Crossover:
    """``levels`` ascending, ``ratios`` spec/plain p50 per level. The crossing after which the
    ratio stays >= 1: speculation's cost grows with load, so a level where it wins again after
    having lost is read as noise in the lower level, not as a second crossing."""
    if not levels or len(levels) != len(ratios):
        raise ValueError("levels and ratios must be non-empty and of equal length")
    if ratios[-1] < 1.0:
        return Crossover(CrossoverKind.ABOVE, None)
    j = len(ratios) - 1
    while j > 0 and ratios[j - 1] >= 1.0:
        j -= 1
    if j == 0:
        return Crossover(CrossoverKind.BELOW, float(levels[0]))
    x0, x1 = math.log2(levels[j - 1]), math.log2(levels[j])
    r0, r1 = ratios[j - 1], ratios[j]
    x = x0 + (1.0 - r0) / (r1 - r0) * (x1 - x0)
    return Crossover(CrossoverKind.WITHIN, round(2.0 ** x, 3))


def bootstrap_crossover(levels: list[int], spec: list[list[float]], plain: list[list[float]],
                        resamples: int = 1000, seed: int = 0) -> dict:
    """Point estimate and 90% interval of the crossover from per-request e2e latencies per level.
    ``interval`` bounds are concurrencies; ``None`` as the upper bound means "beyond the highest
    level run" (some draws never crossed)."""
    from cluster.bench.serve import percentile

    med = lambda xs: percentile(xs, 0.5)  # noqa: E731 -- the cells' own e2e_p50, so the ratios match the report
    point = find_crossover(levels, [med(s) / med(p) for s, p in zip(spec, plain)])
    rng = random.Random(seed)
    draws = []
    for _ in range(resamples):
        ratios = [med(rng.choices(s, k=len(s))) / med(rng.choices(p, k=len(p))) for s, p in zip(spec, plain)]
        draws.append(find_crossover(levels, ratios).as_number())
    draws.sort()
    lo, hi = draws[int(0.05 * (len(draws) - 1))], draws[int(0.95 * (len(draws) - 1))]
    from cluster.bench.serve import ratio_interval

    first = ratio_interval(spec[0], [plain[0]], resamples, seed)  # is "below" clear, or noise?
    return {"kind": point.kind.value, "value": point.value,
            "ci90": [lo if math.isfinite(lo) else None, hi if math.isfinite(hi) else None],
            "share_crossed": round(sum(math.isfinite(d) for d in draws) / len(draws), 3),
            "lowest_level_ratio_ci90": list(first) if first else None}
