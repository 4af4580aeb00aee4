"""Drafter portfolio: the member expected to commit most per cost drafts, acceptance is learnt
from the tokens committed after each draft (chosen and shadow drafts alike, geometric: a
censored draft counts no rejection), a costly member drafts only when chosen and its q travels
unchanged, ragged batches with K = 0 rows, per-member stats, release reaches every member;
routed by segment, each sequence drafts with its segment's member only.
Lossless output on engines: tests/engine/test_speculation.py (greedy vs HF) and test_suffix.py (sampling)."""
from __future__ import annotations

import pytest
import torch

from cluster.common.request import SamplingParams
from cluster.speculative.portfolio import Member, PortfolioProposer, SegmentRoutes, default_portfolio
from cluster.speculative.proposer import DrafterKind
from cluster.speculative.types import DraftProposal, ProposeInput

GREEDY = SamplingParams(max_tokens=8)


class Fixed:
    """A member that drafts a fixed continuation (None: nothing to draft)."""

    kind = DrafterKind.NGRAM

    def __init__(self, draft, context="c", probs=None):
        self.draft, self.context, self.probs = draft, context, probs
        self.asked: list[str] = []
        self.released: list[str] = []

    def draft_context(self, seq_id, token_ids, segment="", draft_scope=""):
        return self.context if self.draft else None

    def propose(self, inputs):
        self.asked += [i.seq_id for i in inputs]
        return DraftProposal([list(self.draft or [])[: i.num_draft_tokens] for i in inputs],
                             [self.probs for _ in inputs])

    def release(self, seq_id):
        self.released.append(seq_id)


def inp(seq_id, tokens, k=3):
    return ProposeInput(seq_id, list(tokens), k, GREEDY, segment="s")


def test_the_member_whose_drafts_are_accepted_takes_over():
    good, bad = Fixed([1, 2, 3], "g"), Fixed([9, 9, 9], "b")
    pf = PortfolioProposer([Member("bad", bad), Member("good", good)])
    history, chosen = [0], []
    for _ in range(4):
        pf.propose([inp("a", history)])
        chosen.append(pf.last_choice["a"])
        history = history + [1, 2]  # what the target commits each step, whoever drafted
    # both start at the prior (tie: the earlier member); "bad" is rejected at its first token in
    # every comparison (shadow or real), "good" never within the committed tokens
    # first tokens: good 3 of 3 (+ the prior's 1 of 2: 0.8), bad 0 of 3 (0.2); good's second
    # token was accepted every time, its third never compared (censored)
    # (two cheap members whose drafts start differently: each context is tagged "+differ")
    assert pf.alpha("good", "g+differ") == pytest.approx(4 / 5) and pf.alpha("bad", "b+differ") == pytest.approx(1 / 5)
    assert pf.alpha("good", "g+differ", later=True) == pytest.approx(4 / 5)
    assert chosen == ["bad", "good", "good", "good"]
    # accepted: what the next call's committed tokens showed (the last draft awaits its verdict)
    assert pf.drafter_stats() == {"bad": {"steps": 1, "draft_tokens": 3, "accepted_tokens": 0},
                                  "good": {"steps": 3, "draft_tokens": 9, "accepted_tokens": 4}}


def test_learning_counts_accepted_prefix_and_one_rejection_censored_beyond_committed():
    a = Fixed([5, 6, 7, 8], "x")
    pf = PortfolioProposer([Member("a", a)], prior_weight=1e-9)
    pf.propose([inp("s1", [1, 2], k=4)])
    pf.propose([inp("s1", [1, 2, 5, 6, 9], k=4)])  # 5, 6 accepted, 9 recovered: one rejection
    # the first token accepted; after it one more accepted and one rejection
    assert pf.alpha("a", "x") == pytest.approx(1.0) and pf.alpha("a", "x", later=True) == pytest.approx(1 / 2)
    assert pf.drafter_stats()["a"] == {"steps": 2, "draft_tokens": 8, "accepted_tokens": 2}
    pf.propose([inp("s1", [1, 2, 5, 6, 9, 5], k=4)])  # one plain token that matched: censored after it
    assert pf.alpha("a", "x") == pytest.approx(1.0) and pf.alpha("a", "x", later=True) == pytest.approx(1 / 2)
    pf.propose([inp("s1", [1, 2, 5, 6, 9, 5, 0], k=4)])  # the first token rejected
    assert pf.alpha("a", "x") == pytest.approx(2 / 3) and pf.alpha("a", "x", later=True) == pytest.approx(1 / 2)
    # E(k) = 1 + α1·(1 + α + … + α^(k-1)): 2/3 · (1 + 1/2) more tokens at k = 2
    assert pf.expected_per_cost(pf.members[0], 2, 2 / 3, 1 / 2) == pytest.approx(2.0 / (1 + 2 * pf.verify_slope))


