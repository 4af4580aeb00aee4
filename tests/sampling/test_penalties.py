"""Logit bias, presence / frequency penalties, repetition penalty, min_tokens and stop_token_ids:
the unit (``penalize`` on hand-made rows) and the contract through the engine on the real default
model — greedy output under them equals Hugging Face ``generate`` with the same shaping (written here
as a logits processor, or HF's own ``repetition_penalty``, ``min_new_tokens`` and ``eos_token_id``
list: independent implementations), on the plain path, n-gram at K = 4 and the portfolio at auto K; they change the
output; seeded sampling under them gives the same tokens on every path."""
from __future__ import annotations

import pytest
import torch

from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.request import GenerationRequest, SamplingParams, SpecMode
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.speculation import build_spec_controller
from cluster.sampling.penalties import SeenTokens, penalize
from tests.engine.helpers import prompt_ids, run_to_completion
from tests.reference import NEAR_TIE_GAP, workload_rows

MAX_TOKENS = 24
# HF's answers and the plain engine's do not depend on the drafter a parametrization tries:
# computed once per (what, prompt, params) for the module
_ONCE: dict[tuple, object] = {}


def _once(key: tuple, compute):
    if key not in _ONCE:
        _ONCE[key] = compute()
    return _ONCE[key]


def test_penalize_counts_the_output_and_the_drafts_before_each_row():
    rows = torch.zeros(3, 6)
    p = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, logit_bias=((5, -2.0), (0, 0.5)))
    out = penalize(rows, p, output_ids=[1, 1, 2], drafts=[2, 3])
    assert out[0].tolist() == [0.5, -2.0, -1.5, 0.0, 0.0, -2.0]
    assert out[1].tolist() == [0.5, -2.0, -2.0, 0.0, 0.0, -2.0]  # after draft 2: two 2s
    assert out[2].tolist() == [0.5, -2.0, -2.0, -1.5, 0.0, -2.0]  # after drafts 2, 3
    assert bool((rows == 0).all())
    neg = penalize(torch.zeros(1, 3), SamplingParams(presence_penalty=-1.0), [2], [])
    assert neg[0].tolist() == [0.0, 0.0, 1.0]  # a negative penalty favours repeats


def test_repetition_penalty_scales_the_prompt_output_and_each_rows_drafts_once_before_the_bias():
    rows = torch.tensor([[2.0, -2.0, 1.0, 0.0, 3.0, -1.0]]).repeat(3, 1)
    p = SamplingParams(repetition_penalty=2.0, logit_bias=((0, 1.0),))
    out = penalize(rows, p, output_ids=[1, 1], drafts=[4, 4], seen=SeenTokens.of([0, 0, 3, 1, 1]))
    assert out[0].tolist() == [2.0, -4.0, 1.0, 0.0, 3.0, -1.0]  # 2 / 2 then + 1; -2 * 2 (once, though twice)
    assert out[1].tolist() == [2.0, -4.0, 1.0, 0.0, 1.5, -1.0]  # after draft 4
    assert out[2].tolist() == [2.0, -4.0, 1.0, 0.0, 1.5, -1.0]  # 4 drafted twice: still once
    assert bool((rows[0] == torch.tensor([2.0, -2.0, 1.0, 0.0, 3.0, -1.0])).all())  # rows not written
    below = penalize(torch.tensor([[2.0, -2.0]]), SamplingParams(repetition_penalty=0.5), [0, 1], [],
                     seen=SeenTokens.of([0, 1]))
    assert below[0].tolist() == [4.0, -1.0]  # below 1: repeats favoured
    assert SamplingParams(repetition_penalty=1.1).shapes_logits and not SamplingParams().shapes_logits
    with pytest.raises(ValueError, match="needs the sequence's seen tokens"):
        penalize(rows, p, [1], [4, 4])


def test_seen_tokens_fold_in_only_what_was_appended():
    seen = SeenTokens.of([5, 3, 5])
    assert seen.ids == {3, 5} and seen.tensor.tolist() == [5, 3] and seen.length == 3
    assert seen.follow([5, 3, 5, 3, 9]).tensor.tolist() == [5, 3, 9] and seen.length == 5
    tensor = seen.tensor
    assert seen.follow([5, 3, 5, 3, 9]).tensor is tensor  # nothing appended: nothing rebuilt
    assert seen.follow([7]).ids == {7} and seen.tensor.tolist() == [7]  # shorter: another sequence, start over


def test_min_tokens_masks_the_ends_of_the_rows_below_it():
    inf = float("-inf")
    p = SamplingParams(max_tokens=9, min_tokens=3, stop_token_ids=(4,))
    out = penalize(torch.zeros(3, 6), p, output_ids=[1], drafts=[2, 3], eos_ids=frozenset({5}))
    assert out[0].tolist() == [0.0, 0.0, 0.0, 0.0, inf, inf]  # position 1: EOS and the stop id held back
    assert out[1].tolist() == [0.0, 0.0, 0.0, 0.0, inf, inf]  # position 2
    assert out[2].tolist() == [0.0] * 6  # position 3: the output may end
    ignoring = SamplingParams(max_tokens=9, min_tokens=3, ignore_eos=True)
    assert penalize(torch.zeros(1, 6), ignoring, [], [], frozenset({5}))[0].tolist() == [0.0] * 6  # EOS ends nothing


