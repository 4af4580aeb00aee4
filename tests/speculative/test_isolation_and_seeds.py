"""No request can hurt another, and a seed means the same text on every path (tiny random model).

Faults are injected into one sequence of a batch — NaN target logits for its row (plain and
speculative steps), a drafter answering q of the wrong width or raising for it, a detokenizer
that raises — and that sequence alone ends (FinishReason.ERROR with a message) or, for draft
faults, loses only its drafts, while every other sequence's tokens equal its solo run and the KV
pool drains. Seeded sampling gives identical output plainly and with n-gram, layer-skip and
draft-model drafters at K = 1..4."""
from __future__ import annotations

import asyncio

import pytest
import torch

from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.request import FinishReason, GenerationRequest, SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.speculation import build_spec_controller
from cluster.models.runner import ModelRunner
from cluster.speculative.draft_model import DraftModelProposer
from cluster.speculative.types import DraftProposal
from tests.engine.helpers import run_to_completion

MAX_TOKENS = 14
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [50, 60, 70, 50, 60, 70, 50], [900, 901, 902, 903], [11, 12, 11, 12, 11]]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from cluster.models.load import load_model

    return load_model(str(tiny_llama_dir), EngineConfig(model=str(tiny_llama_dir)))


def engine(tiny, drafter: str | None = None, k: int = 3, proposer=None) -> LLMEngine:
    spec = None if drafter is None else SpecConfig(drafter=drafter, num_draft_tokens=k)
    config = EngineConfig(model="tiny", spec=spec)
    m = tiny.with_fresh_kv(config, 64)  # 1024 tokens: small pools keep the test fast
    return LLMEngine(config, m, build_spec_controller(config, m, proposer) if spec is not None else None)


def draft_model(tiny) -> DraftModelProposer:
    """The target's weights as an independent draft model (own runner and KV pool)."""
    return DraftModelProposer(ModelRunner(tiny.runner.model, 64, 16, 64))


def requests(params: list[SamplingParams]) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", list(PROMPTS[i % len(PROMPTS)]), p) for i, p in enumerate(params)]


def solo(tiny, req: GenerationRequest) -> list[int]:
    return run_to_completion(engine(tiny), [GenerationRequest(req.request_id, req.prompt_token_ids, req.params)])[req.request_id]["ids"]


def assert_pool_full(eng: LLMEngine) -> None:
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks
    assert not eng.seqs


def mixed_params() -> list[SamplingParams]:
    """Deterministic requests (greedy, seeded) next to an unseeded one."""
    return [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=20, seed=11, ignore_eos=True),
            SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True),
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.5, seed=12, ignore_eos=True)]


# ---------------------------------------------------------------- tiny temperatures

