"""Adaptive K: the K decision with literal costs, the batch decision, online estimation of step
costs, and the exploration schedule (α's estimation: test_acceptance.py)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from cluster.speculative.acceptance import AcceptanceEstimator
from cluster.speculative.adaptive_k import AdaptiveK, StepCostModel, batch_rate, break_even_alpha, choose_k


@dataclass
class LinearCosts:
    """Fixed costs: c seconds per draft round, t(n) = a + b·n seconds per target forward."""

    draft_cost: float
    a: float
    b: float

    def target_time(self, num_tokens: int) -> float:
        return self.a + self.b * num_tokens


def test_high_alpha_cheap_draft_speculates_deep():
    # α=0.9, draft round 1 ms, target 20 ms nearly flat in batch tokens (memory bound).
    costs = LinearCosts(draft_cost=0.001, a=0.020, b=0.00005)
    # K=8: 6.13 tokens / 28.45 ms beats every smaller K; K=0: 1 token / 20.05 ms.
    assert choose_k(0.9, 8, costs) == 8
    # With a moderate α the best K is interior: α=0.7 peaks at K=5 (3.29 tokens / 25.3 ms).
    assert choose_k(0.7, 8, costs) == 5


def test_low_alpha_does_not_pay():
    # A draft model whose round costs 30% of a target forward: at α=0.3 nothing beats plain.
    costs = LinearCosts(draft_cost=0.006, a=0.020, b=0.00005)
    assert choose_k(0.3, 6, costs) == 0
    # Same costs, α=0.8: speculation pays.
    assert choose_k(0.8, 6, costs) >= 3


def test_compute_bound_verification_does_not_pay():
    # Verification not free: every token in the forward costs 5 ms on top of 1 ms.
    steep = LinearCosts(draft_cost=0.0, a=0.001, b=0.005)
    assert choose_k(0.8, 6, steep) == 0  # 1.8 tokens / 11 ms < 1 token / 6 ms
    # Large batch, batch-rate view: 63 other sequences commit 63 tokens in the same forward.
    steep_batch = LinearCosts(draft_cost=0.0, a=0.010, b=0.001)
    assert choose_k(0.8, 6, steep_batch, batch_tokens_other=63, other_committed=63.0) == 0
    # ...while the same costs at batch 1 still favour speculation.
    assert choose_k(0.8, 6, steep_batch) > 0


def _fixed_adaptive(costs: LinearCosts, alpha: float, **kw) -> AdaptiveK:
    """Adaptive K at these costs with every segment starting from ``alpha``; the exploration of
    new segments off unless asked for (``explore_min_trials``: its own tests)."""
    model = StepCostModel(draft_cost_prior=costs.draft_cost, target_a_prior=costs.a,
                          slope_prior_ratio=costs.b / costs.a)
    kw.setdefault("explore_min_trials", 0)
    return AdaptiveK(estimator=AcceptanceEstimator(prior_alpha=alpha), costs=model, **kw)


def test_batch_choice_goes_plain_for_large_compute_bound_batches():
    costs = LinearCosts(draft_cost=0.0005, a=0.010, b=0.001)
    ak = _fixed_adaptive(costs, 0.8, explore_every=1000)
    assert ak.choose([("s0", "code")], max_draft_tokens=6)[0] > 0
    big = [(f"s{i}", "code") for i in range(64)]
    assert ak.choose(big, max_draft_tokens=6) == [0] * 64


def test_batch_choice_counts_non_speculating_tokens_in_the_forward():
    # One speculating sequence alone would draft; the same sequence sharing a compute-bound
    # forward with 63 plain decoders (e.g. constrained requests: 63 tokens, 63 committed) goes
    # plain — its verification tokens would slow all of them down.
    costs = LinearCosts(draft_cost=0.0005, a=0.010, b=0.001)
    ak = _fixed_adaptive(costs, 0.8, explore_every=1000)
    assert ak.choose([("s", "code")], max_draft_tokens=6)[0] > 0
    assert ak.choose([("s", "code")], max_draft_tokens=6, extra_tokens=63, extra_committed=63.0) == [0]
    # A big prefill chunk committing one token does not make speculation worse: the step is
    # slow anyway and a drafted token costs only b more (batch-rate objective).
    assert ak.choose([("s", "code")], max_draft_tokens=6, extra_tokens=200, extra_committed=1.0)[0] > 0


def test_batch_choice_shares_the_draft_phase():
    # A draft round costs 10% of a forward: one sequence alone in a batch of 32 would not pay
    # for the whole batch's draft phase, but all drafting together pays (uniform start).
    costs = LinearCosts(draft_cost=0.002, a=0.020, b=0.00002)
    ak = _fixed_adaptive(costs, 0.8, explore_every=1000)
    seqs = [(f"s{i}", "chat") for i in range(32)]
    num_draft_tokens = ak.choose(seqs, max_draft_tokens=6)
    assert min(num_draft_tokens) >= 3
    assert batch_rate([0.8] * 32, num_draft_tokens, costs) > 1.5 * batch_rate([0.8] * 32, [0] * 32, costs)


def test_batch_choice_drops_low_alpha_sequences():
    costs = LinearCosts(draft_cost=0.0002, a=0.020, b=0.0002)
    est = AcceptanceEstimator(prior_alpha=0.8, seq_prior_weight=1.0)
    for _ in range(200):
        est.update("bad", "chat", 4, 0)  # the target rejects this sequence's first draft every time
        est.update("good", "chat", 4, 4)
        est.update("good2", "chat", 4, 3)
    ak = AdaptiveK(estimator=est, costs=StepCostModel(draft_cost_prior=0.0002, target_a_prior=0.020,
                                                      slope_prior_ratio=0.01), explore_every=1000)
    num_draft_tokens = ak.choose([("good", "chat"), ("bad", "chat"), ("good2", "chat")], max_draft_tokens=6)
    assert num_draft_tokens[1] == 0 and num_draft_tokens[0] > 0 and num_draft_tokens[2] > 0


def test_cost_model_priors_then_fit():
    m = StepCostModel(draft_cost_prior=0.004, target_a_prior=0.02, slope_prior_ratio=1 / 200)
    assert m.target_time(10) == pytest.approx(0.02 * (1 + 10 / 200))  # before data: the priors
    assert m.draft_cost == 0.004
    # Observations over a spread of batch sizes from t(n) = 5 ms + 0.5 ms * n.
    for rep in range(24):  # a realistic window: ~120 steps
        for n in (1, 8, 16, 32, 64):
            m.observe_target(n, 0.005 + 0.0005 * n)
    a, b = m.coefficients
    assert a == pytest.approx(0.005, rel=0.05)
    assert b == pytest.approx(0.0005, rel=0.05)
    assert m.target_time(100) == pytest.approx(0.055, rel=0.03)
    for _ in range(100):
        m.observe_draft(rounds=4, seconds=0.004)  # 1 ms per round
    assert m.draft_cost == pytest.approx(0.001, rel=0.05)


def test_cost_model_kept_up_to_date_forward_by_forward_equals_a_fit_of_its_window():
    """The window's sums and per-count medians are updated as forwards come and go; after each
    forward they equal a least-squares fit and medians computed from the last ``window``
    forwards from scratch (counts leave the window and come back)."""
    import random
    import statistics

    rng = random.Random(0)
    m = StepCostModel(window=24, min_points=3)
    wa, wb, rho = m.intercept_prior_weight, m.slope_prior_weight, m.slope_prior_ratio
    seen: list[tuple[int, float]] = []
    for step in range(1200):
        n = rng.choice([1, 1, 1, 2, 4, 7] if step < 600 else [1, 3, 3, 16])  # the mix changes halfway
        t = 0.01 + 0.001 * n + rng.random() * 0.002
        m.observe_target(n, t)
        seen.append((n, t))
        window = seen[-24:]
        s1 = len(window) + wa + wb * rho * rho
        sn = sum(k for k, _ in window) - wb * rho
        snn = sum(k * k for k, _ in window) + wb
        st = sum(x for _, x in window) + wa * m.target_a_prior
        snt = sum(k * x for k, x in window)
        det = s1 * snn - sn * sn
        a, b = (st * snn - sn * snt) / det, (s1 * snt - sn * st) / det
        if step % 7 == 0 or step > 1190:
            got_a, got_b = m.coefficients
            assert got_a == pytest.approx(max(a, 0.0), rel=1e-9, abs=1e-12)
            assert got_b == pytest.approx(max(b, 0.0), rel=1e-9, abs=1e-12)
            for k in {1, 2, 3, 4, 7, 16}:
                own = [x for c, x in window if c == k]
                if len(own) >= 3:  # the median prices t(k), never below a smaller count's price
                    assert m.target_time(k) >= statistics.median(own) - 1e-15
                    if k == 1:
                        assert m.target_time(1) == pytest.approx(statistics.median(own), rel=1e-12)


def test_cost_model_single_batch_size_keeps_prior_slope_ratio():
    m = StepCostModel(target_a_prior=0.02, slope_prior_ratio=1 / 100)
    for _ in range(50):
        m.observe_target(1, 0.008)  # only batch-1 decode measured: 8 ms, far from the 20 ms prior
    a, b = m.coefficients
    assert m.target_time(1) == pytest.approx(0.008, rel=0.01)
    assert b == pytest.approx(a / 100, rel=0.1)  # no slope information -> the prior ratio


def test_cost_model_window_forgets_old_regime():
    m = StepCostModel(window=10)
    for _ in range(10):
        m.observe_target(4, 0.050)
    for _ in range(10):
        m.observe_target(4, 0.010)
    assert m.target_time(4) == pytest.approx(0.010, rel=0.01)


def test_exploration_probes_plain_sequences_on_a_fixed_schedule():
    costs = LinearCosts(draft_cost=0.006, a=0.020, b=0.00005)
    ak = _fixed_adaptive(costs, 0.2, explore_every=5, explore_k=2)
    history = [ak.choose([("s", "chat")], max_draft_tokens=6)[0] for _ in range(15)]
    assert history == [0, 0, 0, 0, 2] * 3
    # Probes that show high acceptance lift α until speculation is chosen without probing.
    for _ in range(40):
        k = ak.choose([("s", "chat")], max_draft_tokens=6)[0]
        ak.observe("s", "chat", k, k)  # every draft token accepted
    assert ak.choose([("s", "chat")], max_draft_tokens=6)[0] > 2
    ak.release("s")


def test_max_draft_tokens_zero_means_plain():
    ak = _fixed_adaptive(LinearCosts(0.0, 0.02, 0.0), 0.9, explore_every=1)
    assert ak.choose([("a", "x"), ("b", "x")], max_draft_tokens=0) == [0, 0]
    assert choose_k(0.99, 0, LinearCosts(0.0, 0.02, 0.0)) == 0


def test_failed_probes_back_off_per_segment_and_success_resets():
    costs = LinearCosts(draft_cost=0.006, a=0.020, b=0.00005)
    ak = _fixed_adaptive(costs, 0.05, explore_every=4, explore_k=2, explore_max_every=16)
    probes = []
    for step in range(60):
        k = ak.choose([("s", "chat")], max_draft_tokens=6)[0]
        if k:
            probes.append(step)
            ak.observe("s", "chat", k, 0)  # the probe is rejected
    # intervals 4, 8, 16, 16: steps 3, 11, 27, 43, 59
    assert probes == [3, 11, 27, 43, 59]
    ak.release("s")
    # a new sequence of the same segment inherits the backed-off interval
    assert [ak.choose([("t", "chat")], max_draft_tokens=6)[0] for _ in range(16)] == [0] * 15 + [2]
    ak.observe("t", "chat", 2, 1)  # a probe that commits one of its draft tokens resets the interval
    assert ak.probe_interval("chat") == 4
    assert [ak.choose([("t", "chat")], max_draft_tokens=6)[0] for _ in range(4)][-1] >= 1


def test_draft_cost_ratio_prior_scales_with_the_measured_decode_step():
    m = StepCostModel(draft_cost_ratio_prior=0.25, target_a_prior=0.02)
    for _ in range(5):
        m.observe_target(1, 0.060)  # this machine's decode step
    assert m.draft_cost == pytest.approx(0.25 * m.target_time(1))
    assert m.target_time(1) == pytest.approx(0.060, rel=0.01)
    m.observe_draft(3, 0.030)  # the first timed draft replaces the prior
    assert m.draft_cost == pytest.approx(0.010)
    assert StepCostModel(draft_cost_ratio_prior=0.0).draft_cost == 0.0


def test_break_even_alpha_is_where_speculation_starts_to_pay():
    """Free drafts, t(n) = a + b·n: K = 1 pays when (1 + α)·(1 - g) > (a + 2b)/(a + b), g the
    min_gain margin; the break-even is that α, and dearer verification or drafts raise it."""
    cheap = LinearCosts(draft_cost=0.0, a=0.030, b=0.0005)
    be = break_even_alpha(cheap, max_draft_tokens=8, min_gain=0.0)
    assert be == pytest.approx((0.030 + 0.001) / (0.030 + 0.0005) - 1, abs=2e-3)
    assert choose_k(be + 0.01, 8, cheap, min_gain=0.0) > 0 and choose_k(be - 0.01, 8, cheap, min_gain=0.0) == 0
    dear_verify = LinearCosts(draft_cost=0.0, a=0.030, b=0.010)
    dear_draft = LinearCosts(draft_cost=0.010, a=0.030, b=0.0005)
    assert break_even_alpha(dear_verify, 8) > break_even_alpha(cheap, 8) + 0.2
    assert break_even_alpha(dear_draft, 8) > break_even_alpha(cheap, 8) + 0.2
    assert break_even_alpha(LinearCosts(draft_cost=1.0, a=0.03, b=0.0005), 8) == 1.0  # nothing pays
    assert break_even_alpha(cheap, 0) == 1.0
    assert AdaptiveK(costs=StepCostModel()).break_even_alpha(4) < 1.0


def test_a_new_segment_inherits_the_pools_backed_off_probe_interval():
    costs = LinearCosts(draft_cost=0.006, a=0.020, b=0.00005)
    ak = _fixed_adaptive(costs, 0.05, explore_every=4, explore_k=2, explore_max_every=16)
    for _ in range(40):
        k = ak.choose([("s", "code")], max_draft_tokens=6)[0]
        if k:
            ak.observe("s", "code", k, 0)
    assert ak.probe_interval("code") == 16 and ak.probe_interval("chat") == 16
    assert ak.probe_interval("chat|n1") == 4  # another pool: its own start
    first = [ak.choose([("t", "chat")], max_draft_tokens=6)[0] for _ in range(16)]
    assert first == [0] * 15 + [2]


def test_each_named_drafter_has_its_own_round_cost():
    """A portfolio's members are timed apart: an EAGLE head's rounds do not make n-gram drafts
    look dear, nor n-gram's make the head look free; the engine-wide cost stays its own."""
    m = StepCostModel(draft_cost_ratio_prior=0.0, draft_cost_ratio_priors={"ngram": 0.0, "eagle": 0.1},
                      target_a_prior=0.02)
    for _ in range(5):
        m.observe_target(1, 0.020)
    assert m.draft_cost_of("eagle") == pytest.approx(0.1 * m.target_time(1))  # prior until timed
    m.observe_draft(3, 0.006, "eagle")  # 2 ms per round
    m.observe_draft(3, 0.006)  # the propose call as a whole
    assert m.draft_cost_of("eagle") == pytest.approx(0.002)
    assert m.draft_cost_of("ngram") == 0.0  # never timed: its prior
    assert m.draft_cost_of("other") == m.draft_cost == pytest.approx(0.002)  # unknown: the engine-wide cost
    assert m.to_dict()["draft_cost_s_by_drafter"] == {"eagle": pytest.approx(0.002), "ngram": 0.0}
    with pytest.raises(ValueError):
        StepCostModel(draft_cost_ratio_priors={"x": -1.0})