def test_no_candidate_no_draft_and_k_zero_rows_in_a_ragged_batch():
    pf = PortfolioProposer([Member("none", Fixed(None)), Member("some", Fixed([4, 4, 4, 4]))])
    got = pf.propose([inp("a", [1], k=2), inp("b", [1], k=0), inp("c", [1], k=4)])
    assert got.draft_token_ids == [[4, 4], [], [4, 4, 4, 4]] and got.draft_probs == [None] * 3
    assert pf.draft_context("a", [1]) == "some:c+alone"  # the other cheap member has no draft
    empty = PortfolioProposer([Member("none", Fixed(None))])
    assert empty.draft_context("a", [1]) is None
    assert empty.propose([inp("a", [1])]).draft_token_ids == [[]]


def test_a_costly_member_drafts_only_when_chosen_and_its_q_travels():
    q = torch.full((3, 10), 0.1)
    model = Fixed([7, 7, 7], "m", probs=q)
    cheap = Fixed([3], "n")
    pf = PortfolioProposer([Member("cheap", cheap), Member("model", model, cost=0.05)], horizon=3, verify_slope=0.0)
    got = pf.propose([inp("a", [1, 2], k=3)])
    # prior α 0.5: 3 model tokens (1.875 committed per 1.15 steps) beat 1 cheap one (1.5 per 1)
    assert pf.last_choice == {"a": "model"} and model.asked == ["a"]
    assert got.draft_token_ids == [[7, 7, 7]] and torch.equal(got.draft_probs[0], q)
    assert cheap.asked == ["a"]  # cost-0 members draft in the shadow to be measured
    expensive = PortfolioProposer([Member("cheap", Fixed([3], "n")), Member("model", Fixed([7, 7, 7], "m"), cost=1.0)],
                                  horizon=3, verify_slope=0.0)
    expensive.propose([inp("a", [1, 2], k=3)])
    assert expensive.last_choice == {"a": "cheap"}
    assert expensive.members[1].proposer.asked == []


def test_release_reaches_every_member_and_forgets_the_sequence():
    a, b = Fixed([1]), Fixed([2])
    pf = PortfolioProposer([Member("a", a), Member("b", b)])
    pf.propose([inp("x", [0])])
    pf.release("x")
    assert a.released == ["x"] and b.released == ["x"] and not pf._pending and not pf.last_choice


def test_default_portfolio_uses_suffix_after_the_segment_taught_it():
    pf = default_portfolio()
    assert [m.name for m in pf.members] == ["ngram", "suffix"] and pf.kind is DrafterKind.PORTFOLIO
    answer = [40, 41, 42, 43, 44, 45]
    for i in range(3):  # the same templated answer, three times: the suffix index learns it
        pf.propose([inp(f"r{i}", [9, 8, 7] + answer)])
        pf.release(f"r{i}")
    got = pf.propose([inp("new", [1, 2, 3, 40, 41], k=4)])
    assert got.draft_token_ids == [[42, 43, 44, 45]] and pf.last_choice["new"] == "suffix"