class _OpenAIShaping:
    """HF logits processor: OpenAI's logit bias and penalties over the generated tokens."""

    def __init__(self, prompt_len: int, params: SamplingParams) -> None:
        self.prompt_len, self.p = prompt_len, params

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for token, bias in self.p.logit_bias:
            scores[:, token] += bias
        for t in set(input_ids[0, self.prompt_len:].tolist()):
            count = int((input_ids[0, self.prompt_len:] == t).sum())
            scores[:, t] -= self.p.presence_penalty + self.p.frequency_penalty * count
        return scores


def _hf_shaped(hf_model, eos, prompt: list[int], params: SamplingParams):
    """HF greedy with the request's shaping: its bias and penalties (the processor above), its
    min_tokens as HF's ``min_new_tokens`` and its stop_token_ids as more end-of-sequence ids."""
    from transformers import LogitsProcessorList

    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                                max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=eos[0],
                                eos_token_id=eos + list(params.stop_token_ids), min_new_tokens=params.min_tokens,
                                logits_processor=LogitsProcessorList([_OpenAIShaping(len(prompt), params)]),
                                output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [s[0] for s in out.scores]


def _same_or_near_tie(ours: list[int], ref: list[int], scores) -> bool:
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = torch.topk(scores[i].float(), 2)
            return a == int(top2.indices[1]) and float(top2.values[0] - top2.values[1]) < NEAR_TIE_GAP
    return len(ours) == len(ref)


def _engine(model, drafter, k) -> LLMEngine:
    spec = SpecConfig(drafter=drafter, num_draft_tokens=k) if drafter else None
    config = EngineConfig(spec=spec) if spec else EngineConfig()
    m = model.with_fresh_kv(config)
    return LLMEngine(config, m, build_spec_controller(config, m) if spec else None)


SHAPES = [SamplingParams(max_tokens=MAX_TOKENS, presence_penalty=0.8, frequency_penalty=0.6),
          SamplingParams(max_tokens=MAX_TOKENS, frequency_penalty=-0.7, logit_bias=((28, 4.0), (30, -100.0))),
          SamplingParams(max_tokens=MAX_TOKENS, presence_penalty=2.0, logit_bias=((216, 2.0),))]


def _hf_repetition(hf_model, eos, prompt: list[int], params: SamplingParams):
    """HF greedy with HF's own repetition penalty (over prompt and output, as ours)."""
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                                max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=eos[0], eos_token_id=eos,
                                repetition_penalty=params.repetition_penalty, output_scores=True,
                                return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [s[0] for s in out.scores]


REPETITION = (1.3, 1.15, 0.85)  # above 1 discourages repeats, below 1 favours them
# shaping -> (request i's params, HF's greedy under them): OpenAI's bias and penalties through the
# processor above; vLLM's repetition_penalty through HF's own, min_p beside it on every other request
# (greedy takes the most likely token whatever the cut)
SHAPINGS = {
    "openai": (lambda i: SHAPES[i % len(SHAPES)], _hf_shaped),
    "repetition": (lambda i: SamplingParams(max_tokens=MAX_TOKENS, repetition_penalty=REPETITION[i % 3],
                                            min_p=0.2 if i % 2 else 0.0), _hf_repetition),
}


@pytest.mark.parametrize("shaping", list(SHAPINGS))
@pytest.mark.parametrize("drafter,k", [(None, 0), ("ngram", 4), ("portfolio", "auto")])
def test_greedy_under_shaping_equals_hf_on_every_path(default_model, hf_reference, drafter, k, shaping):
    params_of, hf_greedy = SHAPINGS[shaping]
    rows = workload_rows(per_segment=1)
    tok = default_model.tokenizer
    reqs = [GenerationRequest(f"p{i}", prompt_ids(tok, row), params_of(i), segment=row["segment"])
            for i, row in enumerate(rows)]
    if drafter is not None:
        reqs[0].mode = SpecMode.PLAIN  # a plain row beside the speculating ones
    eng = _engine(default_model, drafter, k)
    res = run_to_completion(eng, reqs)
    plain = _once(("plain", tuple((r.request_id, tuple(r.prompt_token_ids)) for r in reqs)), lambda: run_to_completion(
        _engine(default_model, None, 0),
        [GenerationRequest(r.request_id, r.prompt_token_ids, SamplingParams(max_tokens=MAX_TOKENS)) for r in reqs]))
    eos = sorted(default_model.eos_token_ids)
    for r in reqs:
        want, scores = _once((shaping, tuple(r.prompt_token_ids), repr(r.params)), lambda: hf_greedy(
            hf_reference.model, eos, r.prompt_token_ids, r.params))
        assert _same_or_near_tie(res[r.request_id]["ids"], want, scores), (r.request_id, res[r.request_id]["ids"], want)
    assert sum(res[r.request_id]["ids"] != plain[r.request_id]["ids"] for r in reqs) >= len(reqs) // 2  # they shape
    if drafter is not None:
        assert sum(res[r.request_id]["spec"].accepted_tokens for r in reqs[1:]) > 10  # accepted drafts among them
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks


@pytest.mark.parametrize("vllm_shaping", [False, True], ids=["openai", "repetition-min-p"])
def test_seeded_sampling_under_penalties_is_the_same_on_every_path(default_model, vllm_shaping):
    ids = prompt_ids(default_model.tokenizer, workload_rows(per_segment=1)[0])
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=11, presence_penalty=1.0, frequency_penalty=0.5,
                            logit_bias=((28, 3.0),))
    if vllm_shaping:
        params = SamplingParams(max_tokens=20, temperature=0.9, seed=11, repetition_penalty=1.2, min_p=0.05,
                                ignore_eos=True)
    outs = [run_to_completion(_engine(default_model, d, k), [GenerationRequest("s", ids, params)])["s"]["ids"]
            for d, k in ((None, 0), ("ngram", 4), ("portfolio", "auto"))]
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 20


@pytest.mark.parametrize("drafter,k", [(None, 0), ("ngram", 4), ("portfolio", "auto")])
def test_greedy_min_tokens_and_stop_token_ids_equal_hf_on_every_path(default_model, hf_reference, drafter, k):
    """Each prompt's own greedy answer picks the shaping: a stop id from its third token (so it
    would stop there) held back by min_tokens 6, and min_tokens past where the answer ended (EOS
    held back); HF's min_new_tokens / eos_token_id list decide the reference."""
    short = [{"segment": "chat", "chat": True, "prompt": p} for p in ("Say hi.", "Is the sky blue? Yes or no.")]
    rows = workload_rows(per_segment=1) + short  # answers that end (EOS) inside the budget
    tok = default_model.tokenizer
    prompts = {f"p{i}": prompt_ids(tok, row) for i, row in enumerate(rows)}
    natural = _once(("natural", tuple((r, tuple(ids)) for r, ids in prompts.items())), lambda: run_to_completion(
        _engine(default_model, None, 0),
        [GenerationRequest(r, ids, SamplingParams(max_tokens=MAX_TOKENS)) for r, ids in prompts.items()]))
    eos = sorted(default_model.eos_token_ids)
    reqs = []
    for i, (rid, ids) in enumerate(prompts.items()):
        nat = natural[rid]["ids"]
        if i % 2 == 0 and len(nat) > 3 and nat[2] not in eos and i < len(rows) - len(short):
            params = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(nat[2],), min_tokens=6)
        else:
            params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=min(MAX_TOKENS, len(nat) + 4))
        reqs.append(GenerationRequest(rid, ids, params, segment=rows[i]["segment"]))
    assert any(r.params.stop_token_ids for r in reqs)
    assert any(natural[r.request_id]["ids"][-1] in eos for r in reqs if not r.params.stop_token_ids)  # EOS held
    res = run_to_completion(_engine(default_model, drafter, k), reqs)
    for r in reqs:
        want, scores = _once(("openai", tuple(r.prompt_token_ids), repr(r.params)), lambda: _hf_shaped(
            hf_reference.model, eos, r.prompt_token_ids, r.params))
        got = res[r.request_id]["ids"]
        assert _same_or_near_tie(got, want, scores), (r.request_id, got, want)
        assert len(got) >= r.params.min_tokens and not set(got[: r.params.min_tokens]) & set(eos)
        if r.params.stop_token_ids and got[-1] == r.params.stop_token_ids[0] and len(got) < MAX_TOKENS:
            assert res[r.request_id]["finish"].name == "STOP"


def test_a_stop_string_ending_under_min_tokens_does_not_stop(default_model):
    """Stop strings change no token: with min_tokens 8, the output is the greedy answer cut at the
    first stop string that ends past its first 7 tokens' text (one ending earlier is text)."""
    tok = default_model.tokenizer
    ids = prompt_ids(tok, workload_rows(per_segment=1)[0])
    nat = run_to_completion(_engine(default_model, None, 0),
                            [GenerationRequest("n", ids, SamplingParams(max_tokens=MAX_TOKENS))])["n"]
    early = tok.decode(nat["ids"][:7], skip_special_tokens=True)
    stop = next(w for w in early.split() if len(w) >= 2)  # occurs inside the first 7 tokens' text
    got = run_to_completion(_engine(default_model, "ngram", 4), [GenerationRequest(
        "m", ids, SamplingParams(max_tokens=MAX_TOKENS, stop=(stop,), min_tokens=8))])["m"]
    at = nat["text"].find(stop, max(0, len(early) - len(stop) + 1))
    assert got["text"] == (nat["text"] if at < 0 else nat["text"][:at])
    assert len(got["ids"]) >= 8 and got["ids"] == nat["ids"][: len(got["ids"])]
    plain_stop = run_to_completion(_engine(default_model, None, 0), [GenerationRequest(
        "s", ids, SamplingParams(max_tokens=MAX_TOKENS, stop=(stop,)))])["s"]
    assert len(plain_stop["ids"]) <= 7  # without min_tokens the early one stops it
