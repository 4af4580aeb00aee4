"""Log-probabilities of output tokens: the unit (``token_logprobs`` on hand-made rows) and the
contract through the engine on the real default model — each output token's log-probability and
its top alternatives equal Hugging Face's log-softmax of the target's raw logits at that position,
whatever path committed the token (plain, n-gram at K = 4, the portfolio at auto K, a prediction,
under a grammar, sampled with a seed), and asking for them changes no token."""
from __future__ import annotations

import math

import pytest
import torch

from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.errors import InvalidRequestError
from cluster.common.request import (
    Constraint, ConstraintKind, FinishReason, GenerationRequest, Logprob, MAX_LOGPROBS, SamplingParams, SpecMode,
)
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.speculation import build_spec_controller
from cluster.sampling.logprobs import token_logprobs
from tests.engine.helpers import prompt_ids
from tests.reference import workload_rows

TOL = 2e-3  # float32 log-softmax of logits computed in different batch shapes


def test_token_logprobs_are_the_rows_log_softmax_and_its_top():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])  # [2, 4]
    out = token_logprobs(logits, [1, 2], 2)
    ref = torch.log_softmax(logits, dim=-1)
    assert [o.chosen.token_id for o in out] == [1, 2]
    assert out[0].chosen.logprob == pytest.approx(float(ref[0, 1]))
    assert out[1].chosen.logprob == pytest.approx(float(ref[1, 2]))
    assert [t.token_id for t in out[0].top] == [0, 1] and [t.token_id for t in out[1].top][0] == 2
    assert out[0].top[0].logprob == pytest.approx(float(ref[0, 0]))
    assert all(o.chosen.token == b"" for o in out)  # bytes are the service's, next to the tokenizer
    assert token_logprobs(logits, [3, 0], 0)[0].top == ()
    assert sum(math.exp(t.logprob) for t in token_logprobs(logits, [0, 0], 4)[0].top) == pytest.approx(1.0)


def test_a_non_finite_row_has_no_logprob():
    with pytest.raises(ValueError, match="not finite"):
        token_logprobs(torch.tensor([[float("nan"), 0.0]]), [1], 0)


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 1.5, "3"])
def test_logprobs_outside_0_to_max_are_refused(bad):
    with pytest.raises(InvalidRequestError, match="logprobs"):
        SamplingParams(logprobs=bad)


def _engine(model, drafter=None, k=4) -> LLMEngine:
    spec = SpecConfig(drafter=drafter, num_draft_tokens=k) if drafter else None
    config = EngineConfig(spec=spec) if spec else EngineConfig()
    m = model.with_fresh_kv(config)
    return LLMEngine(config, m, build_spec_controller(config, m) if spec else None)


def _run(engine, reqs) -> dict[str, dict]:
    res = {r.request_id: {"ids": [], "lp": [], "spec": None} for r in reqs}
    asked = {r.request_id: r.params.logprobs is not None for r in reqs}
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        for out in engine.step():  # every delta carries one entry per new token, or none if not asked
            assert len(out.logprobs) == (len(out.new_token_ids) if asked[out.request_id] else 0)
            res[out.request_id]["ids"] += out.new_token_ids
            res[out.request_id]["lp"] += out.logprobs
            if out.finished:
                res[out.request_id]["spec"] = out.spec
    assert engine.runner.kv.num_free_blocks == engine.runner.kv.num_blocks
    return res


_HF_ROWS: dict[tuple, torch.Tensor] = {}  # (prompt, output) -> rows: every path commits the same greedy tokens


