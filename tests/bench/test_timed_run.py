"""One request timed per step (``cluster.bench.timed_run``) on the default model: the tokens are
the request's, every step after the prefill is a plain decode step or a verification step, each
with its parts outside the forward, and the speculation counters are the request's own."""
from __future__ import annotations

import pytest

from cluster.bench.timed_run import Run, engine_for, request_for, run_ours
from cluster.common.config import SpecConfig


def test_a_plain_run_is_prefill_then_decode_steps(default_model):
    ids = default_model.tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
    run = run_ours(engine_for(default_model), request_for("p", ids, 12, "chat"))
    assert run.tokens == len(run.ids) and 1 <= run.tokens <= 12
    assert run.prefill_s > 0 and not run.verify_steps and run.drafts == 0
    assert len(run.decode_steps) == run.tokens - 1  # one token per step after the prefill's
    assert run.wall_s >= run.prefill_s + sum(run.decode_steps)


def test_a_speculative_run_splits_verification_steps_and_keeps_the_requests_counters(default_model):
    text = "one two three four five six seven eight. one two three four five six seven eight. one two three"
    ids = default_model.tokenizer(text)["input_ids"]
    engine = engine_for(default_model, SpecConfig(drafter="ngram", num_draft_tokens=3))
    plain = run_ours(engine_for(default_model), request_for("p", ids, 24, "edit"))
    run = run_ours(engine, request_for("s", ids, 24, "edit"))
    assert run.ids == plain.ids  # lossless, and what was timed is the request's output
    assert run.verify_steps and run.drafts == len(run.verify_steps)
    assert run.drafts <= run.draft_tokens <= 3 * run.drafts  # a match may continue for fewer than K tokens
    assert len(run.step_parts) == len(run.verify_steps) + len(run.decode_steps)
    assert 0 <= run.accepted_tokens <= run.draft_tokens and sum(run.steps_by_num_draft_tokens) == run.drafts
    assert run.host_steps == pytest.approx([p + s + o for p, _, s, o in run.step_parts])
    assert all(x >= 0 for part in run.step_parts[:-1] for x in part[:3])


def test_host_steps_leave_out_the_drafter():
    run = Run(1.0, 2, [1, 2], step_parts=[(0.001, 0.5, 0.002, 0.003)])
    assert run.host_steps == pytest.approx([0.006])