@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_tiny_temperatures_are_greedy_and_leave_neighbours_alone(tiny, drafter):
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1e-44, ignore_eos=True),
              SamplingParams(max_tokens=MAX_TOKENS, temperature=1e-30, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=9, ignore_eos=True)]
    reqs = requests(params)
    eng = engine(tiny, drafter)
    res = run_to_completion(eng, reqs)
    for r in reqs:
        assert res[r.request_id]["finish"] is FinishReason.LENGTH
        assert res[r.request_id]["ids"] == solo(tiny, r)
    for i in (0, 1):  # the same prompt decoded greedily
        greedy = GenerationRequest("g", reqs[i].prompt_token_ids, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        assert res[reqs[i].request_id]["ids"] == solo(tiny, greedy)
    assert_pool_full(eng)


# ---------------------------------------------------------------- faults in one sequence

def nan_rows_for(eng: LLMEngine, victim: str, after_tokens: int) -> None:
    """Make the target's logits NaN for ``victim``'s rows once it has produced after_tokens."""
    forward = eng.runner.forward

    def poisoned(chunks, *a, **kw):
        logits = forward(chunks, *a, **kw).clone()
        row = 0
        for c in chunks:
            seq = eng.seqs.get(c.seq_id)
            if c.seq_id == victim and c.num_logits and seq is not None and seq.num_output >= after_tokens:
                logits[row : row + c.num_logits] = float("nan")
            row += c.num_logits
        return logits

    eng.runner.forward = poisoned


@pytest.mark.parametrize("drafter", [None, "ngram", "draft"])
def test_nan_logits_fail_only_their_sequence(tiny, drafter):
    reqs = requests(mixed_params())
    eng = engine(tiny, "default" if drafter == "draft" else drafter, 3,
                 draft_model(tiny) if drafter == "draft" else None)
    nan_rows_for(eng, "r3", after_tokens=4)
    res = run_to_completion(eng, reqs)
    bad = res["r3"]
    assert bad["finish"] is FinishReason.ERROR
    assert 4 <= len(bad["ids"]) < MAX_TOKENS
    assert bad["ids"] == solo(tiny, reqs[3])[: len(bad["ids"])]  # what it streamed was right
    for r in reqs[:2]:
        assert res[r.request_id]["finish"] is FinishReason.LENGTH
        assert res[r.request_id]["ids"] == solo(tiny, r), r.request_id
    assert res["r2"]["finish"] is FinishReason.LENGTH and len(res["r2"]["ids"]) == MAX_TOKENS
    assert_pool_full(eng)


def test_error_output_carries_a_message_without_traceback(tiny):
    eng = engine(tiny, "ngram")
    nan_rows_for(eng, "r0", after_tokens=2)
    errors = []
    for r in requests(mixed_params()[:2]):
        eng.add_request(r)
    while eng.has_work():
        errors += [o for o in eng.step() if o.finished and o.request_id == "r0"]
    (out,) = errors
    assert out.finish_reason is FinishReason.ERROR
    assert "non-finite" in out.error and "Traceback" not in out.error and "\n" not in out.error


class _BrokenDetok:
    def add(self, token_id):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")

    def flush(self):
        return ""


def test_detokenizer_fault_fails_only_its_sequence(tiny):
    reqs = requests(mixed_params())
    eng = engine(tiny, "ngram")
    for r in reqs:
        eng.add_request(r)
    eng.seqs["r1"].detok = _BrokenDetok()
    res = run_to_completion(eng, [])
    assert res["r1"]["finish"] is FinishReason.ERROR
    for r in (reqs[0], reqs[3]):
        assert res[r.request_id]["ids"] == solo(tiny, r)
    assert_pool_full(eng)


class FaultyDrafter:
    """Wraps a drafter; for ``victim`` it answers q of the wrong width, or raises."""

    def __init__(self, inner, victim: str, mode: str) -> None:
        self.inner, self.victim, self.mode = inner, victim, mode
        self.kind = inner.kind
        self.runner = getattr(inner, "runner", None)

    def propose(self, inputs):
        if self.mode == "raise" and any(i.seq_id == self.victim for i in inputs):
            raise RuntimeError("drafter bug for this sequence")
        got = self.inner.propose(inputs)
        probs = list(got.draft_probs)
        for j, inp in enumerate(inputs):
            if inp.seq_id == self.victim and got.draft_token_ids[j]:
                probs[j] = torch.full((len(got.draft_token_ids[j]), self.runner.vocab_size + 7), 1e-3)
        return DraftProposal(got.draft_token_ids, probs)

    def release(self, seq_id):
        self.inner.release(seq_id)


@pytest.mark.parametrize("mode", ["wide_q", "raise"])
def test_draft_faults_cost_only_that_sequences_drafts(tiny, mode):
    reqs = requests(mixed_params())
    reqs[2].params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=13, ignore_eos=True)
    drafter = FaultyDrafter(draft_model(tiny), "r1", mode)
    eng = engine(tiny, "default", 3, drafter)
    res = run_to_completion(eng, reqs)
    for r in reqs:  # all deterministic: each equals its plain solo run, the victim included
        assert res[r.request_id]["finish"] is FinishReason.LENGTH
        assert res[r.request_id]["ids"] == solo(tiny, r), r.request_id
    assert res["r1"]["spec"].accepted_tokens == 0
    assert res["r0"]["spec"].accepted_tokens > 0 and res["r3"]["spec"].accepted_tokens > 0
    assert eng.stats().draft_fallbacks > 0
    assert_pool_full(eng)
    assert drafter.runner.kv.num_free_blocks == drafter.runner.kv.num_blocks