def _hf_logprobs(hf_model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V] HF's log-softmax of the target's raw logits at each output position
    (computed once per prompt and output for the module)."""
    key = (tuple(prompt), tuple(output))
    if key not in _HF_ROWS:
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt + output])).logits[0].float()  # [P + N, V]
        _HF_ROWS[key] = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(output)], dim=-1)
    return _HF_ROWS[key]


def _check_against_hf(hf_model, prompt, got, num_top):
    ref = _hf_logprobs(hf_model, prompt, got["ids"])  # [N, V]
    assert len(got["lp"]) == len(got["ids"]) > 0
    for i, (t, lp) in enumerate(zip(got["ids"], got["lp"], strict=True)):
        assert lp.chosen.token_id == t
        assert lp.chosen.logprob == pytest.approx(float(ref[i, t]), abs=TOL), f"position {i}"
        assert len(lp.top) == num_top
        want = torch.topk(ref[i], num_top).values.tolist()
        assert [a.logprob for a in lp.top] == pytest.approx(want, abs=TOL), f"position {i}"
        for a in lp.top:  # each alternative is the token it names (ids may swap only within a tie)
            assert a.logprob == pytest.approx(float(ref[i, a.token_id]), abs=TOL)


@pytest.fixture(scope="module")
def rows():
    return workload_rows(per_segment=1)


@pytest.mark.parametrize("drafter,k", [(None, 0), ("ngram", 4), ("portfolio", "auto")])
def test_logprobs_equal_hf_on_every_path_and_change_no_token(default_model, hf_reference, rows, drafter, k):
    tok = default_model.tokenizer
    reqs, plain = [], []
    for i, row in enumerate(rows):
        ids = prompt_ids(tok, row)
        n = (0, 1, 5, MAX_LOGPROBS)[i % 4]
        reqs.append(GenerationRequest(f"lp{i}", ids, SamplingParams(max_tokens=24, logprobs=n), segment=row["segment"]))
        plain.append(GenerationRequest(f"lp{i}", ids, SamplingParams(max_tokens=24), segment=row["segment"]))
    if drafter is not None:
        reqs[-1].mode = SpecMode.PLAIN  # a plain row beside the speculating ones
    with_lp = _run(_engine(default_model, drafter, k), reqs)
    without = _run(_engine(default_model, drafter, k), plain)
    if drafter is not None:  # the reported values include tokens that were accepted drafts
        assert sum(v["spec"].accepted_tokens for v in with_lp.values() if v["spec"] is not None) > 10
    for r in reqs:
        assert with_lp[r.request_id]["ids"] == without[r.request_id]["ids"]
        assert without[r.request_id]["lp"] == []
        _check_against_hf(hf_reference.model, r.prompt_token_ids, with_lp[r.request_id], r.params.logprobs)


def test_logprobs_with_a_prediction_a_grammar_and_a_seed(default_model, hf_reference, rows):
    """A prediction's drafts, a grammar's masked verification and seeded sampling commit tokens
    whose reported log-probability is still the raw target's (not the masked or tempered one)."""
    tok = default_model.tokenizer
    ids = prompt_ids(tok, rows[0])
    eng = _engine(default_model, "portfolio", "auto")
    greedy = _run(_engine(default_model), [GenerationRequest("g", ids, SamplingParams(max_tokens=24))])["g"]["ids"]
    reqs = [
        GenerationRequest("pred", ids, SamplingParams(max_tokens=24, logprobs=3), prediction_token_ids=tuple(greedy)),
        GenerationRequest("re", ids, SamplingParams(max_tokens=12, logprobs=2),
                          constraint=Constraint(ConstraintKind.REGEX, "[a-z ]{4,40}")),
        GenerationRequest("seed", ids, SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=7, logprobs=2)),
    ]
    res = _run(eng, reqs)
    assert res["pred"]["ids"] == greedy
    assert eng.stats().drafter_steps["prediction"]["accepted_tokens"] > 0
    for r in reqs:
        _check_against_hf(hf_reference.model, ids, res[r.request_id], r.params.logprobs)


# -- prompt log-probabilities ------------------------------------------------------------------

def _chunked_engine(model, drafter=None, k=4, num_blocks=None, batched=24) -> LLMEngine:
    """An engine whose prefills run in chunks of at most ``batched`` tokens (a prompt's rows come
    from several passes), optionally with a KV pool of ``num_blocks`` (preemption)."""
    spec = SpecConfig(drafter=drafter, num_draft_tokens=k) if drafter else None
    config = EngineConfig(spec=spec, max_num_batched_tokens=batched)
    m = model.with_fresh_kv(config, num_blocks)
    return LLMEngine(config, m, build_spec_controller(config, m) if spec else None)


def _run_prompt(engine, reqs) -> dict[str, dict]:
    """Like _run, also collecting prompt_logprobs (and where they came: the first output only)."""
    res = {r.request_id: {"ids": [], "plp": [], "outputs": 0, "finish": None} for r in reqs}
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        for out in engine.step():
            got = res[out.request_id]
            if got["outputs"]:
                assert out.prompt_logprobs == [], "prompt log-probabilities ride on the first output only"
            got["outputs"] += 1
            got["ids"] += out.new_token_ids
            got["plp"] += out.prompt_logprobs
            if out.finished:
                got["finish"] = out.finish_reason
    assert engine.runner.kv.num_free_blocks == engine.runner.kv.num_blocks
    return res


def _check_prompt_against_hf(hf_model, prompt: list[int], plp, num_top: int) -> None:
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [P, V]
    assert len(plp) == len(prompt), "one entry per prompt token"
    assert plp[0].chosen == Logprob(prompt[0], None) and plp[0].top == (), "the first has nothing before it"
    for i, lp in enumerate(plp[1:]):
        t = prompt[i + 1]
        assert lp.chosen.token_id == t
        assert lp.chosen.logprob == pytest.approx(float(ref[i, t]), abs=TOL), f"prompt position {i + 1}"
        assert len(lp.top) == num_top
        assert [a.logprob for a in lp.top] == pytest.approx(torch.topk(ref[i], num_top).values.tolist(), abs=TOL)
        for a in lp.top:
            assert a.logprob == pytest.approx(float(ref[i, a.token_id]), abs=TOL)


