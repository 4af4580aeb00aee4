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