@dataclass
class PerDrafterCosts(LinearCosts):
    by_drafter: dict | None = None

    catch_up: dict | None = None  # drafter -> seconds per position it catches up on

    def draft_cost_of(self, drafter: str) -> float:
        return (self.by_drafter or {}).get(drafter, self.draft_cost)

    def catch_up_cost_of(self, drafter: str) -> float:
        return (self.catch_up or {}).get(drafter, 0.0)


def test_k_is_planned_at_each_sequences_own_drafter_cost():
    # same α, same batch: the free drafter's sequence drafts deeper than the dear one's, and the
    # dear rounds are charged once per drafter (the draft phase runs each drafter's rounds)
    costs = PerDrafterCosts(draft_cost=0.0, a=0.020, b=0.0001, by_drafter={"ngram": 0.0, "eagle": 0.001})
    ak = AdaptiveK(costs=costs)
    for sid in ("a", "b"):
        for _ in range(40):
            ak.observe(sid, "chat", 4, 2)  # α ≈ 0.67 for both
    k_ngram, k_eagle = ak.choose([("a", "chat"), ("b", "chat")], 6, drafters=["ngram", "eagle"])
    assert k_ngram > k_eagle >= 1
    # the rounds of two drafters add up; one drafter's rounds overlap
    mixed = batch_rate([0.7, 0.7], [3, 3], costs, drafters=["ngram", "eagle"])
    both_eagle = batch_rate([0.7, 0.7], [3, 3], costs, drafters=["eagle", "eagle"])
    assert mixed > both_eagle * 0.99 and batch_rate([0.7], [3], costs, drafters=["eagle"]) < batch_rate(
        [0.7], [3], costs, drafters=["ngram"])
    # no drafters given: one drafter at the engine-wide cost, as before
    assert ak.choose([("a", "chat")], 6) == [choose_k(ak.estimator.estimate("a", "chat"), 6, costs)]


