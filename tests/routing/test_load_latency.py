import pytest

from cluster.routing.load_latency import (InFlightMeter, LatencyFit, LoadLatencyModel, Served,
                                          queued_latency)


def own(seen: Served) -> tuple[float, float]:
    return seen.running, seen.service_s


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
    assert own(m.served(first)) == pytest.approx(((1 * 1.0 + 16 * 3.0) / 4.0, 4.0))
    assert own(m.served(others[-1])) == pytest.approx((16.0, 3.0))
    m.leave(first)
    for mark in others[:-1]:
        m.leave(mark)
    clock.t += 2.0  # the last one finishes alone
    assert own(m.served(others[-1])) == pytest.approx(((16 * 3.0 + 1 * 2.0) / 5.0, 5.0))
    m.leave(others[-1])
    assert m.count("plain") == 0
    instant = m.enter("spec")  # no time passed: the count itself
    assert own(m.served(instant)) == (1.0, 0.0)


def test_meter_takes_the_queue_wait_out_beyond_capacity():
    clock = _Clock()
    m = InFlightMeter({"spec": 4}, clock=clock)
    batch = [m.enter("spec") for _ in range(4)]
    late = m.enter("spec")  # 5th: waits 2 s for a slot while 4 run, then runs 1 s beside 1 other
    clock.t += 2.0
    for mark in batch[:3]:
        m.leave(mark)
    clock.t += 1.0
    assert own(m.served(late, queue_s=2.0)) == pytest.approx((2.0, 1.0))
    assert own(m.served(batch[3])) == pytest.approx(((4 * 2.0 + 2 * 1.0) / 3.0, 3.0))  # min(5, 4) = 4 first
    assert own(m.served(late, queue_s=99.0)) == (2.0, 0.0)  # queue clipped to its life: no service seen


def test_meter_counts_the_other_paths_running_beside():
    clock = _Clock()
    m = InFlightMeter({"spec": 4, "plain": 8}, clock=clock)
    mark = m.enter("spec")
    plain = [m.enter("plain") for _ in range(3)]  # 3 plain for 2 s, then 1 for 2 s
    clock.t += 2.0
    for p in plain[:2]:
        m.leave(p)
    clock.t += 2.0
    seen = m.served(mark)
    assert (seen.running, seen.beside, seen.service_s) == pytest.approx((1.0, 2.0, 4.0))
    lonely = m.enter("spec")  # nothing else ran beside it on other paths since it entered
    m.leave(plain[2])
    clock.t += 1.0
    assert m.served(lonely).beside == pytest.approx(0.0)


def _shared_truth(b: float, o: float) -> float:
    return 0.01 + 0.02 * b + 0.03 * o  # seconds per token: own and other path's requests cost


def test_shared_fit_separates_own_and_other_path_load():
    fit = LatencyFit()
    for b, o in [(1, 0), (2, 4), (4, 1), (6, 6), (3, 8), (8, 2), (5, 5), (1, 7)]:
        fit.add(b, _shared_truth(b, o), decay=1.0, o=o)
    assert fit.plane() == pytest.approx((0.01, 0.02, 0.03))
    assert fit.predict(2, 3) == pytest.approx(_shared_truth(2, 3))


def test_shared_fit_falls_back_to_total_load_when_not_separable():
    fit = LatencyFit()
    for b in (1, 2, 4, 6, 8):  # o always equals b: the data cannot tell the slopes apart
        fit.add(b, 0.01 + 0.01 * (b + b), decay=1.0, o=b)
    a, s, t = fit.plane()
    assert (a, s, t) == pytest.approx((0.01, 0.01, 0.01))  # every running request alike
    unshared = LatencyFit()
    for b in (1, 2, 4):
        unshared.add(b, 0.02 * b, decay=1.0)
    assert unshared.plane()[2] == 0.0 and unshared.predict(3, 99) == pytest.approx(0.06)


def test_shared_model_sees_what_a_per_path_model_misses():
    """Equal engines on the same cores, the SpecEngine running 4 and the BatchEngine 0: joining
    either path puts 5 requests on the cores. The shared model predicts both alike (within the
    margin: no request is moved); a per-path model, which never sees the other path's load, credits
    plain with the quiet it will not have and moves the request (rule 9's split that ran slower
    than either path)."""
    shared, per_path = LoadLatencyModel(decay=1.0), LoadLatencyModel(decay=1.0)
    truth = lambda b, o: 0.01 * (b + o)  # noqa: E731 — one pool of work on shared cores
    for path, loads in (("spec", [(1, 0), (2, 1), (4, 0), (5, 2), (3, 3), (6, 1), (2, 4), (4, 4)]),
                        ("plain", [(1, 4), (2, 5), (1, 6), (3, 4), (2, 2), (4, 5), (1, 1), (3, 6)])):
        for b, o in loads:
            shared.observe(path, "chat", b, truth(b, o) * 10, 10, beside=o)
            per_path.observe(path, "chat", b, truth(b, o) * 10, 10)
    spec, plain = ("spec", 5, 8, 0), ("plain", 1, 8, 4)  # joining each: own count + 1, the other's beside
    assert shared.predict("spec", "chat", 5, 8) == pytest.approx(truth(5, 0))
    assert shared.predict("plain", "chat", 1, 8, beside=4) == pytest.approx(truth(1, 4))
    assert shared.faster("chat", plain, spec, 8, margin=0.05) is False
    assert shared.faster("chat", spec, plain, 8, margin=0.05) is False
    assert per_path.faster("chat", plain, spec, 8, margin=0.05) is True