def test_forward_failure_fails_the_step_with_a_message_and_the_engine_recovers(tiny):
    eng = engine(tiny, "ngram")
    forward = eng.runner.forward
    calls = {"n": 0}

    def flaky(chunks, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost\nsecond line")
        return forward(chunks, *a, **kw)

    eng.runner.forward = flaky
    reqs = requests(mixed_params()[:2])
    outs = []
    for r in reqs:
        eng.add_request(r)
    while eng.has_work():
        outs += eng.step()
    errors = [o for o in outs if o.finished]
    assert {o.finish_reason for o in errors} == {FinishReason.ERROR}
    assert all(o.error == "internal error in the model forward pass: RuntimeError: device lost" for o in errors)
    assert_pool_full(eng)
    again = run_to_completion(eng, [GenerationRequest("again", reqs[0].prompt_token_ids, reqs[0].params)])
    assert again["again"]["ids"] == solo(tiny, reqs[0])


def test_step_loop_failure_reaches_the_caller_with_a_message(tiny):
    from cluster.engine.async_engine import AsyncEngine
    from tests.engine.helpers import consume_stream

    eng = engine(tiny)
    step = eng.step
    calls = {"n": 0}

    def broken_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyError("scheduler bug")
        return step()

    eng.step = broken_step
    ae = AsyncEngine(eng.config, engine=eng)

    async def main():
        ae.start_sync()
        try:
            return await consume_stream(ae, requests(mixed_params()[:1])[0])
        finally:
            await ae.shutdown()

    _, _, last = asyncio.run(main())
    assert last.finish_reason is FinishReason.ERROR
    assert last.error == "internal error in the engine step: KeyError: 'scheduler bug'"


# ---------------------------------------------------------------- seeds: path independence

SEEDED = [SamplingParams(max_tokens=MAX_TOKENS, temperature=t, top_k=tk, top_p=tp, seed=s, ignore_eos=True)
          for s, t, tk, tp in [(1, 0.9, 0, 1.0), (2, 0.4, 8, 1.0), (3, 1.2, 0, 0.9), (4, 0.6, 4, 0.95)]]


def test_seeded_output_is_the_same_on_every_path_and_k(tiny):
    reqs = requests(SEEDED) + [GenerationRequest("unseeded", PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0))]
    plain = run_to_completion(engine(tiny), reqs)
    expected = {r.request_id: plain[r.request_id]["ids"] for r in reqs[:4]}
    assert len({tuple(v) for v in expected.values()}) == 4
    accepted = {}
    for drafter, num_draft_tokens in (("ngram", (1, 2, 3, 4)), ("draft", (1, 2, 3, 4)), ("self:1", (3,))):
        for k in num_draft_tokens:
            eng = engine(tiny, "default" if drafter == "draft" else drafter, k,
                         draft_model(tiny) if drafter == "draft" else None)
            res = run_to_completion(eng, reqs)
            got = {r.request_id: res[r.request_id]["ids"] for r in reqs[:4]}
            assert got == expected, (drafter, k)
            accepted[drafter, k] = sum(res[r.request_id]["spec"].accepted_tokens for r in reqs[:4])
            assert_pool_full(eng)
    # Drafting with the request's own noise: the target as its draft agrees on every token.
    assert all(accepted["draft", k] > 0 for k in (1, 2, 3, 4)), accepted
    eng = engine(tiny, "default", 3, draft_model(tiny))
    res = run_to_completion(eng, reqs[:4])
    assert all(res[r.request_id]["spec"].acceptance_rate == 1.0 for r in reqs[:4])
