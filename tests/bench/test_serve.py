"""`bench serve` planning and summary, without a service (the end-to-end quick run is in
tests/deployments/test_service_fake.py)."""
from __future__ import annotations

import pytest

from cluster.bench import serve as bench


@pytest.mark.parametrize("requests,conc,rounds,expected", [
    (16, 1, 0, (16, 1)),    # one wave per round: a request per policy in turn
    (16, 4, 0, (4, 4)),
    (16, 32, 0, (1, 32)),   # never fewer than the concurrency
    (10, 4, 0, (3, 4)),     # rounded up: every request asked for is sent
    (16, 1, 2, (2, 8)),     # explicit rounds split the cell
    (8, 8, 4, (1, 8)),      # a round is at least one wave
])
def test_round_plan(requests, conc, rounds, expected):
    assert bench.round_plan(requests, conc, rounds) == expected
    n_rounds, per = expected
    assert per >= conc and n_rounds * per >= max(requests, conc)


def test_summarize_ratio_against_better_fixed_policy():
    cells = [{"segment": "code", "concurrency": 1, "policy": p, "e2e_p50": v}
             for p, v in (("fixed_spec", 2.0), ("fixed_plain", 2.5), ("routed", 2.2))]
    (s,) = bench.summarize(cells)
    assert s["best_fixed"] == "fixed_spec"
    assert s["routed_over_best_fixed"] == pytest.approx(1.1)
    assert s["meets_goal"] is False
    assert s["ci90"] is None  # no per-request latencies: no interval


def test_ratio_interval_covers_the_ratio_and_widens_with_noise():
    routed = [1.0, 1.1, 0.9, 1.05, 0.95] * 4
    spec = [x * 1.2 for x in routed]
    lo, hi = bench.ratio_interval(routed, [spec, [9.0] * 20])
    assert lo <= 1 / 1.2 <= hi and hi - lo < 0.15
    assert bench.ratio_interval(routed, [spec]) == bench.ratio_interval(routed, [spec])  # seeded
    noisy = [0.5, 2.0, 0.7, 1.6, 1.0] * 4
    nlo, nhi = bench.ratio_interval(noisy, [spec])
    assert nhi - nlo > hi - lo
    assert bench.ratio_interval([], [spec]) is None and bench.ratio_interval(routed, [[]]) is None


def test_summarize_reports_interval_from_per_request_latencies():
    cells = [{"segment": "chat", "concurrency": 2, "policy": p, "e2e_p50": 2.0, "e2e_s": xs}
             for p, xs in (("fixed_spec", [2.0, 2.1, 1.9]), ("fixed_plain", [2.0, 2.2, 1.8]),
                           ("routed", [2.0, 2.05, 1.95]))]
    (s,) = bench.summarize(cells)
    assert s["routed_over_best_fixed"] == 1.0 and s["meets_goal"]
    lo, hi = s["ci90"]
    assert lo < 1.0 < hi


def test_round_order_balances_position_and_predecessor():
    from collections import Counter

    policies = ["fixed_spec", "fixed_plain", "routed"]
    orders = [bench.round_order(policies, r) for r in range(6)]
    assert all(sorted(o) == sorted(policies) for o in orders) and len({tuple(o) for o in orders}) == 6
    assert all(Counter(o[i] for o in orders) == Counter({p: 2 for p in policies}) for i in range(3))
    follows = Counter((a, b) for o in orders for a, b in zip(o, o[1:]))
    assert set(follows.values()) == {2} and len(follows) == 6  # each ordered pair twice
    assert bench.round_order(policies, 7) == orders[1]


def test_paired_ratio_cancels_what_the_rows_share():
    rows = [1.0, 3.0, 2.0, 6.0, 1.5, 4.0, 2.5, 5.0]  # prompts of very different length
    routed = [x * 1.02 for x in rows]
    ratio, (lo, hi) = bench.paired_ratio(routed, rows)
    assert ratio == pytest.approx(1.02) and lo == pytest.approx(1.02) and hi == pytest.approx(1.02)
    lo_unpaired, hi_unpaired = bench.ratio_interval(routed, [rows])
    assert hi_unpaired - lo_unpaired > 0.3  # the unpaired interval sees the prompt spread
    assert bench.paired_ratio(routed, rows[:-1]) is None and bench.paired_ratio([], []) is None
    cells = [{"segment": "code", "concurrency": 1, "policy": p, "e2e_p50": 2.0, "e2e_s": xs, "errors": {}}
             for p, xs in (("fixed_spec", rows), ("fixed_plain", [x * 1.5 for x in rows]), ("routed", routed))]
    (s,) = bench.summarize(cells)
    assert s["paired_ratio"] == pytest.approx(1.02) and s["paired_ci90"][0] <= 1.02 <= s["paired_ci90"][1]
    cells[2]["errors"] = {"UNAVAILABLE": 1}  # a failed request: the rows no longer pair up
    (s,) = bench.summarize(cells)
    assert s["paired_ratio"] is None


def test_a_workload_json_schema_object_travels_as_its_json_text():
    """json workload rows hold their schema as an object; the GenerateRequest field is its text."""
    import json

    from cluster.api.stubs import generation_pb2
    from cluster.bench.serve import _request

    pb2 = generation_pb2()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = _request(pb2, {"prompt": "x", "segment": "json", "json_schema": schema}, 0, 16)
    assert json.loads(req.json_schema) == schema and req.segment == "json"
    assert _request(pb2, {"prompt": "x", "json_schema": json.dumps(schema)}, 0, 16).json_schema == json.dumps(schema)


def test_routed_is_not_judged_where_a_learning_drafter_saw_its_rows_before():
    """Routed and fixed-spec answer the same rows: with a drafter that learns from traffic the
    second to run drafted from the first's answer (routed ran second in 5 of 8 rounds at
    concurrency 1 and measured half fixed-spec's latency: docs/measurements.md)."""
    cells = [{"segment": "chat", "concurrency": 1, "policy": p, "e2e_p50": v, "repeated_rows": n}
             for p, v, n in (("fixed_spec", 1.1, 3), ("fixed_plain", 1.6, 0), ("routed", 0.5, 5))]
    (learning,) = bench.summarize(cells, learns=True)
    assert learning["meets_goal"] is None and learning["repeated_rows"] == {"routed": 5, "fixed_spec": 3}
    (ngram,) = bench.summarize(cells, learns=False)  # n-gram drafts from the sequence alone
    assert ngram["meets_goal"] is True and ngram["repeated_rows"] == {"routed": 5, "fixed_spec": 3}
    fresh = [{**c, "repeated_rows": 0} for c in cells]
    assert "repeated_rows" not in bench.summarize(fresh, learns=True)[0]
    text = bench.format_report({"cells": [], "summary": [learning], "repeated_rows": None, "front_door": None})
    assert "NOT JUDGED (repeated rows drafted from memory)" in text
