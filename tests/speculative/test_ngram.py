"""N-gram prompt-lookup drafting: literal examples, batching, cache behaviour, speed."""
from __future__ import annotations

import time

import numpy as np
import pytest

from cluster.common.request import SamplingParams
from cluster.speculative.ngram import NgramProposer, find_ngram_continuation, find_ngram_match
from cluster.speculative.proposer import DrafterKind, Proposer, parse_drafter_choice
from cluster.speculative.types import ProposeInput


def draft(tokens, k, ngram_min=1, ngram_max=4, proposer=None, seq_id="s"):
    proposer = proposer or NgramProposer(ngram_min, ngram_max)
    out = proposer.propose([ProposeInput(seq_id, list(tokens), k, SamplingParams())])
    assert out.draft_probs == [None]
    return out.draft_token_ids[0]


@pytest.mark.parametrize("tokens, k, expected", [
    # "1 2 3" occurred before, followed by "4 5 6".
    ([1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 3, [4, 5, 6]),
    # K limits the continuation.
    ([1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 2, [4, 5]),
    # Continuation truncated at the end of the sequence (the match is followed by only 2 tokens).
    ([7, 8, 9, 7, 8], 5, [9, 7, 8]),
    # No earlier occurrence of any suffix n-gram, not even the last token -> empty.
    ([1, 2, 3, 4], 3, []),
    # Longest n preferred: suffix "5 6" matches at 0 (-> 7) although "6" alone recurs later (-> 8).
    ([5, 6, 7, 1, 6, 8, 2, 5, 6], 1, [7]),
    # Most recent occurrence preferred among equal-length matches.
    ([3, 4, 1, 3, 4, 2, 0, 3, 4], 2, [2, 0]),
    # Overlapping repetition: the continuation runs into the suffix itself.
    ([9, 9, 9, 9], 4, [9]),
])
def test_literal_examples(tokens, k, expected):
    assert draft(tokens, k) == expected


def test_ngram_bounds_respected():
    tokens = [1, 2, 3, 9, 5, 2, 3, 7, 4, 1, 2, 3]
    # With n up to 3 the suffix "1 2 3" matches at 0 -> "9 5".
    assert draft(tokens, 2, ngram_max=3) == [9, 5]
    # With n capped at 2, "2 3" most recently occurred at index 5 -> "7 4".
    assert draft(tokens, 2, ngram_max=2) == [7, 4]
    # ngram_min = 2 refuses a unigram-only match.
    assert draft([4, 1, 5, 6, 1], 2, ngram_min=2) == []
    assert draft([4, 1, 5, 6, 1], 2, ngram_min=1) == [5, 6]


def test_zero_k_and_tiny_sequences():
    assert draft([1, 2, 1], 0) == []
    assert draft([1], 3) == []
    assert draft([1, 1], 3) == [1]


def test_batch_and_protocol():
    p = NgramProposer()
    assert isinstance(p, Proposer) and p.kind is DrafterKind.NGRAM
    inputs = [
        ProposeInput("a", [1, 2, 3, 1, 2], 2, SamplingParams()),
        ProposeInput("b", [5, 6, 7], 4, SamplingParams(temperature=0.8)),
        ProposeInput("c", [4, 4, 4, 8, 4], 3, SamplingParams()),
    ]
    out = p.propose(inputs)
    assert out.draft_token_ids == [[3, 1], [], [8, 4]]
    assert out.draft_probs == [None, None, None]


def test_cache_follows_growth_and_rebuilds_on_change():
    p = NgramProposer()
    seq = [1, 2, 3, 4, 1, 2]
    assert draft(seq, 2, proposer=p) == [3, 4]
    seq += [3, 9] + list(range(100, 300))  # grows past the initial buffer capacity
    seq += [3, 9]
    assert draft(seq, 2, proposer=p) == [100, 101]
    # A different history under the same id (e.g. reuse after a missed release) is not trusted.
    assert draft([7, 5, 7], 1, proposer=p) == [5]
    p.release("s")
    p.release("never-seen")  # no-op
    assert draft([1, 2, 1], 1, proposer=p) == [2]


def test_draft_context_is_the_match_length():
    p = NgramProposer(ngram_min=1, ngram_max=3)
    assert p.draft_context("a", [1, 2, 3, 1, 2, 3, 1, 2]) == "n3"  # suffix 3 1 2 occurred before
    assert find_ngram_match(np.array([1, 2, 3, 1, 2, 3, 1, 2]), 1, 3) == (3, 5)  # 3 1 2 seen at 2..4, then 3
    assert p.draft_context("b", [5, 6, 7, 8, 6]) == "n1"
    assert p.draft_context("c", [5, 6, 7, 8]) is None  # no match: nothing to draft
    assert p.draft_context("d", [5]) is None
    assert find_ngram_match(np.array([5, 6, 7, 8]), 1, 3) == (0, -1)
    assert NgramProposer(ngram_min=2, ngram_max=3).draft_context("e", [5, 6, 7, 8, 6]) is None


def test_one_search_per_history_length(monkeypatch):
    """Adaptive K asks for the draft context, then the draft, of the same tokens: one search."""
    from cluster.speculative import ngram

    calls = []
    real = ngram.find_ngram_match
    monkeypatch.setattr(ngram, "find_ngram_match", lambda *a: calls.append(1) or real(*a))
    p = NgramProposer(ngram_min=1, ngram_max=3)
    seq = [1, 2, 3, 1, 2]
    assert p.draft_context("a", seq) == "n2"
    assert draft(seq, 2, proposer=p, seq_id="a") == [3, 1]
    assert len(calls) == 1
    seq += [3, 7, 1]  # grown: searched again, and the draft rests on the new suffix
    assert p.draft_context("a", seq) == "n1" and draft(seq, 3, proposer=p, seq_id="a") == [2, 3, 7]
    assert len(calls) == 2
    assert draft([9, 8, 9], 1, proposer=p, seq_id="a") == [8]  # a changed history is searched anew
    assert len(calls) == 3


def test_invalid_bounds():
    with pytest.raises(ValueError):
        NgramProposer(ngram_min=0)
    with pytest.raises(ValueError):
        NgramProposer(ngram_min=3, ngram_max=2)


def test_matches_brute_force_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(200):
        tokens = rng.integers(0, 4, size=int(rng.integers(2, 40))).tolist()
        k = int(rng.integers(1, 6))
        expected = []
        for n in range(min(4, len(tokens) - 1), 0, -1):
            suffix = tokens[-n:]
            starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
            if starts:
                expected = tokens[starts[-1] + n : starts[-1] + n + k]
                break
        assert find_ngram_continuation(np.array(tokens, dtype=np.int64), k, 1, 4) == expected


def test_match_is_the_longest_suffix_ngram_and_its_most_recent_occurrence_by_brute_force():
    """(n, start) for every ngram_min / ngram_max, small vocabularies (many occurrences, long
    matches) and large ones (few), against the definition itself."""
    rng = np.random.default_rng(3)
    for _ in range(1500):
        tokens = rng.integers(0, int(rng.choice([2, 3, 5, 50])), size=int(rng.integers(1, 60))).tolist()
        lo = int(rng.integers(1, 5))
        hi = int(rng.integers(lo, 7))
        expected = (0, -1)
        for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
            starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[-n:]]
            if starts:
                expected = (n, starts[-1] + n)
                break
        assert find_ngram_match(np.array(tokens, dtype=np.int64), lo, hi) == expected, (tokens, lo, hi)


def test_4k_token_search_is_fast():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 32000, size=4096).tolist()
    tokens += tokens[1000:1003]  # the suffix 3-gram occurs once, at 1000
    p = NgramProposer()
    assert draft(tokens, 5, proposer=p) == tokens[1003:1008]
    start = time.perf_counter()
    reps = 50
    for _ in range(reps):
        find_ngram_continuation(np.asarray(tokens, dtype=np.int64), 5, 1, 4)
    per_search = (time.perf_counter() - start) / reps
    assert per_search < 2e-3, f"{per_search * 1e3:.2f} ms per 4k-token search (conversion included)"


