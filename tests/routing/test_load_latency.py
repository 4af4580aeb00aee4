import pytest

from cluster.routing.load_latency import InFlightMeter, LatencyFit, LoadLatencyModel, queued_latency


def test_fit_recovers_a_line_and_extrapolates():
    fit = LatencyFit()
    for n in (1, 2, 4, 8, 16) * 3:
        fit.add(n, 0.10 + 0.02 * n, decay=1.0)
    a, s = fit.line()
    assert a == pytest.approx(0.10) and s == pytest.approx(0.02)
    assert fit.predict(32) == pytest.approx(0.74)


def test_unspread_batches_extrapolate_in_proportion_and_slope_never_negative():
    fit = LatencyFit()
    for _ in range(10):
        fit.add(2, 0.3, decay=0.9)
    assert fit.line() == pytest.approx((0.0, 0.15))  # S = ȳ·b/b̄
    assert fit.predict(6) == pytest.approx(0.9)
    falling = LatencyFit()
    for n, y in ((1, 0.5), (5, 0.4), (9, 0.3)):
        falling.add(n, y, decay=1.0)
    a, s = falling.line()
    assert s == 0.0 and a == pytest.approx(0.4)  # noise that "says" load speeds a path up is ignored


def test_queued_latency_drains_beyond_capacity():
    service = lambda b: 0.1 + 0.01 * b  # noqa: E731
    assert queued_latency(service, 4, capacity=8) == pytest.approx(0.14)
    assert queued_latency(service, 8, capacity=8) == pytest.approx(0.18)
    assert queued_latency(service, 24, capacity=8) == pytest.approx(0.18 * 3)  # 16 ahead, 8 at a time
    assert queued_latency(service, 24, capacity=None) == pytest.approx(0.34)
    assert queued_latency(service, 0, capacity=8) == pytest.approx(0.11)  # at least itself


def test_recent_observations_outweigh_old_ones():
    m = LoadLatencyModel(decay=0.8)
    for _ in range(20):
        m.observe("p", "chat", 4, service_s=4.0, tokens=10)  # 0.4 s/token
    for _ in range(20):
        m.observe("p", "chat", 4, service_s=1.0, tokens=10)  # the path got faster: 0.1 s/token
    assert m.predict("p", "chat", 4, capacity=None) == pytest.approx(0.1, abs=0.005)


def test_observe_ignores_requests_that_say_nothing():
    m = LoadLatencyModel()
    m.observe("p", "s", 0, 1.0, 10)
    m.observe("p", "s", 1, 1.0, 0)
    m.observe("p", "s", 1, -0.5, 10)
    assert m.samples("p", "s") == 0 and m.predict("p", "s", 1, None) is None


def test_faster_compares_paths_at_their_own_counts_and_capacities_per_segment():
    m = LoadLatencyModel(decay=1.0)
    for b in range(1, 9):  # summarize: spec 10 ms/token per running request, plain 30
        m.observe("spec", "summarize", b, service_s=0.01 * b * 32, tokens=32)
        m.observe("plain", "summarize", b, service_s=0.03 * b * 32, tokens=32)
    assert m.faster("summarize", ("spec", 8, 8), ("plain", 4, 16), min_samples=8) is True  # 0.08 < 0.12
    assert m.faster("summarize", ("spec", 13, 8), ("plain", 4, 16), min_samples=8) is False  # 0.13 > 0.12
    # beyond its capacity the spec path queues: 24 in flight drain 8 at a time, 0.08·3 = 0.24
    assert m.faster("summarize", ("spec", 24, 8), ("plain", 9, 16), min_samples=8) is True  # 0.24 < 0.27
    assert m.faster("summarize", ("spec", 24, 8), ("plain", 7, 16), min_samples=8) is False  # 0.24 > 0.21
    assert m.faster("chat", ("spec", 1, 8), ("plain", 9, 16), min_samples=8) is None  # chat unmeasured
    assert m.faster("summarize", ("spec", 1, 8), ("plain", 9, 16), min_samples=9) is None  # too few yet
    snap = m.snapshot()["summarize"]
    assert snap["spec"]["samples"] == 8 and snap["plain"]["s"] == pytest.approx(0.03)


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


def test_meter_charges_a_request_the_requests_it_ran_beside():
    clock = _Clock()
    m = InFlightMeter(clock=clock)  # no capacity: everything in flight runs
    first = m.enter("plain")  # alone for 1 s, then 15 more arrive and all run 3 s together
    clock.t += 1.0
    others = [m.enter("plain") for _ in range(15)]
    assert m.count("plain") == 16 and m.count("spec") == 0
    clock.t += 3.0
    assert m.served(first) == pytest.approx(((1 * 1.0 + 16 * 3.0) / 4.0, 4.0))
    assert m.served(others[-1]) == pytest.approx((16.0, 3.0))
    m.leave(first)
    for mark in others[:-1]:
        m.leave(mark)
    clock.t += 2.0  # the last one finishes alone
    assert m.served(others[-1]) == pytest.approx(((16 * 3.0 + 1 * 2.0) / 5.0, 5.0))
    m.leave(others[-1])
    assert m.count("plain") == 0
    instant = m.enter("spec")  # no time passed: the count itself
    assert m.served(instant) == (1.0, 0.0)


def test_meter_takes_the_queue_wait_out_beyond_capacity():
    clock = _Clock()
    m = InFlightMeter({"spec": 4}, clock=clock)
    batch = [m.enter("spec") for _ in range(4)]
    late = m.enter("spec")  # 5th: waits 2 s for a slot while 4 run, then runs 1 s beside 1 other
    clock.t += 2.0
    for mark in batch[:3]:
        m.leave(mark)
    clock.t += 1.0
    assert m.served(late, queue_s=2.0) == pytest.approx((2.0, 1.0))
    assert m.served(batch[3]) == pytest.approx(((4 * 2.0 + 2 * 1.0) / 3.0, 3.0))  # min(5, 4) = 4 first
    assert m.served(late, queue_s=99.0) == (2.0, 0.0)  # queue clipped to its life: no service seen