def test_verification_overhead_is_charged_to_steps_that_draft():
    """Rejection sampling costs more than a plain step's sampling: measured, the difference is
    charged once to any step that drafts, so a barely-accepted 1-token draft stays plain."""
    m = StepCostModel(draft_cost_ratio_prior=0.0, target_a_prior=0.012)
    for _ in range(20):
        m.observe_target(1, 0.012)
        m.observe_target(2, 0.0126)
    assert m.verify_overhead == 0.0  # nothing measured yet
    m.observe_sampling(False, 0.0003)
    assert m.verify_overhead == 0.0  # one side only
    m.observe_sampling(True, 0.0009)
    assert m.verify_overhead == pytest.approx(0.0006)
    assert m.to_dict()["verify_overhead_s"] == pytest.approx(0.0006)
    free = StepCostModel(draft_cost_ratio_prior=0.0, target_a_prior=0.012)
    for _ in range(20):
        free.observe_target(1, 0.012)
        free.observe_target(2, 0.0126)
    # 0.6 ms more per drafting step (5% of a decode step): speculation starts to pay ~0.05 higher in α
    be_free, be = break_even_alpha(free, 4), break_even_alpha(m, 4)
    assert be > be_free + 0.04
    assert choose_k(be_free + 0.01, 4, free) >= 1 and choose_k(be_free + 0.01, 4, m) == 0
    assert batch_rate([0.17], [1], m) < batch_rate([0.17], [1], free)
    assert batch_rate([0.17], [0], m) == batch_rate([0.17], [0], free)  # a plain step pays none


