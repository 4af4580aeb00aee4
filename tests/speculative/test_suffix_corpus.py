"""Suffix corpus: building (distinct documents, the token bound, unusable documents left out), the
pair index against a brute-force scan, the file round trip, refusals (another target, no identity,
not a corpus, a damaged one), the process-wide cache, and the drafter over it: corpus matches of
two tokens and more, the sequence's own history not outvoted at the same match length, contexts
("c<m>", "c<m>w"), and the shipped corpus (written by the default model, found by ``suffix``)."""
from __future__ import annotations

import numpy as np
import pytest

from cluster.common.errors import ModelLoadError
from cluster.common.request import SamplingParams
from cluster.speculative.eagle_head import TargetIdentity
from cluster.speculative.suffix import SuffixProposer
from cluster.speculative.suffix_corpus import (SEPARATOR, SHIPPED_SUFFIX_CORPUS, SuffixCorpusMismatch, build_corpus,
                                               cached_corpus, corpus_target, load_corpus, save_corpus)
from cluster.speculative.types import ProposeInput

ME = TargetIdentity("llama", "a" * 32)
OTHER = TargetIdentity("llama", "b" * 32)


def ask(p, seq_id, tokens, k=4, segment="s"):
    params = SamplingParams(max_tokens=8)
    return p.propose([ProposeInput(seq_id, list(tokens), k, params, segment=segment)]).draft_token_ids[0]


def test_build_keeps_distinct_documents_within_the_bound():
    docs = [[1, 2, 3], [4, 5], [1, 2, 3], [7], [-3, 4], [8, 9, 10, 11]]
    c = build_corpus(docs, ME, max_tokens=8)
    # the copy, the one-token and the negative document left out; [8..11] would pass the bound
    assert c.documents == 2 and c.num_tokens == 5
    assert c.tokens.tolist() == [1, 2, 3, SEPARATOR, 4, 5, SEPARATOR]
    with pytest.raises(ValueError):
        build_corpus(docs, ME, max_tokens=0)


def test_pair_positions_equal_a_scan():
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 9, rng.integers(2, 40)).tolist() for _ in range(60)]
    c = build_corpus(docs, ME, max_tokens=10_000)
    flat = c.tokens
    for prev in range(-1, 10):
        for tok in range(-1, 10):
            want = [p for p in range(1, flat.size) if flat[p - 1] == prev and flat[p] == tok
                    and prev != SEPARATOR and tok != SEPARATOR]
            assert c.pair_positions(prev, tok).tolist() == want, (prev, tok)


def test_file_round_trip_and_refusals(tmp_path):
    c = build_corpus([[5, 6, 7, 8], [70000, 3, 5, 6]], ME, 100, made_by="specserve suffix-corpus --from x")
    path = tmp_path / "c.npz"
    save_corpus(c, path)
    back = load_corpus(path, ME)
    assert back.tokens.tolist() == c.tokens.tolist() and back.documents == 2 and back.made_by == c.made_by
    assert corpus_target(path) == ME and corpus_target(tmp_path / "none.npz") is None
    with pytest.raises(SuffixCorpusMismatch, match="another target"):
        load_corpus(path, OTHER)
    with pytest.raises(SuffixCorpusMismatch, match="cannot be identified"):
        load_corpus(path, None)
    with pytest.raises(ModelLoadError, match="no such file"):
        load_corpus(tmp_path / "none.npz", ME)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ModelLoadError, match="not a suffix corpus"):
        load_corpus(tmp_path / "junk.npz", ME)
    with np.load(path) as z:
        parts = dict(z)
    parts["lengths"] = parts["lengths"] + 1  # lengths that do not add up to the tokens stored
    np.savez_compressed(tmp_path / "bad.npz", **parts)
    with pytest.raises(ModelLoadError, match="expected"):
        load_corpus(tmp_path / "bad.npz", ME)