def test_the_suffix_member_drafts_within_the_sequences_draft_scope():
    pf = default_portfolio()
    answer = [40, 41, 42, 43, 44, 45]
    for i in range(3):  # tenant t1's templated answer, three times
        pf.propose([ProposeInput(f"r{i}", [9, 8, 7] + answer, 3, GREEDY, segment="s", draft_scope="t1")])
        pf.release(f"r{i}")
    asks = {scope: ProposeInput(f"new-{scope}", [1, 2, 3, 40, 41], 4, GREEDY, segment="s", draft_scope=scope)
            for scope in ("t1", "t2", "")}
    got = pf.propose(list(asks.values()))
    assert got.draft_token_ids == [[42, 43, 44, 45], [], []]  # another tenant, the shared scope: nothing
    assert pf.last_choice["new-t1"] == "suffix" and pf.draft_context("new-t2", [1, 2, 3, 40, 41], "s", "t2") is None


def test_bad_portfolios_are_refused():
    with pytest.raises(ValueError):
        PortfolioProposer([])
    with pytest.raises(ValueError):
        PortfolioProposer([Member("a", Fixed([1])), Member("a", Fixed([2]))])


def test_routed_by_segment_each_sequence_drafts_with_its_segments_member_only():
    bad, good = Fixed([9, 9, 9], "b"), Fixed([1, 2, 3], "g", probs=None)
    q = torch.full((3, 10), 0.1)
    model = Fixed([7, 7, 7], "m", probs=q)
    pf = PortfolioProposer([Member("ngram", bad), Member("suffix", good), Member("draft", model, cost=0.5)],
                           routes=SegmentRoutes("ngram", {"code": "suffix", "chat": "draft"}), horizon=3)
    rows = [ProposeInput("a", [0], 3, GREEDY, segment="code"), ProposeInput("b", [0], 2, GREEDY, segment="chat"),
            ProposeInput("c", [0], 3, GREEDY, segment="other")]
    got = pf.propose(rows)
    # no choice by value: "bad" (the default) drafts for "other" though "suffix" would commit more
    assert pf.last_choice == {"a": "suffix", "b": "draft", "c": "ngram"}
    assert got.draft_token_ids == [[1, 2, 3], [7, 7], [9, 9, 9]]
    assert got.draft_probs[0] is None and torch.equal(got.draft_probs[1], q[:2])
    assert (bad.asked, good.asked, model.asked) == (["c"], ["a"], ["b"])  # no shadow drafts across segments
    assert pf.draft_context("a", [0], "code") == "suffix:g"
    nothing = PortfolioProposer([Member("ngram", Fixed(None)), Member("suffix", good)],
                                routes=SegmentRoutes("ngram", {"code": "suffix"}))
    assert nothing.propose([ProposeInput("x", [0], 3, GREEDY, segment="other")]).draft_token_ids == [[]]
    with pytest.raises(ValueError, match="not members"):
        PortfolioProposer([Member("ngram", bad)], routes=SegmentRoutes("ngram", {"code": "suffix"}))


class Costly(Fixed):
    kind = DrafterKind.EAGLE

    def draft_context(self, seq_id, token_ids, segment="", draft_scope=""):
        return self.context


def test_a_costly_member_is_valued_at_its_best_k_not_the_horizon():
    """α 0.45 at 0.1 decode steps per round: 1.45 tokens for 1.15 steps at k = 1 pays; at the
    horizon (6) it would not (1.81 tokens for 1.9 steps): the member is chosen, and planned at k ≤ 2."""
    head = Costly([5, 6, 7, 8, 9, 10], "h")
    pf = PortfolioProposer([Member("head", head, cost=0.1)], horizon=6, prior_alpha=0.45)
    m = pf.members[0]
    assert pf.expected_per_cost(m, 6, 0.45) < 1.0 < pf.expected_per_cost(m, 1, 0.45)
    assert pf.value(m, 6, 0.45) == max(pf.expected_per_cost(m, k, 0.45) for k in range(1, 7))
    assert pf.draft_context("a", [0, 1]) == "head:h"