def test_one_slow_draft_round_does_not_price_a_drafter_out():
    """A head's first catch-up over a long prompt can take 10x a round: clipped to 3x the
    estimate so far (its prior before data), it cannot price the head out of being chosen — and
    so out of the measurements that would bring its cost back."""
    m = StepCostModel(draft_cost_ratio_prior=0.0, draft_cost_ratio_priors={"eagle": 0.08}, target_a_prior=0.0125)
    for _ in range(10):
        m.observe_target(1, 0.0125)
    prior = m.draft_cost_of("eagle")
    assert prior == pytest.approx(0.001, rel=0.05)
    m.observe_draft(1, 0.020, "eagle")  # a 20 ms first round
    assert m.draft_cost_of("eagle") == pytest.approx(3 * prior)
    for _ in range(10):
        m.observe_draft(2, 0.002, "eagle")  # 1 ms rounds
    assert m.draft_cost_of("eagle") < 1.4 * prior


def test_a_drafters_catch_up_is_priced_apart_from_its_rounds():
    """A head's propose after a long gap first runs the positions it missed (5-30 ms where a round
    takes 1.5): the cost per caught-up position is learnt apart, so the round cost the head is
    planned at everywhere stays a round's — averaged in, a copy-heavy segment's probes priced
    it 15-30% dearer on the next segment."""
    def model():
        m = StepCostModel(draft_cost_ratio_prior=0.0, draft_cost_ratio_priors={"eagle": 0.08},
                          target_a_prior=0.0125)
        for _ in range(10):
            m.observe_target(1, 0.0125)
        for _ in range(5):
            m.observe_draft(2, 0.002, "eagle", catch_up=3)  # 1 ms rounds, a few positions each
        return m

    apart, averaged = model(), model()
    assert apart.catch_up_cost_of("eagle") == 0.0  # under min_positions: not told apart yet
    for _ in range(20):  # a 1-round probe after 300 positions: 1 ms + 300 x 25 µs
        apart.observe_draft(1, 0.0085, "eagle", catch_up=300)
        averaged.observe_draft(1, 0.0085, "eagle")  # the catch-up not told: all of it is the round's
    assert apart.catch_up_cost_of("eagle") == pytest.approx(25e-6, rel=0.1)
    assert apart.draft_cost_of("eagle") == pytest.approx(0.001, rel=0.15)
    assert averaged.draft_cost_of("eagle") > 2.5 * apart.draft_cost_of("eagle")
    assert averaged.catch_up_cost_of("eagle") == 0.0
    assert apart.to_dict()["catch_up_s_per_position_by_drafter"]["eagle"] == pytest.approx(25e-6, rel=0.1)
    assert apart.catch_up_cost_of("never-timed") == 0.0


