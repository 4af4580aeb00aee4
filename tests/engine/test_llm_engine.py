"""The engine on the real default model (SmolLM2-135M-Instruct): greedy equality with Hugging
Face generate for a concurrent batch over every workload segment, ragged joins/leaves,
preemption, and bad input."""
from __future__ import annotations

import pytest

from cluster.common.config import EngineConfig
from cluster.common.errors import InvalidRequestError
from cluster.common.request import FinishReason, GenerationRequest, SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.models.load import LoadedModel
from tests.engine.helpers import greedy_requests, prompt_ids, run_to_completion
from tests.reference import check_greedy_match, workload_rows

MAX_TOKENS = 32


def engine_on(model: LoadedModel, num_blocks: int | None = None, drafter: str | None = None, **cfg) -> LLMEngine:
    """A fresh engine (own KV pool) sharing the loaded weights; with ``drafter``, speculative (auto K)."""
    from cluster.common.config import SpecConfig
    from cluster.engine.speculation import build_spec_controller

    config = EngineConfig(spec=SpecConfig(drafter=drafter, num_draft_tokens="auto") if drafter else None, **cfg)
    m = model.with_fresh_kv(config, num_blocks)
    return LLMEngine(config, m, build_spec_controller(config, m) if drafter else None)


@pytest.fixture(scope="module")
def rows():
    r = workload_rows(per_segment=4)
    assert len(r) >= 24 and len({x["segment"] for x in r}) == 6
    return r