def test_with_the_engines_costs_members_are_valued_and_timed_apart():
    from tests.speculative.test_adaptive_k import PerDrafterCosts

    cheap, head = Fixed([1, 2, 3], "n1"), Costly([1, 2, 3], "h")
    pf = PortfolioProposer([Member("ngram", cheap), Member("head", head, cost=0.1)], prior_alpha=0.6)
    costs = PerDrafterCosts(draft_cost=0.0, a=0.020, b=0.0001, by_drafter={"ngram": 0.0, "head": 0.015})
    pf.use_costs(costs)
    # same α: the free member wins; with the head at 3/4 of a decode step per round it does not beat plain
    assert pf.draft_context("a", [0]) == "ngram:n1"
    assert pf.value(pf.members[1], 6, 0.6) < 1.0 < pf.value(pf.members[0], 3, 0.6)
    # the engine's measured cost is what counts: a cheap head beats a 1-token n-gram draft
    costs.by_drafter["head"] = 0.0005
    pf2 = PortfolioProposer([Member("ngram", Fixed([1], "n1")), Member("head", Costly([1, 2, 3], "h"), cost=0.1)],
                            prior_alpha=0.6)
    pf2.use_costs(costs)
    pf2.propose([inp("a", [0], k=3)])
    assert pf2.last_choice == {"a": "head"}
    rounds, seconds, caught_up = pf2.last_member_rounds["head"]
    assert rounds == 3 and seconds >= 0.0 and set(pf2.last_member_rounds) == {"head"}  # cost-0 members are not timed
    assert caught_up == 0  # a 1-token sequence: nothing to run before drafting
    assert pf2.member_of("head:h") == "head" and pf2.member_cost_priors() == {"ngram": 0.0, "head": 0.1}
    # a head that stops short of K (its confidence floor) ran only the rounds of its longest draft
    pf3 = PortfolioProposer([Member("head", Costly([1, 2], "h"), cost=0.1)], prior_alpha=0.6)
    pf3.use_costs(costs)
    pf3.propose([inp("a", [0], k=3)])
    assert pf3.last_member_rounds["head"][0] == 2


def test_a_costly_members_catch_up_is_charged_to_its_choice_and_reported():
    """A head first runs the positions committed since it last drafted for the sequence (all but
    the last token on its first draft). Its choice is charged that catch-up — shared over
    ``catch_up_steps`` drafts — so it does not draft for a long sequence it has not followed at a
    rate that pays only once caught up; the positions are reported with its timing (the cost
    model learns them apart from its rounds), and once it drafted, only the new ones count."""
    from tests.speculative.test_adaptive_k import PerDrafterCosts

    costs = PerDrafterCosts(draft_cost=0.0, a=0.015, b=0.0002, by_drafter={"head": 0.001},
                            catch_up={"head": 25e-6})
    def portfolio():
        pf = PortfolioProposer([Member("head", Costly([5, 6, 7], "h"), cost=0.08)], prior_alpha=0.35,
                               catch_up_steps=2)
        pf.use_costs(costs)
        return pf

    pf = portfolio()
    head = pf.members[0]
    # α 0.35: 1.35 tokens for ~1.09 plain steps pays; +600 positions (15 ms, half of it charged) does not
    assert pf.value(head, 6, 0.35) > 1.2 > 1.0 > pf.value(head, 6, 0.35, catch_up=600)
    assert pf.value(head, 6, 0.35, catch_up=10) > 1.2  # a few positions cost next to nothing
    short, long = list(range(20)), list(range(601))
    assert pf.draft_context("s", short) == "head:h" and pf.draft_context("l", long) is None
    pf.propose([inp("s", short, k=2)])
    assert pf.last_member_rounds["head"][0] == 2 and pf.last_member_rounds["head"][2] == 19
    pf.propose([inp("s", short + [5, 6, 1], k=2)])  # three committed since its draft: only those
    assert pf.last_member_rounds["head"][2] == 3
    pf.release("s")
    pf.propose([inp("s", short, k=2)])  # a released sequence starts afresh
    assert pf.last_member_rounds["head"][2] == 19
    # without measured costs (no cost model): nothing to charge, the long sequence drafts too
    bare = PortfolioProposer([Member("head", Costly([5, 6, 7], "h"), cost=0.08)], prior_alpha=0.35)
    assert bare.draft_context("l", long) == "head:h"