def test_the_engines_own_drafters_catch_up_is_priced_apart_too():
    """One EAGLE head as the engine's drafter (not a portfolio member): its catch-up is told
    apart from its rounds the same way, so the round cost adaptive K plans every K with stays a
    round's — averaged in, probes after plain stretches priced it several times dearer."""
    def model():
        m = StepCostModel(draft_cost_ratio_prior=0.08, target_a_prior=0.0125)
        for _ in range(10):
            m.observe_target(1, 0.0125)
        for _ in range(5):
            m.observe_draft(2, 0.002, catch_up=3)  # 1 ms rounds, a few positions each
        return m

    apart, averaged = model(), model()
    assert apart.catch_up_cost_of("") == 0.0 and "catch_up_s_per_position" not in apart.to_dict()
    for _ in range(20):  # a 2-round probe after 300 positions: 2 ms + 300 x 25 µs
        apart.observe_draft(2, 0.0095, catch_up=300)
        averaged.observe_draft(2, 0.0095)
    assert apart.catch_up_cost_of("") == pytest.approx(25e-6, rel=0.1)
    assert apart.draft_cost == pytest.approx(0.001, rel=0.15)
    assert averaged.draft_cost > 2.5 * apart.draft_cost
    assert apart.to_dict()["catch_up_s_per_position"] == pytest.approx(25e-6, rel=0.1)


