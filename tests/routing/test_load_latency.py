import pytest

from cluster.routing.load_latency import InFlightMeter, LatencyFit, LoadLatencyModel


def test_fit_recovers_a_line_and_extrapolates():
    fit = LatencyFit()
    for n in (1, 2, 4, 8, 16) * 3:
        fit.add(n, 0.10 + 0.02 * n, decay=1.0)
    a, b = fit.line()
    assert a == pytest.approx(0.10) and b == pytest.approx(0.02)
    assert fit.predict(32) == pytest.approx(0.74)


def test_unspread_counts_extrapolate_in_proportion_and_slope_never_negative():
    fit = LatencyFit()
    for _ in range(10):
        fit.add(2, 0.3, decay=0.9)
    assert fit.line() == pytest.approx((0.0, 0.15))  # y = ȳ·n/n̄
    assert fit.predict(6) == pytest.approx(0.9)
    falling = LatencyFit()
    for n, y in ((1, 0.5), (5, 0.4), (9, 0.3)):
        falling.add(n, y, decay=1.0)
    a, b = falling.line()
    assert b == 0.0 and a == pytest.approx(0.4)  # noise that "says" load speeds a path up is ignored


def test_recent_observations_outweigh_old_ones():
    m = LoadLatencyModel(decay=0.8)
    for _ in range(20):
        m.observe("p", "chat", 4, e2e_s=4.0, tokens=10)  # 0.4 s/token
    for _ in range(20):
        m.observe("p", "chat", 4, e2e_s=1.0, tokens=10)  # the path got faster: 0.1 s/token
    assert m.predict("p", "chat", 4) == pytest.approx(0.1, abs=0.005)


def test_observe_ignores_requests_that_say_nothing():
    m = LoadLatencyModel()
    m.observe("p", "s", 0, 1.0, 10)
    m.observe("p", "s", 1, 1.0, 0)
    m.observe("p", "s", 1, -0.5, 10)
    assert m.samples("p", "s") == 0 and m.predict("p", "s", 1) is None


def test_faster_compares_paths_at_their_own_counts_per_segment():
    m = LoadLatencyModel(decay=1.0)
    for n in range(1, 17):  # summarize: the fast path per token carries 3x the load at equal latency
        m.observe("spec", "summarize", n, e2e_s=0.01 * n * 32, tokens=32)
        m.observe("plain", "summarize", n, e2e_s=0.03 * n * 32, tokens=32)
    assert m.faster("summarize", ("spec", 8), ("plain", 4), min_samples=8) is True
    assert m.faster("summarize", ("spec", 13), ("plain", 4), min_samples=8) is False
    assert m.faster("summarize", ("plain", 4), ("spec", 10), min_samples=8) is False
    assert m.faster("chat", ("spec", 1), ("plain", 9), min_samples=8) is None  # chat unmeasured
    assert m.faster("summarize", ("spec", 1), ("plain", 9), min_samples=17) is None  # too few yet
    snap = m.snapshot()["summarize"]
    assert snap["spec"]["samples"] == 16 and snap["plain"]["b"] == pytest.approx(0.03)


def test_decay_must_be_a_fraction():
    with pytest.raises(ValueError):
        LoadLatencyModel(decay=0.0)
    with pytest.raises(ValueError):
        LoadLatencyModel(decay=1.5)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_meter_charges_a_request_the_mean_load_it_ran_under():
    clock = _Clock()
    m = InFlightMeter(clock)
    first = m.enter("plain")  # alone for 1 s, then 15 more arrive and all run 3 s together
    clock.t += 1.0
    others = [m.enter("plain") for _ in range(15)]
    assert m.count("plain") == 16 and m.count("spec") == 0
    clock.t += 3.0
    assert m.mean_load(first) == pytest.approx((1 * 1.0 + 16 * 3.0) / 4.0)
    assert m.mean_load(others[-1]) == pytest.approx(16.0)
    m.leave(first)
    for mark in others[:-1]:
        m.leave(mark)
    clock.t += 2.0  # the last one finishes alone
    assert m.mean_load(others[-1]) == pytest.approx((16 * 3.0 + 1 * 2.0) / 5.0)
    m.leave(others[-1])
    assert m.count("plain") == 0
    instant = m.enter("spec")  # no time passed: the count itself
    assert m.mean_load(instant) == 1.0