def test_the_cache_shares_one_corpus_and_still_refuses_another_target(tmp_path):
    path = tmp_path / "c.npz"
    save_corpus(build_corpus([[1, 2, 3]], ME, 10), path)
    assert cached_corpus(path, ME) is cached_corpus(path, ME)
    with pytest.raises(SuffixCorpusMismatch):
        cached_corpus(path, OTHER)


def test_the_drafter_continues_from_the_corpus_and_names_its_context():
    c = build_corpus([[1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 5, 6], [8, 2, 3, 7, 7, 7]], ME, 100)
    p = SuffixProposer(corpus=c)
    assert ask(p, "a", [40, 41, 2, 3]) == [4, 5, 6]  # "2 3" seen three times, "4" after it twice
    d = p.proposal("a", [40, 41, 2, 3], "s")
    assert d.from_corpus and d.match_len == 2 and d.probs[0] == pytest.approx(2 / 3)
    assert p.draft_context("a", [40, 41, 2, 3], "s") == "c2"
    assert ask(p, "b", [40, 41, 42, 3]) == []  # one token matched: not enough in a corpus
    assert ask(SuffixProposer(), "c", [40, 41, 2, 3]) == []  # no corpus, nothing learnt
    weak = SuffixProposer(corpus=build_corpus([[2, 3, 10 + i] for i in range(4)], ME, 100))
    assert weak.draft_context("d", [40, 2, 3], "s") == "c2w"  # first token 1 in 4


def test_the_sequences_own_history_is_not_outvoted_by_the_corpus():
    """The same two-token match in the sequence's own history (once, continuing with 9) and in the
    corpus (twenty times, continuing with 4): pooled, the corpus' occurrences would decide the
    first token; apart, the corpus draft wins only by a higher score at its weight."""
    c = build_corpus([[2, 3, 4, 50 + i] for i in range(20)], ME, 1000)
    p = SuffixProposer(corpus=c)
    own = [2, 3, 9, 9, 9, 9, 7, 7, 2, 3]
    d = p.proposal("a", own, "s")
    assert not d.from_corpus and d.tokens == [9, 9, 9, 9, 7] and p.draft_context("a", own, "s") == "m2"
    assert p.proposal("b", [1, 2, 3], "s").tokens == [4]  # nothing of its own: the corpus'
    # a sure five-token continuation in the corpus (score 5) beats the own one of three (9 2 3) at
    # full weight, not at the default corpus_weight (0.4 x 5 = 2)
    sure = build_corpus([[2, 3, 4, 5, 6, 7, 8, 60 + i] for i in range(20)], ME, 1000)
    d2 = SuffixProposer(corpus=sure, corpus_weight=1.0).proposal("c", [2, 3, 9, 2, 3], "s")
    assert d2.from_corpus and d2.tokens == [4, 5, 6, 7, 8]
    assert SuffixProposer(corpus=sure).proposal("c", [2, 3, 9, 2, 3], "s").tokens == [9, 2, 3]
    assert SuffixProposer().proposal("c", [2, 3, 9, 2, 3], "s").tokens == [9, 2, 3]
    # a four-token corpus match, sure for nine tokens (0.4 x 9 = 3.6), beats the own one of three
    long = build_corpus([list(range(1, 14)) + [60 + i] for i in range(20)], ME, 1000)
    d3 = SuffixProposer(corpus=long).proposal("d", [4, 9, 1, 2, 3, 4], "s")
    assert d3.from_corpus and d3.tokens == list(range(5, 14)) and d3.match_len == 4
    with pytest.raises(ValueError):
        SuffixProposer(corpus_weight=0)


def test_the_shipped_corpus_was_written_by_the_default_model(default_model):
    from cluster.engine.drafters import suffix_corpus_for
    from cluster.speculative.eagle_head import target_identity

    identity = target_identity(default_model.runner.model)
    assert corpus_target(SHIPPED_SUFFIX_CORPUS) == identity
    c = suffix_corpus_for(default_model, None)
    assert c is not None and c.num_tokens > 500_000 and "specserve suffix-corpus" in c.made_by
    assert suffix_corpus_for(default_model, "cold") is None
