"""α in one place: the expected-token formula, the counting rule (per position, not accepted /
drafted), adaptive K's shrunk estimator and the Router's live per-segment α."""
from __future__ import annotations

import random

import pytest

from cluster.common.request import SpecStats
from cluster.speculative.acceptance import AcceptanceEstimator, AlphaCounts, LiveAlpha, expected_committed


def test_expected_committed_matches_design_numbers():
    # DESIGN.md: α=0.6, K=5 gives ~2.4 tokens per target pass, α=0.8 gives ~3.7.
    assert expected_committed(0.6, 5) == pytest.approx(2.38, abs=0.01)
    assert expected_committed(0.8, 5) == pytest.approx(3.69, abs=0.01)
    assert expected_committed(1.0, 4) == 5.0
    assert expected_committed(0.0, 4) == 1.0
    assert expected_committed(0.7, 0) == 1.0


def test_expected_committed_with_a_first_token_rate_apart():
    """(α1, α): 1 + α1·(1 + α + … + α^(k-1)); equal rates give the one-α formula."""
    assert expected_committed((0.5, 0.8), 3) == pytest.approx(1 + 0.5 * (1 + 0.8 + 0.64))
    assert expected_committed((0.2, 1.0), 4) == pytest.approx(1 + 0.2 * 4)
    assert expected_committed((0.0, 0.9), 6) == 1.0 and expected_committed((0.9, 0.3), 0) == 1.0
    for a in (0.0, 0.35, 0.9, 1.0):
        for k in range(7):
            assert expected_committed((a, a), k) == pytest.approx(expected_committed(a, k))




def _geometric_step(rng: random.Random, alpha: float, k: int) -> int:
    accepted = 0
    while accepted < k and rng.random() < alpha:
        accepted += 1
    return accepted


@pytest.mark.parametrize("true_alpha", [0.3, 0.7, 0.9])
def test_estimator_converges_on_bernoulli_stream(true_alpha):
    rng = random.Random(42)
    est = AcceptanceEstimator(prior_alpha=0.5)
    for step in range(3000):
        est.update(f"seq{step % 5}", "code", 4, _geometric_step(rng, true_alpha, 4))
    assert est.segment_estimate("code") == pytest.approx(true_alpha, abs=0.05)
    assert est.estimate("seq0", "code") == pytest.approx(true_alpha, abs=0.07)
    # Naive accepted / drafted would be biased low (e.g. 0.55 for α=0.7, K=4); we are not.
    # an untouched segment starts from this drafter's pooled α; an untouched pool from the prior
    assert est.segment_estimate("other") == pytest.approx(true_alpha, abs=0.05)
    assert est.segment_estimate("other|n3") == 0.5


def test_segments_pool_by_draft_context():
    """"chat|n1" and "code|n1" share the pool "n1", not "n4": a new segment's 1-token matches
    start from what 1-token matches achieve elsewhere."""
    rng = random.Random(3)
    est = AcceptanceEstimator(prior_alpha=0.6)
    for _ in range(400):
        est.update("a", "chat|n1", 2, _geometric_step(rng, 0.1, 2))
        est.update("b", "chat|n4", 4, _geometric_step(rng, 0.9, 4))
    assert est.segment_estimate("code|n1") < 0.2 < 0.8 < est.segment_estimate("code|n4")
    assert est.segment_estimate("code|n2") == 0.6


def test_estimator_tracks_change_and_blends_sequence_with_segment():
    rng = random.Random(7)
    est = AcceptanceEstimator(prior_alpha=0.5, decay=0.98)
    for _ in range(500):
        est.update("a", "summarize", 5, _geometric_step(rng, 0.85, 5))
    assert est.segment_estimate("summarize") > 0.75
    # A fresh sequence inherits its segment; it moves toward its own α as evidence grows.
    assert est.estimate("new", "summarize") == est.segment_estimate("summarize")
    for _ in range(300):
        est.update("b", "summarize", 5, _geometric_step(rng, 0.2, 5))
    assert est.estimate("b", "summarize") < 0.3
    assert est.estimate("a", "summarize") > 0.7  # sequence a keeps its own history
    est.release("b")
    assert est.estimate("b", "summarize") == est.segment_estimate("summarize")


def test_estimator_validation():
    est = AcceptanceEstimator()
    est.update("s", "x", 0, 0)  # a plain step carries no information
    assert est.seq_trials("s") == 0
    with pytest.raises(ValueError):
        est.update("s", "x", 3, 4)
    with pytest.raises(ValueError):
        AcceptanceEstimator(prior_alpha=1.5)


def test_counting_rule_literal_steps():
    """(K, accepted) steps -> acceptances and rejections: a fully accepted step rejects nothing,
    a partial one rejects once (the positions after the rejection were never tested)."""
    c, stats = AlphaCounts(), SpecStats()
    for k, a in ((4, 4), (4, 1), (2, 0), (3, 3)):
        c.add(1.0, k, a)
        stats.record(k, a)
    assert (c.accepted, c.rejected, c.drafted, c.trials) == (8, 2, 13, 10)
    assert c.alpha == 0.8 and stats.alpha == 0.8 and stats.rejections == 2
    assert stats.acceptance_rate == pytest.approx(8 / 13)  # the other quantity, kept apart
    assert AlphaCounts().alpha is None and SpecStats().alpha == 0.0
    with pytest.raises(ValueError):
        c.add(1.0, 2, 3)


@pytest.mark.parametrize("true_alpha", [0.3, 0.7, 0.9])
def test_alpha_is_unbiased_where_acceptance_rate_is_biased_low(true_alpha):
    """On steps drawn with a known per-position α, SpecStats.alpha recovers it; accepted /
    drafted does not (e.g. ~0.55 for α = 0.7, K = 4) — why nothing gates on it."""
    rng = random.Random(5)
    stats = SpecStats()
    for _ in range(4000):
        stats.record(4, _geometric_step(rng, true_alpha, 4))
    assert stats.alpha == pytest.approx(true_alpha, abs=0.02)
    assert stats.acceptance_rate < true_alpha - 0.05
    mean_accepted = stats.accepted_tokens / stats.drafts  # the formula in this α predicts it
    assert expected_committed(stats.alpha, 4) - 1 == pytest.approx(mean_accepted, rel=0.03)


def test_live_alpha_halves_an_observation_after_half_life_draft_tokens():
    live = LiveAlpha(half_life=8)
    live.observe("chat", 4, 4)
    live.observe("chat", 4, 0)
    c = live.get("chat")  # the first step now weighs 0.5 ** (4 / 8)
    w = 0.5 ** 0.5
    assert (c.accepted, c.rejected, c.drafted) == pytest.approx((4 * w, 1.0, 4 * w + 4))
    assert c.alpha == pytest.approx(4 * w / (4 * w + 1))
    for _ in range(40):  # the segment turns bad: the live α follows, the old steps fade
        live.observe("chat", 4, 0)
    assert live.get("chat").alpha < 0.01
    live.observe("chat", 0, 0)  # a plain step tests nothing
    assert live.get("code") is None and set(live.segments()) == {"chat"}
    with pytest.raises(ValueError):
        LiveAlpha(half_life=0)