def test_a_probe_waits_until_its_catch_up_is_cheap():
    """A sequence whose drafter would first catch up on many positions is probed no sooner than
    that catch-up costs ``probe_budget`` of the plain steps before it: 600 positions at 25 µs =
    15 ms = 2% of 37.5 steps of 20 ms -> the 38th plain step; with nothing to catch up (or the
    catch-up unmeasured) the schedule stays ``explore_every``."""
    costs = LinearCosts(draft_cost=0.006, a=0.020, b=0.0)
    ak = _fixed_adaptive(costs, 0.05, explore_every=5, explore_k=2, probe_budget=0.02)
    for _ in range(10):
        ak.costs.observe_target(1, 0.020)
    history = [ak.choose([("s", "chat")], 6, behind=[600])[0] for _ in range(10)]
    assert history == [0, 0, 0, 0, 2] * 2  # g unmeasured: nothing to price yet
    ak.costs.observe_draft(2, 2 * 0.006 + 600 * 25e-6, catch_up=600)
    assert ak.costs.catch_up_cost_of("") == pytest.approx(25e-6)
    waits = [ak.choose([("t", "chat")], 6, behind=[600])[0] for _ in range(38)]
    assert waits == [0] * 37 + [2]
    assert [ak.choose([("u", "chat")], 6, behind=[1])[0] for _ in range(5)] == [0, 0, 0, 0, 2]
    with pytest.raises(ValueError, match="probe_budget"):
        AdaptiveK(probe_budget=0.0)


