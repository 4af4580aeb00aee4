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

    def draft_context(self, seq_id, token_ids, segment=""):
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
    assert pf.alpha("good", "g") == pytest.approx(7 / 8) and pf.alpha("bad", "b") == pytest.approx(1 / 5)
    assert chosen == ["bad", "good", "good", "good"]
    # accepted: what the next call's committed tokens showed (the last draft awaits its verdict)
    assert pf.drafter_stats() == {"bad": {"steps": 1, "draft_tokens": 3, "accepted_tokens": 0},
                                  "good": {"steps": 3, "draft_tokens": 9, "accepted_tokens": 4}}


def test_learning_counts_accepted_prefix_and_one_rejection_censored_beyond_committed():
    a = Fixed([5, 6, 7, 8], "x")
    pf = PortfolioProposer([Member("a", a)], prior_weight=1e-9)
    pf.propose([inp("s1", [1, 2], k=4)])
    pf.propose([inp("s1", [1, 2, 5, 6, 9], k=4)])  # 5, 6 accepted, 9 recovered: one rejection
    assert pf.alpha("a", "x") == pytest.approx(2 / 3)
    assert pf.drafter_stats()["a"] == {"steps": 2, "draft_tokens": 8, "accepted_tokens": 2}
    pf.propose([inp("s1", [1, 2, 5, 6, 9, 5], k=4)])  # one plain token that matched: censored
    assert pf.alpha("a", "x") == pytest.approx(3 / 4)


def test_no_candidate_no_draft_and_k_zero_rows_in_a_ragged_batch():
    pf = PortfolioProposer([Member("none", Fixed(None)), Member("some", Fixed([4, 4, 4, 4]))])
    got = pf.propose([inp("a", [1], k=2), inp("b", [1], k=0), inp("c", [1], k=4)])
    assert got.draft_token_ids == [[4, 4], [], [4, 4, 4, 4]] and got.draft_probs == [None] * 3
    assert pf.draft_context("a", [1]) == "some:c"
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