def test_a_probe_waits_longer_where_its_catch_up_is_dear():
    """Probes' catch-ups take at most ``probe_budget`` of the decode time between them: a head
    probed on 750-token prompts every 16 lost choices spent 2-3% of a copy-heavy segment on
    catch-ups it lost."""
    from tests.speculative.test_adaptive_k import PerDrafterCosts

    pf = PortfolioProposer([Member("head", Costly([5], "h"), cost=0.08)], explore_every=16, probe_budget=0.02)
    assert pf._probe_interval("head", 750) == 16  # no cost model: the fixed interval
    pf.use_costs(PerDrafterCosts(draft_cost=0.0, a=0.015, b=0.0, by_drafter={"head": 0.001},
                                 catch_up={"head": 25e-6}))
    assert pf._probe_interval("head", 100) == 16  # 2.5 ms: within 2% of 16 x 15 ms
    assert pf._probe_interval("head", 750) == 63  # 18.75 ms / (0.02 x 15 ms)
    with pytest.raises(ValueError):
        PortfolioProposer([Member("head", Costly([5], "h"), cost=0.08)], probe_budget=0.0)
    with pytest.raises(ValueError):
        PortfolioProposer([Member("head", Costly([5], "h"), cost=0.08)], catch_up_steps=0)


def test_acceptance_is_learnt_per_segment_and_a_losing_costly_member_is_probed():
    """A head rejected on one segment is not written off on another: α is kept per segment (shrunk
    towards the member's global rate), and a costly member that keeps losing a segment's choices
    drafts once every ``explore_every`` of them where it could still win (at an optimistic α)."""
    cheap, head = Fixed([1, 2, 3], "n"), Costly([7, 8, 9], "h")
    pf = PortfolioProposer([Member("ngram", cheap), Member("head", head, cost=0.05)], explore_every=4)
    hist, chosen = [0], []
    for _ in range(20):  # segment "a": the target commits what the n-gram drafted, the head is always wrong
        pf.propose([ProposeInput("s1", list(hist), 3, GREEDY, segment="a")])
        chosen.append(pf.last_choice.get("s1"))
        hist += [1, 2, 3, 4]
    probes = [i for i, c in enumerate(chosen) if c == "head"]
    # the prior ties (the earlier member wins); the 4th choice in a row the head would lose is a
    # probe; once rejected there twice, even its optimistic rate cannot beat an n-gram accepted
    # every time, so it is not probed against it again (each probe costs a catch-up over the sequence)
    assert probes == [3, 7]
    assert pf.optimistic_alpha("head", "h", "s1", "a") < 0.7 < pf.optimistic_alpha("head", "h", None, "new")
    # "b" has no data of its own: the head's global rate; "a" is below it
    assert pf.alpha("head", "h", segment="a") < pf.alpha("head", "h", segment="b") == pf.alpha("head", "h") < 0.5
    assert pf.alpha("ngram", "n", segment="a") > 0.9
    # on segment "b" the head is right: its first probe there lifts b's rate, and it takes over
    pf2_hist, picks = [0], []
    for _ in range(12):
        pf.propose([ProposeInput("s2", list(pf2_hist), 3, GREEDY, segment="b")])
        picks.append(pf.last_choice.get("s2"))
        pf2_hist += [7, 8, 9, 5]
    assert picks[0] == "ngram" and picks[-1] == "head" and pf.alpha("head", "h", segment="b") > 0.8


def test_a_costly_member_that_could_win_is_probed_at_a_fixed_interval():
    """Where the alternative is plain decoding (no cheap draft), a head that keeps losing is
    probed every ``explore_every`` lost choices while its optimistic rate could still beat plain
    — not backed off after failed probes (that starved a head accepted at 0.4 of the
    measurements that show it wins); once its segment's own trials rule that out, it stops."""
    def run(prior_alpha):
        pf = PortfolioProposer([Member("ngram", Fixed([], "n")), Member("head", Costly([7, 8, 9], "h"), cost=0.05)],
                               explore_every=4, prior_alpha=prior_alpha)
        hist, chosen = [0], []
        for _ in range(80):  # the head is always wrong
            pf.propose([ProposeInput("s", list(hist), 3, GREEDY, segment="a")])
            chosen.append(pf.last_choice.get("s"))
            hist += [1, 2, 3, 4]
        return [i for i, c in enumerate(chosen) if c == "head"]

    assert run(0.1) == [3, 7, 11]  # three failed probes: even 2 standard errors above, it cannot beat plain
    # a better prior: chosen by value twice, then probed at the fixed interval until ruled out
    assert run(0.4) == [0, 1, 5, 9, 13, 17]


