"""Drafts under a grammar (``cluster.engine.grammar_drafts``) on the default tokenizer with a tiny
random Llama: forced tokens come first and the drafter's draft after them in one draft, the
draft is cut at its first illegal token (kept for a sampled draft), q grows one-hot rows for the
forced tokens, and the masks along the whole draft are kept (verification applies them:
tests/engine/test_target_rows.py)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from cluster.common.request import Constraint, ConstraintKind, SamplingParams
from cluster.engine.grammar_drafts import forced_prefix, grammar_draft, one_hot
from tests.engine.test_grammar import compiler, tiny  # noqa: F401 (the fixtures: a tiny Llama, its grammar compiler)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def seq(compiler, params: SamplingParams | None = None, constrained: bool = True):
    grammar = compiler.matcher(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))) if constrained else None
    request = SimpleNamespace(params=params or SamplingParams(max_tokens=32))
    return SimpleNamespace(seq_id="s", grammar=grammar, request=request, num_output=0)


def encode(tiny, text: str) -> list[int]:
    return tiny.tokenizer.encode(text, add_special_tokens=False)


def value_after(tiny, forced: list[int]) -> list[int]:
    """Tokens that complete '{"name":"Ann"' after the forced text (legal under SCHEMA)."""
    text = tiny.tokenizer.decode(forced)
    full = '{"name":"Ann"'
    assert full.startswith(text), text
    return encode(tiny, full[len(text):])


def test_forced_prefix_is_the_fixed_text_and_a_faulty_matcher_gives_none(tiny, compiler):
    s = seq(compiler)
    forced = forced_prefix(s)
    assert forced and tiny.tokenizer.decode(forced).startswith('{"name')

    def broken():
        raise RuntimeError("matcher exploded")

    s.grammar.forced_tokens = broken
    assert forced_prefix(s) == []  # an optimisation only: verification still masks every row


def test_forced_tokens_then_the_drafters_draft_cut_at_its_first_illegal_token(tiny, compiler):
    s = seq(compiler)
    forced = forced_prefix(s)
    value = value_after(tiny, forced)
    illegal = encode(tiny, "}")[0]  # "age" is required: the object cannot close after "name"
    draft, cut = grammar_draft(s, forced, value + [illegal, value[0]], None)
    assert draft.token_ids == forced + value and cut == 2
    assert draft.num_forced == len(forced) and draft.probs is None
    assert draft.allowed.shape == (draft.k + 1, tiny.runner.vocab_size)
    assert not draft.allowed[-1][illegal] and draft.allowed[0].any()
    assert forced_prefix(s) == forced  # the walk rolled the matcher back


def test_sampled_draft_keeps_the_illegal_token_and_q_grows_one_hot_forced_rows(tiny, compiler):
    s = seq(compiler, SamplingParams(max_tokens=32, temperature=1.0))
    forced = forced_prefix(s)
    vocab = tiny.runner.vocab_size
    ids = value_after(tiny, forced) + [encode(tiny, "}")[0]]
    q = torch.full((len(ids), vocab), 1.0 / vocab)
    draft, cut = grammar_draft(s, forced, ids, q)
    assert cut == 0 and draft.token_ids == forced + ids  # kept: p' = 0 rejects it in verification
    assert draft.probs.shape == (len(forced) + len(ids), vocab)
    assert torch.equal(draft.probs[: len(forced)], one_hot(forced, vocab))
    assert torch.equal(draft.probs[len(forced):], q)
    assert torch.allclose(draft.probs.sum(1), torch.ones(draft.k))


def test_forced_only_and_nothing_at_all(tiny, compiler):
    s = seq(compiler)
    forced = forced_prefix(s)
    draft, cut = grammar_draft(s, forced, [], None)
    assert draft.token_ids == forced and draft.num_forced == len(forced) and cut == 0
    assert grammar_draft(s, [], [], None) == (None, 0)
    illegal = encode(tiny, "}")[0]  # the object cannot start with '}'
    assert grammar_draft(s, [], [illegal], None) == (None, 1)


def test_forced_text_learns_how_the_target_tokenizes_held_back_text(tiny, compiler):
    from cluster.engine.grammar_drafts import ForcedText

    learnt = ForcedText()
    s = seq(compiler)
    s.token_ids = [1, 2, 3]
    forced = forced_prefix(s)
    text = s.grammar.forced_text()
    rest = text[len(s.grammar.token_bytes(forced)):]
    assert text.startswith(b'{"name') and rest  # the grammar engine holds the tail back
    assert learnt.draft(s, forced) == []  # never seen
    target = encode(tiny, rest.decode()[:-1]) + encode(tiny, rest.decode()[-1])  # a non-canonical split
    assert s.grammar.token_bytes(target) == rest
    s.token_ids += forced  # committed the forced tokens, not yet the rest: still pending
    assert learnt.draft(s, []) == []
    s.token_ids += target + encode(tiny, "Ann")
    other = seq(compiler)
    other.seq_id, other.token_ids = "o", [7]
    assert learnt.draft(other, forced_prefix(other)) == []  # learnt from s's committed tokens only when s drafts again
    learnt.draft(s, [])  # s resolves its pending text: its committed tokens spell it exactly
    assert learnt.draft(other, forced_prefix(other)) == target
    learnt.release("s")
    bad = seq(compiler)
    bad.seq_id, bad.token_ids = "b", [1]
    learnt2 = ForcedText()
    learnt2.draft(bad, forced)
    bad.token_ids += forced + encode(tiny, "xyz")  # not the text: nothing learnt
    learnt2.draft(bad, [])
    assert learnt2.draft(other, forced_prefix(other)) == []
