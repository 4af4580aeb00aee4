"""A ``bench spec`` row from timed runs: step parts, α by position, the prediction from per-position
α with the prefills and mean costs, α (not accepted / drafted) in the prediction."""
from __future__ import annotations

import pytest

from cluster.bench import spec_rows
from cluster.bench.timed_run import Run


def test_step_ms_parts_are_means_that_add_up_to_the_steps_outside_the_forward():
    a = Run(1.0, 4, [1, 2, 3, 4], step_parts=[(0.001, 0.002, 0.0005, 0.0015), (0.003, 0.0, 0.0005, 0.0005)])
    b = Run(1.0, 2, [1, 2], step_parts=[(0.002, 0.004, 0.002, 0.001)])
    parts = spec_rows.step_ms_parts([a, b])
    assert parts == {"plan": 2.0, "drafter": 2.0, "sampling": 1.0, "other": 1.0}
    assert spec_rows.step_ms_parts([Run(1.0, 0, [])]) is None  # no decode step: no parts


def test_prediction_uses_per_position_alpha():
    """A known per-position α: 0.5, K = 3, c = 0.1, v = 1.2 -> E = (1 - 0.5^4) / 0.5 = 1.875 tokens
    per verification step at 0.3 + 1.2 plain-step times: 1.25x. Plain steps of the spec run
    (nothing drafted) count 1 token per plain-step time; steps of other K by their own E."""
    assert spec_rows.predicted_speedup(0.5, [0, 0, 0, 10], 0.1, 1.2) == pytest.approx(1.25)
    assert spec_rows.predicted_speedup(0.5, [0, 0, 0, 10], 0.1, 1.2, plain_steps=15) == pytest.approx(
        (18.75 + 15) / (15 + 15))
    assert spec_rows.predicted_speedup(0.5, [0, 4, 0, 2], 0.0, 1.0) == pytest.approx((4 * 1.5 + 2 * 1.875) / 6)
    assert spec_rows.predicted_speedup(0.9, [], 0.1, 1.2) == 1.0  # nothing ran
    # the speculative engine's own plain steps at 1.1 plain-step times, 20 plain-step times of prefill
    assert spec_rows.predicted_speedup(0.5, [0, 0, 0, 10], 0.1, 1.2, plain_steps=15, plain_cost=1.1,
                                        prefill=20) == pytest.approx((20 + 18.75 + 15) / (20 + 15 * 1.1 + 15))


def test_the_prediction_is_of_the_pooled_speedup_with_mean_costs_and_the_prefills():
    """Half the decode time with speculation makes the prompts' forwards weigh twice as much: a
    prediction without them overstated the end-to-end speedup by 13-18% on long prompts. Two
    prompts, each 10 plain-step times of prefill and 40 decode tokens: the row predicts the pooled
    speedup from mean step costs (a skewed verification step counts at its mean) and matches it
    when the runs follow the model exactly."""
    t = 0.010
    plain = [Run(0.1 + 40 * t, 41, [], decode_steps=[t] * 40, prefill_s=0.1) for _ in range(2)]
    spec = []
    for _ in range(2):  # 20 verification steps at K = 1, every draft accepted: 2 tokens each
        r = Run(0.0, 41, [], verify_steps=[1.0 * t] * 10 + [1.4 * t] * 10, prefill_s=0.1)
        r.round_costs = [0.0] * 20
        r.steps_by_num_draft_tokens = [0, 20]
        r.drafts = r.draft_tokens = r.accepted_tokens = 20
        r.accepted_per_position, r.drafted_per_position = [20], [20]
        r.wall_s = r.prefill_s + sum(r.verify_steps)
        spec.append(r)
    row = spec_rows.summarize_row(plain, spec, None, None, 1)
    pooled = (2 * (0.1 + 0.4)) / (2 * (0.1 + 0.24))
    assert row["pooled_speedup"] == pytest.approx(pooled, rel=1e-3)
    assert row["predicted_speedup"] == pytest.approx(pooled, rel=1e-3)  # (10 + 40) / (10 + 20 x 1.2)
    assert row["v"] == pytest.approx(1.2, abs=0.21)  # the reported v stays the median step
    no_prefill = spec_rows.predicted_speedup(1.0, [0, 40], 0.0, 1.2)
    assert no_prefill == pytest.approx(80 / 48) and no_prefill > 1.1 * row["pooled_speedup"]


def test_summarize_row_predicts_from_alpha_not_acceptance_rate():
    """Runs whose steps follow a per-position α of 0.7 at K = 4: the row's α recovers it, the
    prediction is E(0.7, 4) / v, and accepted/drafted (reported as acceptance_rate, biased low)
    does not enter it — so "measured >= 0.9 x predicted" can fail when the cost model is wrong."""
    import random

    rng = random.Random(11)
    spec = Run(1.0, 0, [], verify_steps=[0.011] * 2000)
    spec.steps_by_num_draft_tokens = [0, 0, 0, 0, 2000]
    for _ in range(2000):
        a = 0
        while a < 4 and rng.random() < 0.7:
            a += 1
        spec.drafts, spec.draft_tokens, spec.accepted_tokens = spec.drafts + 1, spec.draft_tokens + 4, spec.accepted_tokens + a
        spec.rejections += a < 4
    plain = Run(2.0, 0, [], decode_steps=[0.010] * 50)
    row = spec_rows.summarize_row([plain], [spec], None, None, 4)
    assert row["alpha"] == pytest.approx(0.7, abs=0.02) and row["acceptance_rate"] < 0.62
    e = (1 - row["alpha"] ** 5) / (1 - row["alpha"])
    assert row["predicted_speedup"] == pytest.approx(e / 1.1, rel=1e-3)
    assert row["speedup"] == 2.0


def test_alpha_by_position_is_conditional_and_exact_only_where_every_draft_reaches_the_position():
    """Fixed K = 3, 10 drafts: 8 accept token 1, 4 of those token 2, 1 token 3 -> α = 0.8, 0.5,
    0.25. Auto K (drafts of mixed lengths) gives position 1 alone."""
    run = Run(1.0, 0, [])
    run.accepted_per_position, run.drafted_per_position = [8, 4, 1], [10, 10, 10]
    assert spec_rows.alpha_by_position([run], fixed=True) == [0.8, 0.5, 0.25]
    assert spec_rows.alpha_by_position([run], fixed=False) == [0.8]
    assert spec_rows.alpha_by_position([Run(1.0, 0, [])], fixed=True) == []