@pytest.mark.parametrize("drafter,k", [(None, 0), ("ngram", 4)])
def test_prompt_logprobs_equal_hf_through_chunked_prefill_and_change_no_token(default_model, hf_reference, rows,
                                                                              drafter, k):
    """Prompts longer than the step's token budget (their rows come from 2+ passes, batched with
    other sequences' decode and verification rows): every prompt token after the first gets HF's
    log-softmax of the raw target at its position, on the first output only; a scoring request
    (max_tokens 0) gets them and no output; no request's tokens change."""
    tok = default_model.tokenizer
    reqs, plain = [], []
    for i, row in enumerate(rows[:4]):
        ids = prompt_ids(tok, row)
        assert len(ids) > 24
        n = (0, 3, MAX_LOGPROBS, 1)[i]
        max_tokens = 0 if i == 3 else 16
        reqs.append(GenerationRequest(f"p{i}", ids, SamplingParams(max_tokens=max_tokens, prompt_logprobs=n),
                                      segment=row["segment"]))
        if max_tokens:
            plain.append(GenerationRequest(f"p{i}", ids, SamplingParams(max_tokens=max_tokens), segment=row["segment"]))
    got = _run_prompt(_chunked_engine(default_model, drafter, k), reqs)
    want = _run_prompt(_chunked_engine(default_model, drafter, k), plain)
    for r in reqs:
        g = got[r.request_id]
        _check_prompt_against_hf(hf_reference.model, r.prompt_token_ids, g["plp"], r.params.prompt_logprobs)
        if r.params.max_tokens == 0:
            assert g["ids"] == [] and g["outputs"] == 1 and g["finish"] is FinishReason.LENGTH
        else:
            assert g["ids"] == want[r.request_id]["ids"] and want[r.request_id]["plp"] == []


def test_prompt_logprobs_are_reported_once_across_preemption(default_model, hf_reference, rows):
    """A tight KV pool preempts sequences mid-prefill and after it; the recompute does not report
    a prompt's log-probabilities again, and what is reported still equals HF."""
    tok = default_model.tokenizer
    picked = rows[:4]
    reqs = [GenerationRequest(f"q{i}", prompt_ids(tok, r), SamplingParams(max_tokens=24, ignore_eos=True,
                                                                          prompt_logprobs=1))
            for i, r in enumerate(picked)]
    expected = _run_prompt(_chunked_engine(default_model),
                           [GenerationRequest(r.request_id, r.prompt_token_ids, SamplingParams(max_tokens=24, ignore_eos=True))
                            for r in reqs])
    longest = max(len(r.prompt_token_ids) for r in reqs) + 24
    tight = _chunked_engine(default_model, num_blocks=-(-longest // 16) + 2)
    got = _run_prompt(tight, reqs)
    assert tight.scheduler.num_preemptions > 0
    for r in reqs:
        assert got[r.request_id]["ids"] == expected[r.request_id]["ids"]
        _check_prompt_against_hf(hf_reference.model, r.prompt_token_ids, got[r.request_id]["plp"], 1)


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(InvalidRequestError, match="needs prompt_logprobs"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=MAX_LOGPROBS + 1)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).scores_only


def test_a_one_token_prompt_has_only_its_first_entry(default_model):
    res = _run_prompt(_engine(default_model), [
        GenerationRequest("one", [default_model.tokenizer("Hi", add_special_tokens=False)["input_ids"][0]],
                          SamplingParams(max_tokens=0, prompt_logprobs=2))])
    assert [e.chosen.logprob for e in res["one"]["plp"]] == [None] and res["one"]["finish"] is FinishReason.LENGTH and res["one"]["outputs"] == 1


def test_a_prompt_that_cannot_be_scored_fails_alone(default_model, rows, monkeypatch):
    """A fault scoring one request's prompt (a non-finite row) finishes that request alone with an
    error, frees its KV, and leaves a request beside it unchanged."""
    tok = default_model.tokenizer
    ids = prompt_ids(tok, rows[0])
    want = _run_prompt(_chunked_engine(default_model), [GenerationRequest("ok", ids, SamplingParams(max_tokens=8))])
    real = LLMEngine._score_prompt

    def score(seq, positions, prompt_rows):
        if seq.seq_id == "bad":
            raise ValueError("the target's log-probability of token 5 is not finite (nan)")
        real(seq, positions, prompt_rows)

    monkeypatch.setattr(LLMEngine, "_score_prompt", staticmethod(score))
    eng = _chunked_engine(default_model)
    got = _run_prompt(eng, [GenerationRequest("ok", ids, SamplingParams(max_tokens=8, prompt_logprobs=0)),
                            GenerationRequest("bad", ids, SamplingParams(max_tokens=8, prompt_logprobs=0))])
    assert got["bad"]["finish"] is FinishReason.ERROR and got["bad"]["ids"] == []
    assert got["ok"]["ids"] == want["ok"]["ids"] and len(got["ok"]["plp"]) == len(ids)