def test_cheap_members_learn_apart_whether_their_drafts_agree():
    """Two cheap members: a draft whose first token another member's draft shares is learnt
    under "+agree", one that differs under "+differ", a lone draft under "+alone" — a lone
    suffix match (from the segment's other documents) is accepted far less than one prompt
    lookup backs, and pooled they looked worth a verification."""
    lookup, suffix = Fixed([1, 2], "n2"), Fixed([1, 2, 3], "m2")
    pf = PortfolioProposer([Member("ngram", lookup), Member("suffix", suffix)])
    pf.propose([inp("a", [0])])
    assert pf.draft_context("a", [0]) == "suffix:m2+agree"  # the longer draft at the same prior
    pf.propose([inp("a", [0, 1, 2, 3])])  # both right: learnt under "+agree"
    assert pf.alpha("ngram", "n2+agree") > pf.alpha("ngram", "n2+alone") == pf.prior_alpha
    lookup.draft = None  # prompt lookup finds nothing: the suffix member drafts alone
    pf.propose([inp("a", [0, 1, 2, 3, 4])])
    assert pf.draft_context("a", [0, 1, 2, 3, 4]) == "suffix:m2+alone"
    pf.propose([inp("a", [0, 1, 2, 3, 4, 9])])  # the lone draft rejected
    assert pf.alpha("suffix", "m2+alone") < pf.prior_alpha  # the lone draft's rejection, learnt under "+alone"
    assert pf.alpha("suffix", "m2+differ") == pf.prior_alpha
    one = PortfolioProposer([Member("ngram", Fixed([1], "n1")), Member("head", Costly([5], "h"), cost=0.1)])
    assert one.draft_context("b", [0]) == "ngram:n1"  # one cheap member: nothing to compare, no tag


def test_adaptive_k_is_handed_the_rates_the_chosen_member_was_valued_at():
    """``planning_alpha``: the chosen member's (α1, α) for this sequence — on a probe its
    optimistic first-token rate and its ordinary later rate (a probe asks about the first token:
    planned at both optimistic rates, probes drafted 5 tokens where the head was rejected at once)
    — and None where nothing was chosen or the segment's one routed member drafts."""
    cheap, head = Fixed([1, 2, 3], "n"), Costly([7, 8, 9], "h")
    pf = PortfolioProposer([Member("ngram", cheap), Member("head", head, cost=0.05)], explore_every=2)
    hist = [0]
    seen = []
    for _ in range(6):  # the target commits what the n-gram drafts: the head loses, then is probed
        pf.propose([ProposeInput("s", list(hist), 3, GREEDY, segment="a")])
        pending = pf._pending["s"]
        name, ctx = pf.last_choice["s"], pending.drafts[pf.last_choice["s"]][1]
        first = pf.optimistic_alpha(name, ctx, "s", "a") if pending.probe else pf.alpha(name, ctx, "s", "a")
        want = (first, pf.alpha(name, ctx, "s", "a", later=True))
        assert pf.planning_alpha("s") == pytest.approx(want)
        if pending.probe:  # the later rate it was probed at is higher than the one K is planned with
            assert pf.planning_alpha("s")[1] < pf.optimistic_alpha(name, ctx, "s", "a", later=True) - 0.1
        seen.append((name, pending.probe))
        hist += [1, 2, 3, 4]
    assert ("head", True) in seen and ("ngram", False) in seen  # both kinds of step were checked
    nothing = PortfolioProposer([Member("ngram", Fixed(None))])
    nothing.propose([inp("t", [0])])
    assert nothing.planning_alpha("t") is None and nothing.planning_alpha("never-seen") is None
    routed = PortfolioProposer([Member("ngram", Fixed([1, 2])), Member("head", Costly([7], "h"), cost=0.05)],
                               routes=SegmentRoutes(default="head"))
    routed.propose([inp("r", [0])])
    assert routed.last_choice == {"r": "head"} and routed.planning_alpha("r") is None