def test_greedy_equals_hf_generate_concurrent_batch(default_model, hf_reference, profile):
    """The first two prompts of every segment at once (short profile), the first four (long: the
    24-prompt set)."""
    eng = engine_on(default_model)
    batch = workload_rows(per_segment=profile.pick(short=2, long=4))
    reqs = greedy_requests(default_model.tokenizer, batch, MAX_TOKENS)
    res = run_to_completion(eng, reqs)
    verdicts = {}
    for req in reqs:
        ref = hf_reference.greedy(req.prompt_token_ids, MAX_TOKENS)
        verdicts[req.request_id] = check_greedy_match(res[req.request_id]["ids"], ref)
    assert sum(v == "equal" for v in verdicts.values()) >= len(reqs) - max(1, len(reqs) // 12), verdicts
    st = eng.stats()
    assert st.kv_blocks_free == st.kv_blocks_total and st.num_running == st.num_waiting == 0


def test_ragged_join_and_leave_match_solo_runs(default_model, rows):
    tok = default_model.tokenizer
    picked = [rows[0], rows[5], rows[13], rows[20]]
    lengths = [20, 8, 28, 14]
    reqs = [GenerationRequest(r["id"], prompt_ids(tok, r), SamplingParams(max_tokens=n))
            for r, n in zip(picked, lengths)]
    solo = {r.request_id: run_to_completion(engine_on(default_model), [r])[r.request_id]["ids"] for r in reqs}
    mixed = run_to_completion(engine_on(default_model), reqs,
                              join_at={reqs[1].request_id: 3, reqs[2].request_id: 6, reqs[3].request_id: 9})
    for r in reqs:
        assert mixed[r.request_id]["ids"] == solo[r.request_id], r.request_id
        assert len(solo[r.request_id]) <= lengths[reqs.index(r)]


def test_preemption_under_tiny_pool_gives_same_tokens(default_model, rows):
    tok = default_model.tokenizer
    picked = rows[:2] + rows[12:14]
    reqs = [GenerationRequest(r["id"], prompt_ids(tok, r), SamplingParams(max_tokens=24, ignore_eos=True))
            for r in picked]
    roomy = engine_on(default_model)
    expected = run_to_completion(roomy, reqs)
    longest = max(len(r.prompt_token_ids) for r in reqs) + 24
    blocks = -(-longest // 16) + 2  # the longest fits alone, two together barely
    tight = engine_on(default_model, num_blocks=blocks)
    reqs2 = [GenerationRequest(r.request_id, r.prompt_token_ids, r.params) for r in reqs]
    got = run_to_completion(tight, reqs2)
    assert tight.scheduler.num_preemptions > 0
    for r in reqs:
        assert got[r.request_id]["ids"] == expected[r.request_id]["ids"], r.request_id
    assert tight.runner.kv.num_free_blocks == blocks


def test_bad_input_is_rejected_and_engine_stays_healthy(default_model):
    eng = engine_on(default_model)
    tok = default_model.tokenizer
    good = tok("Hello", add_special_tokens=False)["input_ids"]
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        eng.add_request(GenerationRequest("e", [], SamplingParams()))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        GenerationRequest("m", good, SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequestError, match="exceeds the context length"):
        eng.add_request(GenerationRequest("c", good, SamplingParams(max_tokens=eng.max_model_len)))
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        eng.add_request(GenerationRequest("v", [10**6], SamplingParams()))
    from cluster.common.errors import ModelLoadError
    from cluster.models.loader import resolve_model

    with pytest.raises(ModelLoadError, match="unknown model"):
        resolve_model("no-such-model")
    res = run_to_completion(eng, [GenerationRequest("ok", good, SamplingParams(max_tokens=5))])
    assert len(res["ok"]["ids"]) == 5 and res["ok"]["finish"] is FinishReason.LENGTH
    assert not eng.seqs and eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks


def test_stop_conditions_and_cancel(default_model):
    eng = engine_on(default_model)
    tok = default_model.tokenizer
    ids = tok("Count: one, two, three, four, five,", add_special_tokens=False)["input_ids"]
    base = run_to_completion(eng, [GenerationRequest("b", ids, SamplingParams(max_tokens=12))])["b"]
    # stop at the first token id produced after the first one
    stop_id = base["ids"][2]
    r = run_to_completion(eng, [GenerationRequest("s", ids, SamplingParams(max_tokens=12, stop_token_ids=(stop_id,)))])["s"]
    assert r["finish"] is FinishReason.STOP and r["ids"] == base["ids"][: base["ids"].index(stop_id) + 1]
    word = base["text"].strip().split()[1] if len(base["text"].split()) > 1 else base["text"][:3]
    r = run_to_completion(eng, [GenerationRequest("w", ids, SamplingParams(max_tokens=12, stop=(word,)))])["w"]
    assert r["finish"] is FinishReason.STOP and word not in r["text"] and base["text"].startswith(r["text"])
    r = run_to_completion(eng, [GenerationRequest("x", ids, SamplingParams(max_tokens=50))], abort_at={"x": 3})["x"]
    assert r["finish"] is FinishReason.CANCELLED
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks


@pytest.mark.parametrize("drafter", [None, "portfolio"])
def test_prefix_caching_prefills_only_what_is_new_and_changes_no_token(default_model, hf_reference, rows, drafter):
    """A request sharing a prompt prefix with an earlier one (a conversation continued, another
    question under the same chat template) takes that prefix's full blocks from the cache and
    prefills the rest; its greedy output equals the engine's without prefix caching and Hugging
    Face generate's. Blocks the cache keeps count as free, and come back when needed. The same
    on the SpecEngine's default drafter (a portfolio whose EAGLE head reads the target's features
    of every position: the shared blocks' kept ones)."""
    tok = default_model.tokenizer
    eng = engine_on(default_model, drafter=drafter)
    first = GenerationRequest("first", prompt_ids(tok, rows[6]), SamplingParams(max_tokens=24))
    done = run_to_completion(eng, [first])
    assert done["first"]["cached"] == 0
    continued = first.prompt_token_ids + done["first"]["ids"] + prompt_ids(tok, {"prompt": " And then?"})
    later = [GenerationRequest("continued", continued, SamplingParams(max_tokens=MAX_TOKENS)),
             *greedy_requests(tok, [rows[13], rows[21]], MAX_TOKENS)]  # chat rows: the template's prefix
    res = run_to_completion(eng, later)
    bs = eng.runner.kv.block_size
    shared = len(first.prompt_token_ids) + len(done["first"]["ids"])  # K/V committed for all but the last
    assert res["continued"]["cached"] == (shared - 1) // bs * bs > 0
    template = next(i for i, (a, b) in enumerate(zip(first.prompt_token_ids, later[1].prompt_token_ids)) if a != b)
    assert res[later[1].request_id]["cached"] == template // bs * bs > 0  # the chat template's system prefix
    plain = run_to_completion(engine_on(default_model, drafter=drafter, prefix_caching=False), later)
    if drafter is not None:
        assert eng.runner.feature_tap is not None and res["continued"]["spec"].draft_tokens > 0
    for r in later:
        assert res[r.request_id]["ids"] == plain[r.request_id]["ids"], r.request_id
        assert plain[r.request_id]["cached"] == 0
        check_greedy_match(res[r.request_id]["ids"], hf_reference.greedy(r.prompt_token_ids, MAX_TOKENS))
    st = eng.stats()
    assert st.kv_blocks_free == st.kv_blocks_total and len(eng.runner.kv.prefix) > 0  # kept, yet free


@pytest.mark.parametrize("drafter", [None, "portfolio"])
def test_requests_admitted_in_one_step_share_the_blocks_it_fills_unless_it_fails(default_model, hf_reference, rows, drafter):
    """Chat requests arriving together share the chat template's system prefix at once: the first
    prefills it, the others take its blocks in the same step (their attention reads the keys the
    same forward writes first; on the default drafter the EAGLE head takes their features from the
    first's rows) and decode what Hugging Face generate does. A step whose forward fails leaves
    nothing indexed: no later request shares a block it never wrote."""
    tok = default_model.tokenizer
    together = greedy_requests(tok, [rows[13], rows[21], rows[20]], MAX_TOKENS)
    eng = engine_on(default_model, drafter=drafter)
    res = run_to_completion(eng, together)
    bs = eng.runner.kv.block_size

    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    assert res[together[0].request_id]["cached"] == 0
    for i, r in enumerate(together[1:], 1):  # the longest prefix it shares with one admitted before it
        shared = max(common(r.prompt_token_ids, e.prompt_token_ids) for e in together[:i])
        assert res[r.request_id]["cached"] == min(shared, len(r.prompt_token_ids) - 1) // bs * bs > 0, r.request_id
    for r in together:
        check_greedy_match(res[r.request_id]["ids"], hf_reference.greedy(r.prompt_token_ids, MAX_TOKENS))
    failing = engine_on(default_model, drafter=drafter)
    forward = failing.runner.forward

    def fail_once(chunks, *args, **kwargs):
        failing.runner.forward = forward
        raise RuntimeError("device lost")

    failing.runner.forward = fail_once
    failed = run_to_completion(failing, together)
    assert all(failed[r.request_id]["finish"] is FinishReason.ERROR for r in together)
    assert len(failing.runner.kv.prefix) == 0 and failing.runner.kv.num_free_blocks == failing.runner.kv.num_blocks
    again = run_to_completion(failing, together[:1])
    assert again[together[0].request_id]["cached"] == 0
    assert again[together[0].request_id]["ids"] == res[together[0].request_id]["ids"]


def test_prefix_caching_is_off_where_the_prefill_rows_are_needed(default_model):
    """A request owed its prompt's log-probabilities prefills its whole prompt (the rows are the
    values); one after it without them shares the prefix."""
    tok = default_model.tokenizer
    eng = engine_on(default_model)
    ids = prompt_ids(tok, {"prompt": "The quick brown fox jumps over the lazy dog. " * 4})
    run_to_completion(eng, [GenerationRequest("a", ids, SamplingParams(max_tokens=2))])
    scored = run_to_completion(eng, [GenerationRequest("s", ids, SamplingParams(max_tokens=2, prompt_logprobs=0))])
    again = run_to_completion(eng, [GenerationRequest("b", ids, SamplingParams(max_tokens=2))])
    assert scored["s"]["cached"] == 0 and again["b"]["cached"] > 0