def test_a_new_segment_inherits_at_most_explore_inherit_max():
    """A drafter hopeless on one segment backs off to ``explore_max_every`` there; a new segment
    of the same pool starts from that, capped (a chat answer is shorter than 256 steps: the head
    would never be tried on chat again)."""
    costs = LinearCosts(draft_cost=0.006, a=0.020, b=0.00005)
    ak = _fixed_adaptive(costs, 0.05, explore_every=4, explore_k=2, explore_max_every=256, explore_inherit_max=32)
    for _ in range(600):
        k = ak.choose([("s", "multilingual")], max_draft_tokens=6)[0]
        if k:
            ak.observe("s", "multilingual", k, 0)
    assert ak.probe_interval("multilingual") == 256 and ak.probe_interval("chat") == 32


def test_a_token_count_seen_often_is_priced_by_its_own_median_never_below_fewer_tokens():
    """1-token forwards take the matrix-vector path (12 ms here), 3-token ones 16 ms: one line
    through both put t(1) too high and t(3) too low; each count seen ``min_points`` times is
    priced by its own median, others by the line, and no count is priced below t(1) or a median
    at a smaller count (noise must not make α = 0 pay)."""
    m = StepCostModel(target_a_prior=0.012, min_points=3)
    for _ in range(10):
        m.observe_target(1, 0.012)
        m.observe_target(3, 0.016)
    m.observe_target(5, 0.017)  # seen once: the line prices 5
    a, b = m.coefficients
    assert m.target_time(1) == pytest.approx(0.012) and m.target_time(3) == pytest.approx(0.016)
    assert m.target_time(5) == pytest.approx(max(a + 5 * b, 0.016))
    noisy = StepCostModel(target_a_prior=0.012, min_points=3, draft_cost_prior=0.0)
    for t1, t2 in ((0.013, 0.011), (0.014, 0.0115), (0.013, 0.0112)):  # 2 tokens "cheaper" than 1
        noisy.observe_target(1, t1)
        noisy.observe_target(2, t2)
    assert noisy.target_time(2) >= noisy.target_time(1) == pytest.approx(0.013)
    assert break_even_alpha(noisy, 4) > 0.0


def test_a_drafter_may_hand_its_own_rates_for_a_sequence():
    """``choose(alphas=...)``: a sequence's given (α1, α) replace the estimator's (a portfolio's
    rates for the member it chose); None keeps the estimator's."""
    costs = LinearCosts(draft_cost=0.0005, a=0.020, b=0.0002)
    ak = AdaptiveK(estimator=AcceptanceEstimator(prior_alpha=0.02), costs=costs, explore_min_trials=0)
    seqs = [("a", "chat"), ("b", "chat")]
    assert ak.choose(seqs, 6) == [0, 0]  # the estimator: hopeless (no probe due yet)
    ks = ak.choose(seqs, 6, alphas=[(0.9, 0.9), None])
    assert ks[0] == choose_k((0.9, 0.9), 6, costs, batch_tokens_other=1) > 0 and ks[1] == 0
    # a weak first token with sure later ones is planned long; a sure first token with weak later ones short
    assert choose_k((0.5, 0.95), 6, costs) > choose_k((0.95, 0.2), 6, costs) > 0


