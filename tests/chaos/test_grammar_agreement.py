"""The long profile of the mask-matcher agreement property (``tests/engine/grammar_agreement.py``):
at least ``MIN_EXAMPLES`` generated regexes, JSON Schemas and Lark grammars on the default
tokenizer (``--grammar-examples N`` for more), unseeded so each run explores new constraints; the
tally goes in the chaos report (section ``grammar_agreement``). No Serve app: the grammar engine
alone, so it runs before the apps start."""
from __future__ import annotations

import time

from cluster.engine.grammar import GrammarCompiler
from tests.engine.grammar_agreement import AgreementTally, Outcome, run_property

MIN_EXAMPLES = 500


def test_mask_and_matcher_agree_on_the_long_profile(default_model, pytestconfig, chaos_report):
    examples = max(MIN_EXAMPLES, pytestconfig.getoption("--grammar-examples") or 0)
    compiler = GrammarCompiler(default_model.tokenizer, default_model.runner.vocab_size,
                               default_model.eos_token_ids)
    compiler.tokenizer  # built once, outside the examples' time
    tally = AgreementTally()
    t0 = time.monotonic()
    try:
        run_property(compiler, examples, tally)
    finally:
        chaos_report.record("grammar_agreement", "examples", examples)
        chaos_report.record("grammar_agreement", "outcomes", {o.name.lower(): n for o, n in tally.outcomes.items()})
        chaos_report.record("grammar_agreement", "tokens_checked",
                            {"allowed": tally.allowed_checked, "forbidden": tally.forbidden_checked,
                             "steps": tally.steps})
        chaos_report.record("grammar_agreement", "seconds", round(time.monotonic() - t0, 1))
        print(tally.summary())
    assert sum(tally.outcomes.values()) >= examples
    assert tally.outcomes[Outcome.RAN] + tally.outcomes[Outcome.ENDED] > examples // 3