def test_member_prices_are_kept_while_the_cost_model_stands_and_redone_after_it_learns():
    """Valuing the members reads t(1), t(k+1), each member's round cost and verification's extra
    once per cost-model version: the values equal the formula from the model's current numbers,
    before and after new observations (a stale price would keep valuing yesterday's step)."""
    from cluster.speculative.acceptance import expected_committed
    from cluster.speculative.adaptive_k import StepCostModel

    costs = StepCostModel(draft_cost_prior=0.0, target_a_prior=0.02, min_points=1)
    for n, t in ((1, 0.020), (2, 0.022), (3, 0.023), (4, 0.024)):
        costs.observe_target(n, t)
    costs.observe_draft(3, 0.003, drafter="head")
    pf = PortfolioProposer([Member("ngram", Fixed([1, 2, 3])), Member("head", Costly([1, 2, 3], "h"), cost=0.1)])
    pf.use_costs(costs)

    def formula(name, k, alpha, later):
        step = k * costs.draft_cost_of(name) + costs.target_time(k + 1) + costs.verify_overhead
        return expected_committed((alpha, later), k) * costs.target_time(1) / step

    for _ in range(2):
        for m in pf.members:
            for k in range(1, 7):
                assert pf.expected_per_cost(m, k, 0.6, 0.8) == pytest.approx(formula(m.name, k, 0.6, 0.8), rel=1e-12)
            assert pf.value(m, 6, 0.6, 0.8) == pytest.approx(max(formula(m.name, k, 0.6, 0.8) for k in range(1, 7)))
        version = costs.version
        costs.observe_target(3, 0.040)  # the machine slowed: t(3) doubled
        costs.observe_draft(2, 0.010, drafter="head")  # and the head's rounds dearer
        costs.observe_sampling(True, 0.002)
        costs.observe_sampling(False, 0.001)
        assert costs.version == version + 4


@pytest.mark.parametrize("params, tag", [
    (SamplingParams(max_tokens=8, temperature=1.0), "+sampled"),
    (SamplingParams(max_tokens=8, repetition_penalty=1.3), "+shaped"),
    (SamplingParams(max_tokens=8, temperature=0.7, logit_bias=((5, -2.0),)), "+sampled+shaped"),
])
def test_each_acceptance_class_is_learnt_apart_from_greedy_unshaped_sequences(params, tag):
    """Greedy unshaped sequences whose drafts are always accepted do not make a sampled or shaped
    sequence's drafts look as good: its contexts carry its acceptance class (in the label adaptive
    K reads too), and its rates start from the prior until its class is measured; its rejections
    leave the greedy rates alone."""
    good = Fixed([1, 2, 3], "g")
    pf = PortfolioProposer([Member("good", good)])
    for seq in ("a", "b"):
        history = [0]
        for _ in range(3):
            pf.propose([inp(seq, history)])
            history = history + [1, 2, 3]  # every draft token committed
    greedy = pf.alpha("good", "g", segment="s")
    assert greedy > 0.8 and pf.alpha("good", f"g{tag}", segment="s") == pytest.approx(pf.prior_alpha)
    assert pf.draft_context("c", [0]) == "good:g"
    assert pf.draft_context("d", [0], "s", acceptance_class=tag) == f"good:g{tag}"
    history = [0]
    for _ in range(3):
        pf.propose([ProposeInput("e", list(history), 3, params, segment="s")])
        assert pf.last_choice.get("e") in (None, "good")
        history = history + [7, 7, 7]  # never the draft
    assert pf.alpha("good", f"g{tag}", segment="s") < pf.prior_alpha
    assert pf.alpha("good", "g", segment="s") == pytest.approx(greedy)