def test_a_new_segment_is_explored_at_once_then_parked_on_its_own_evidence():
    """A segment without ``explore_min_trials`` tested positions of its own probes its parked
    sequences with one draft token at once (no interval, no catch-up wait), as many per step as
    positions are missing: a pool that looks hopeless elsewhere (and an inherited interval longer than the
    segment's answers) must not keep a segment where the drafter pays from ever being measured."""
    costs = LinearCosts(draft_cost=0.006, a=0.020, b=0.00005)
    ak = _fixed_adaptive(costs, 0.05, explore_every=4, explore_k=2, explore_max_every=64,
                         explore_inherit_max=64, explore_min_trials=4)
    for _ in range(300):  # the drafter is hopeless on multilingual: its probes back off to 64
        k = ak.choose([("m", "multilingual")], 6)[0]
        if k:
            ak.observe("m", "multilingual", k, 0)
    assert ak.probe_interval("json") == 64
    assert ak.choose([("m", "multilingual")], 6) == [0]  # explored: parked by its interval
    for _ in range(10):  # catch-up measured: 600 positions cost 15 ms, a wait of 38 plain steps
        ak.costs.observe_target(1, 0.020)
    ak.costs.observe_draft(2, 2 * 0.006 + 600 * 25e-6, catch_up=600)
    # json: five new sequences at once; four positions missing -> four probes this step
    seqs = [(f"j{i}", "json") for i in range(5)]
    assert ak.choose(seqs, 6, behind=[600] * 5) == [1, 1, 1, 1, 0]
    for i in range(4):
        ak.observe(f"j{i}", "json", 1, 1)  # the head pays on json
    assert ak.estimator.segment_trials("json") == pytest.approx(4, rel=0.05)
    assert ak.probe_interval("json") == 4  # probes that committed reset the interval
    ks = ak.choose(seqs, 6, behind=[600] * 5)
    assert all(k > 0 for k in ks[:4])  # its own evidence now drafts them without probing
    # an explored hopeless segment is parked by its interval and catch-up wait again
    assert ak.choose([("m2", "multilingual")], 6, behind=[600]) == [0]
    with pytest.raises(ValueError, match="explore_min_trials"):
        AdaptiveK(explore_min_trials=-1)


def test_exploration_leaves_sequences_planned_with_their_drafters_own_rates_alone():
    costs = LinearCosts(draft_cost=0.0005, a=0.020, b=0.0002)
    ak = AdaptiveK(estimator=AcceptanceEstimator(prior_alpha=0.02), costs=costs, explore_min_trials=8)
    assert ak.choose([("a", "chat"), ("b", "chat")], 6, alphas=[(0.02, 0.02), None]) == [0, 1]


def test_one_slow_forward_does_not_move_a_token_counts_price_and_old_ones_expire():
    """A count's price is the median of the window's forwards of that count: one forward slowed
    by the machine among a parked drafter's few probes does not move it (a mean moved the
    break-even α by ~0.15); forwards pushed out of the window by a plain stretch no longer price
    it (a price kept from a noisy minute parked the drafter for good: parked, it made no new
    2-token forwards to correct it) — the line does, fitted to what the window holds."""
    m = StepCostModel(target_a_prior=0.03, window=32, min_points=3, draft_cost_prior=0.0)
    for _ in range(20):
        m.observe_target(1, 0.030)
    for _ in range(3):
        m.observe_target(2, 0.034)
    before = break_even_alpha(m, 4)
    assert m.target_time(2) == pytest.approx(0.034)
    m.observe_target(2, 0.060)  # one slow forward
    assert m.target_time(2) == pytest.approx(0.034) and break_even_alpha(m, 4) == pytest.approx(before, abs=0.01)
    for _ in range(4):
        m.observe_target(2, 0.080)  # a noisy minute
    assert m.target_time(2) > 0.05
    for _ in range(32):  # parked: plain steps only
        m.observe_target(1, 0.030)
    a, b = m.coefficients
    assert m.target_time(2) == pytest.approx(max(a + 2 * b, 0.030)) and m.target_time(2) < 0.034
