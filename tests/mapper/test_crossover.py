"""Crossover detection on synthetic latency curves with known answers, its bootstrap interval,
and the cost model predicting a crossover at concurrencies that were not run."""
from __future__ import annotations

import math
import random

import pytest

from cluster.mapper.cost_model import CostModel, PathShape, fit, r_squared
from cluster.mapper.crossover import CrossoverKind, bootstrap_crossover, find_crossover

LEVELS = [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize("ratios,kind,value", [
    ([0.5, 0.6, 0.9, 1.1, 1.3, 1.5], CrossoverKind.WITHIN, 2 ** 2.5),   # halfway between 4 and 8 in log2
    ([0.5, 0.7, 0.8, 0.9, 0.95, 1.0], CrossoverKind.WITHIN, 32.0),     # exactly 1 at the top level
    ([0.4, 0.7, 1.0, 1.2, 1.4, 1.6], CrossoverKind.WITHIN, 4.0),
    ([0.5, 0.6, 0.7, 0.8, 0.9, 0.95], CrossoverKind.ABOVE, None),      # speculation still wins at 32
    ([1.0, 1.1, 1.2, 1.3, 1.4, 1.5], CrossoverKind.BELOW, 1.0),        # never pays
    ([0.5, 1.05, 0.9, 0.8, 1.2, 1.4], CrossoverKind.WITHIN, 2 ** (3 + 0.2 / 0.4)),  # blip at 2 is noise
    ([0.5, 0.6, 1.2, 1.3, 1.1, 0.9], CrossoverKind.ABOVE, None),       # wins again at the top: not yet crossed
])
def test_find_crossover_known_answers(ratios, kind, value):
    got = find_crossover(LEVELS, ratios)
    assert got.kind is kind
    if value is None:
        assert got.value is None
    else:
        assert got.value == pytest.approx(value, rel=1e-3)


def test_find_crossover_rejects_mismatched_input():
    with pytest.raises(ValueError):
        find_crossover([1, 2], [0.5])
    with pytest.raises(ValueError):
        find_crossover([], [])


def _curves(cross: float, noise: float, n: int = 24, seed: int = 0):
    """Per-request e2e per level: plain flat at 1 s, spec = (c / cross) ** 0.5 s, so the
    true ratio is 1 exactly at c = cross; lognormal noise per request."""
    rng = random.Random(seed)
    spec = [[(c / cross) ** 0.5 * math.exp(rng.gauss(0, noise)) for _ in range(n)] for c in LEVELS]
    plain = [[math.exp(rng.gauss(0, noise)) for _ in range(n)] for c in LEVELS]
    return spec, plain


@pytest.mark.parametrize("cross", [3.0, 6.0, 12.0])
def test_bootstrap_interval_covers_the_true_crossover_and_widens_with_noise(cross):
    spec, plain = _curves(cross, 0.05)
    got = bootstrap_crossover(LEVELS, spec, plain)
    assert got["kind"] == "within"
    # within one level of the truth (log2 distance < 1), and the interval covers it
    assert abs(math.log2(got["value"]) - math.log2(cross)) < 1.0
    lo, hi = got["ci90"]
    assert lo <= cross <= hi
    noisy = bootstrap_crossover(LEVELS, *_curves(cross, 0.4, seed=1))
    nlo, nhi = noisy["ci90"]
    assert nhi is None or nlo is None or (nhi - nlo) > (hi - lo)
    assert bootstrap_crossover(LEVELS, spec, plain) == got  # seeded


def test_bootstrap_when_speculation_always_wins():
    spec, plain = _curves(1000.0, 0.05)
    got = bootstrap_crossover(LEVELS, spec, plain)
    assert got["kind"] == "above" and got["value"] is None and got["ci90"] == [None, None]
    assert got["share_crossed"] == 0.0


# -- the cost model ---------------------------------------------------------------------------------
PLAIN = PathShape(cap=32, tokens_fed=1.0, committed=1.0, drafts=False)
SPEC = PathShape(cap=8, tokens_fed=5.0, committed=2.5, drafts=True)


def test_cost_model_recovers_its_parameters_and_predicts_unrun_crossover():
    truth = CostModel(a=0.020, beta=0.0008, delta=0.0005)
    rng = random.Random(0)
    run = [1, 2, 4]  # only low concurrency measured
    points = [(sh, c, truth.tpot(sh, c) * (1 + rng.gauss(0, 0.01))) for c in run for sh in (PLAIN, SPEC)]
    got = fit(points)
    assert got.a == pytest.approx(truth.a, rel=0.1)
    assert got.beta == pytest.approx(truth.beta, rel=0.2)
    assert got.delta == pytest.approx(truth.delta, abs=0.0005)
    assert r_squared(got, points) > 0.95
    true_cross = truth.crossover(SPEC, PLAIN)
    assert true_cross is not None and true_cross > 4  # beyond every level run
    assert abs(math.log2(got.crossover(SPEC, PLAIN)) - math.log2(true_cross)) < 1.0
    # the model itself: the ratio is < 1 below its crossover and >= 1 from it on
    assert truth.ratio(SPEC, PLAIN, math.floor(true_cross)) < 1.0 <= truth.ratio(SPEC, PLAIN, math.ceil(true_cross))


def test_cost_model_queueing_beyond_capacity_and_edge_cases():
    m = CostModel(a=0.01, beta=0.0, delta=0.0)
    assert m.latency(SPEC, 8) == pytest.approx(0.01 / 2.5)
    assert m.latency(SPEC, 24) == pytest.approx(0.01 / 2.5 * 2.0)  # 3 waves: median waits one
    # by hand: plain 0.01 s/token up to 32; spec 0.004 x (c/8 + 1)/2 past 8 -> equal at c = 32
    assert m.crossover(SPEC, PLAIN) == pytest.approx(32.0, abs=0.01)
    never = PathShape(cap=8, tokens_fed=5.0, committed=1.0, drafts=True)
    assert CostModel(0.01, 0.001, 0.0).crossover(never, PLAIN) == 1.0  # costs more even alone
    assert fit([(PLAIN, 1, 0.01)]) is None
    with pytest.raises(ValueError):
        PathShape(cap=0, tokens_fed=1.0, committed=1.0, drafts=False)


def test_point_estimate_uses_the_cells_own_p50():
    """The crossover's ratios are the sweep cells' e2e_p50 ratios (``bench serve``'s percentile),
    not another median of the same requests (an even count once split the two)."""
    from cluster.bench.serve import percentile

    spec = [[1.0, 1.1, 1.2, 1.3], [5.01, 5.32, 5.32, 5.32, 6.0, 6.0, 6.0, 6.0]]
    plain = [[2.0, 2.0, 2.0, 2.0], [5.8] * 8]
    ratios = [percentile(s, 0.5) / percentile(p, 0.5) for s, p in zip(spec, plain)]
    assert ratios[1] > 1.0  # by the cells' p50 plain wins at the second level
    got = bootstrap_crossover([1, 2], spec, plain)
    assert got["kind"] == find_crossover([1, 2], ratios).kind.value == "within"
