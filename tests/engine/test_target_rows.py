"""The target's rows as each request's sampling sees them (``cluster.engine.target_rows``): a
constrained sequence's rows masked along its draft walk, a biased or penalised sequence's rows
shaped with its drafts counted, the rest untouched (and not copied)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from cluster.common.request import SamplingParams
from cluster.engine.drafts import SeqDraft, StepDrafts
from cluster.engine.grammar_drafts import forced_prefix, grammar_draft
from cluster.engine.target_rows import process_rows
from tests.engine.test_grammar import compiler, tiny  # noqa: F401 (the fixtures: a tiny Llama, its grammar compiler)
from tests.engine.test_grammar_drafts import seq


def test_a_constrained_sequences_rows_are_masked_by_its_draft_walk_and_no_other(tiny, compiler):
    vocab = tiny.runner.vocab_size
    c, u = seq(compiler), seq(compiler, constrained=False)
    c.seq_id, u.seq_id = "c", "u"
    forced = forced_prefix(c)
    draft, _ = grammar_draft(c, forced, [], None)
    drafts = StepDrafts({"c": draft, "u": SeqDraft([5, 6])})
    logits = torch.zeros(draft.k + 1 + 3, vocab)
    batch = [SimpleNamespace(seq=c), SimpleNamespace(seq=u)]
    out = process_rows(logits, batch, drafts)
    assert torch.equal(torch.isfinite(out[: draft.k + 1]), draft.allowed)
    assert torch.equal(out[draft.k + 1:], logits[draft.k + 1:]) and bool(torch.isfinite(logits).all())
    plain = logits[:3]
    assert process_rows(plain, [batch[1]], StepDrafts({"u": SeqDraft([5, 6])})) is plain  # nothing to mask: no copy


def test_a_penalised_sequences_rows_count_its_drafts_and_the_others_are_untouched():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((9, 3.0),), min_tokens=3)
    shaped = SimpleNamespace(seq_id="p", grammar=None, request=SimpleNamespace(params=params, prompt_token_ids=[1]),
                             output_token_ids=[4, 4], num_output=2, eos_token_ids=frozenset({11}), token_ids=[1, 4, 4],
                             seen_tokens=None)
    other = SimpleNamespace(seq_id="o", grammar=None, request=SimpleNamespace(params=SamplingParams(), prompt_token_ids=[1]),
                            output_token_ids=[4], num_output=1, eos_token_ids=frozenset({11}), token_ids=[1, 4],
                            seen_tokens=None)
    logits = torch.zeros(3 + 1, 12)  # p: K = 2 (drafts 4, 7) -> 3 rows; o: 1 row
    drafts = StepDrafts({"p": SeqDraft([4, 7])})
    out = process_rows(logits, [SimpleNamespace(seq=shaped), SimpleNamespace(seq=other)], drafts)
    assert out[:3, 4].tolist() == [-1.0, -1.25, -1.25]  # 2, 3, 3 fours before rows 0, 1, 2
    assert out[:3, 7].tolist() == [0.0, 0.0, -0.75]  # the second draft counts from row 2 on
    assert out[:3, 9].tolist() == [3.0, 3.0, 3.0] and torch.equal(out[3], logits[3])
    assert out[:3, 11].tolist() == [float("-inf"), 0.0, 0.0]  # min_tokens 3: EOS held back at position 2 only
    assert bool((logits == 0).all())  # the input is not written


def test_a_repetition_penalty_counts_the_prompt_the_output_and_each_rows_drafts():
    params = SamplingParams(repetition_penalty=2.0)
    seq = SimpleNamespace(seq_id="r", grammar=None, request=SimpleNamespace(params=params, prompt_token_ids=[1, 2]),
                          output_token_ids=[3], num_output=1, eos_token_ids=frozenset({11}), token_ids=[1, 2, 3],
                          seen_tokens=None)
    logits = torch.ones(3, 6)  # K = 2 (drafts 4, 2) -> 3 rows
    out = process_rows(logits, [SimpleNamespace(seq=seq)], StepDrafts({"r": SeqDraft([4, 2])}))
    assert out[:, 1:4].eq(0.5).all()  # prompt and output tokens: every row
    assert out[:, 4].tolist() == [1.0, 0.5, 0.5]  # the first draft from row 1 on
    assert out[:, 0].eq(1.0).all() and out[:, 5].eq(1.0).all() and bool((logits == 1).all())
    assert seq.seen_tokens.ids == {1, 2, 3} and seq.seen_tokens.length == 3  # kept on the sequence
    seq.token_ids, seq.output_token_ids, seq.num_output = [1, 2, 3, 5], [3, 5], 2  # the next step: 5 committed
    out = process_rows(logits[:1], [SimpleNamespace(seq=seq)], StepDrafts({}))
    assert out[0].tolist() == [1.0, 0.5, 0.5, 0.5, 1.0, 0.5] and seq.seen_tokens.length == 4
