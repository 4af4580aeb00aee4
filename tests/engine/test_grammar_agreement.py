"""The grammar mask and the grammar matcher never disagree, on the default tokenizer: for
generated regexes, JSON Schemas and Lark grammars (huge repetition counts, nested quantifiers,
empty languages, unicode classes), every token the mask allows the matcher consumes and sampled
tokens it forbids the matcher refuses, over several steps of random allowed tokens; a constraint
past llguidance's limits is refused at compile or fails as that request's ``GrammarError``, never
as a mask that lets through a token the matcher then refuses (issue 64: ``a{1000000}``).

CI profile: ``CI_EXAMPLES`` constraints (``--grammar-examples N`` for more); the chaos suite runs
the same property with at least 500 (``tests/chaos/test_grammar_agreement.py``).
"""
from __future__ import annotations

import pytest
import torch

from cluster.common.request import Constraint, ConstraintKind
from cluster.engine.grammar import GrammarCompiler, GrammarError
from tests.engine.grammar_agreement import AgreementTally, Outcome, run_property

CI_EXAMPLES = 40


@pytest.fixture(scope="module")
def compiler(default_model):
    compiler = GrammarCompiler(default_model.tokenizer, default_model.runner.vocab_size,
                               default_model.eos_token_ids)
    compiler.tokenizer  # built once (~1 s), outside the examples' time
    return compiler


def test_mask_and_matcher_agree_on_generated_constraints(compiler, pytestconfig):
    examples = pytestconfig.getoption("--grammar-examples") or CI_EXAMPLES
    tally = AgreementTally()
    run_property(compiler, examples, tally, derandomize=True)
    print(tally.summary())
    assert sum(tally.outcomes.values()) >= examples
    # most constraints reach the mask (not all refused at compile), and tokens were checked both ways
    assert tally.outcomes[Outcome.RAN] + tally.outcomes[Outcome.ENDED] > examples // 3
    assert tally.allowed_checked > examples and tally.forbidden_checked > examples


REGEX = ConstraintKind.REGEX


def test_a_forced_run_after_a_choice_fails_the_matcher_not_the_mask(compiler):
    """The forced run starts after the first token: compile passes, the second mask (not the
    commit of a token the mask allowed) raises GrammarError naming llguidance's limit."""
    m = compiler.matcher(Constraint(REGEX, "[bc]a{300000}"))
    first = m.allowed()  # [V] bool
    [b] = [t for t in torch.nonzero(first).flatten().tolist() if m.token_bytes([t]) == b"b"]
    m.accept(b)
    with pytest.raises(GrammarError, match="the grammar engine hit its limits: lexer error"):
        m.allowed()


def test_a_forced_run_within_the_limits_agrees_for_its_whole_length(compiler):
    m = compiler.matcher(Constraint(REGEX, "a{256}"))
    emitted = b""
    while not m.complete:
        [t] = torch.nonzero(m.allowed()).flatten().tolist()  # forced: one token at a time
        m.accept(t)
        emitted += m.token_bytes([t])
    assert emitted == b"a" * 256