# ---------------------------------------------------------------- drafter choice parsing
# (cluster/speculative/proposer.py; lives here until a tests/speculative/test_proposer.py exists)

@pytest.mark.parametrize("text, kind, layers, model", [
    ("ngram", DrafterKind.NGRAM, None, None),
    ("NGRAM", DrafterKind.NGRAM, None, None),
    ("self", DrafterKind.SELF, None, None),
    ("self:6", DrafterKind.SELF, 6, None),
    ("self:1", DrafterKind.SELF, 1, None),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", DrafterKind.DRAFT_MODEL, None, "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("/models/draft", DrafterKind.DRAFT_MODEL, None, "/models/draft"),
])
def test_parse_drafter_choice(text, kind, layers, model):
    spec = parse_drafter_choice(text)
    assert (spec.kind, spec.self_layers, spec.model) == (kind, layers, model)


@pytest.mark.parametrize("text", ["none", "None", "", "  ", None])
def test_parse_drafter_choice_none(text):
    assert parse_drafter_choice(text) is None


@pytest.mark.parametrize("text, message", [
    ("self:0", "L >= 1"),
    ("self:-2", "L >= 1"),
    ("self:abc", "positive number of target layers"),
    ("self:", "positive number of target layers"),
])
def test_parse_drafter_choice_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_drafter_choice(text)


def test_a_draft_context_carries_the_sequences_acceptance_class():
    p = NgramProposer()
    assert p.draft_context("a", [1, 2, 3, 1, 2], acceptance_class="+sampled") == "n2+sampled"
    assert p.draft_context("a", [1, 2, 3, 1, 2], acceptance_class="+sampled+shaped") == "n2+sampled+shaped"
    assert p.draft_context("b", [1, 2, 3, 1, 2]) == "n2"
    assert p.draft_context("c", [5, 6], acceptance_class="+shaped") is None
