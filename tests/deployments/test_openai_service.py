"""The OpenAI-compatible HTTP API end to end: real Ray Serve (its HTTP proxy), real HTTP on
127.0.0.1, the official ``openai`` client; gRPC on the same app, same Router.

Two apps on the suite's shared Serve session (``serve_shared``): ``oa`` (the fake engine, auth on, small limits, a served
model name) and ``real`` (the default model SmolLM2-135M on the in-process engine, auth off), on
which greedy output through the OpenAI API equals gRPC's and Hugging Face ``generate``'s on both
paths, and stop strings and seeds act as they do over gRPC.
"""
import json
import re
import time

import grpc
import requests
import openai
import pytest

from cluster.common.config import EngineConfig
from cluster.engine.fake_engine import FakeEngine
from tests.deployments.harness import SHARED_ENV, SMALL, Client, fake_args
from tests.deployments.test_service_fake import engine_stats, wait_for

pytestmark = pytest.mark.ray
TOKEN = SHARED_ENV["SPECSERVE_OA_TOKEN"]
MODEL = "specserve-fake"
FAKE = FakeEngine(EngineConfig())  # its tokenizer and chat template (pure functions)


def fake_output(prompt_ids: list[int], n: int) -> str:
    """The fake target repeats the prompt cyclically."""
    return FAKE.detokenize([prompt_ids[i % len(prompt_ids)] for i in range(n)])


def chat_ids(text: str) -> list[int]:
    return FAKE.apply_chat_template([{"role": "user", "content": text}])


# a drafter that learns from traffic (each finished answer), without the shipped corpus: what it
# drafts from is this app's own traffic, in each request's draft scope
REAL = {"model": "default", "drafter": "suffix:cold", "num_draft_tokens": 4, "torch_threads": 1,
        "router_deployment": SMALL,
        "spec_engine": {**SMALL, "num_cpus": 0.2, "max_num_seqs": 4, "kv_cache_memory_mb": 64},
        "batch_engine": {**SMALL, "num_cpus": 0.2, "max_num_seqs": 4, "kv_cache_memory_mb": 64},
        "engine_impl": {"cls": "cluster.engine.async_engine:AsyncEngine"},
        "limits": {"max_tokens": 64, "max_prompt_tokens": 512}}


@pytest.fixture(scope="module")
def addrs(serve_shared):
    apps = {
        "oa": fake_args(
            auth={"token_env": "SPECSERVE_OA_TOKEN"}, http={"served_model_name": MODEL},
            limits={"max_tokens": 1000, "max_prompt_tokens": 48, "max_message_bytes": 4096, "max_queue": 8,
                    "max_stop_strings": 2},
            engine_impl={"cls": "cluster.engine.fake_engine:FakeEngine", "options": {"token_delay_s": 0.02}}),
        "real": REAL,
    }
    with serve_shared.apps(apps, timeout_s=400) as a:
        Client(a.grpc, "oa", TOKEN).wait_ready()
        Client(a.grpc, "real").wait_ready(timeout_s=400)
        yield a


@pytest.fixture(scope="module")
def oa(addrs):
    return openai.OpenAI(base_url=f"{addrs.http}/oa/v1", api_key=TOKEN, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def real(addrs):
    return openai.OpenAI(base_url=f"{addrs.http}/real/v1", api_key="unused", max_retries=0, timeout=300)


def test_health_models_and_auth(addrs, oa):
    r = requests.get(f"{addrs.http}/oa/health", timeout=30)  # no token: probes send none
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = requests.get(f"{addrs.http}/oa/v1/nothing", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"  # OpenAI's error shape
    r = requests.get(f"{addrs.http}/oa/v1/completions", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert [m.id for m in oa.models.list().data] == [MODEL]
    assert oa.models.retrieve(MODEL).id == MODEL  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError) as e:
        oa.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found" and "does not exist" in e.value.body["message"]
    anon = openai.OpenAI(base_url=f"{addrs.http}/oa/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        anon.models.list()
    assert e.value.status_code == 401 and e.value.body["message"] == "invalid bearer token"
    r = requests.post(f"{addrs.http}/oa/v1/completions", json={"prompt": "hi"}, timeout=30)  # no header
    assert r.status_code == 401
    assert r.json()["error"]["message"] == "missing 'authorization: Bearer <token>' metadata"
    assert r.json()["error"]["type"] == "authentication_error"


def test_chat_unary_equals_grpc(addrs, oa):
    text = "hello openai"
    r = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=20,
                                   temperature=0, extra_headers={"X-Request-Id": "my-label"})
    want = fake_output(chat_ids(text), 20)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(chat_ids(text)) and r.usage.completion_tokens == 20
    assert r.usage.total_tokens == r.usage.prompt_tokens + 20 and r.model == MODEL
    assert r.id.startswith("chatcmpl-") and abs(r.created - time.time()) < 120
    ss = r.model_extra["specserve"]
    assert ss["route"]["path"] == "speculative" and ss["route"]["reason"] and ss["label"] == "my-label"
    assert r.id == "chatcmpl-" + ss["request_id"] and ss["request_id"] != "my-label"  # the server names it
    assert ss["spec"]["draft_tokens"] > 0 and 0 < ss["spec"]["acceptance_rate"] <= 1
    pb = Client(addrs.grpc, "oa", TOKEN).pb2
    g = Client(addrs.grpc, "oa", TOKEN).generate(messages=[pb.ChatMessage(role="user", content=text)],
                                                 max_tokens=20)
    assert g.text == r.choices[0].message.content  # one Router, two front ends


def test_completions_string_and_token_ids_and_mode(oa):
    ids = FAKE.tokenize("abcdef")
    a = oa.completions.create(model=MODEL, prompt="abcdef", max_tokens=9, temperature=0)
    b = oa.completions.create(model=MODEL, prompt=ids, max_tokens=9, temperature=0,
                              extra_body={"mode": "plain", "segment": "code", "top_k": 5, "ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text == fake_output(ids, 9)
    assert a.object == "text_completion" and a.id.startswith("cmpl-")
    assert b.model_extra["specserve"]["route"] == {"path": "plain", "reason": "mode_plain"}
    assert b.model_extra["specserve"]["spec"] is None  # the plain path drafts nothing
    c = oa.completions.create(model=MODEL, prompt="xyz", max_tokens=5, n=1, user="u1")
    assert c.choices[0].text == fake_output(FAKE.tokenize("xyz"), 5)
    with pytest.raises(openai.BadRequestError) as e:  # a field we do not know: refused, never ignored
        oa.completions.create(model=MODEL, prompt="xyz", max_tokens=5, extra_body={"typical_p": 0.9})
    assert "unrecognized request argument supplied: typical_p" in e.value.body["message"]
    assert e.value.body["param"] == "typical_p"
    r = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "xyz"}], max_tokens=5,
                                   tool_choice="none", store=False, metadata={"k": "v"}, service_tier="auto",
                                   modalities=["text"])  # OpenAI's fields at their do-nothing values
    assert r.choices[0].message.content
    want = fake_output(chat_ids("xyz"), 12)
    p = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "xyz"}], max_tokens=12,
                                   prediction={"type": "content", "content": want[:-1] + "#"})
    assert p.choices[0].message.content == want  # the fake target's answer, prediction or not
    details = p.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (11, 1)


def test_chat_stream_with_usage(oa):
    text = "stream me"
    chunks = list(oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                             max_tokens=16, stream=True,
                                             stream_options={"include_usage": True}))
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    assert content[0].model_extra["specserve"]["route"]["path"] == "speculative"
    assert "".join(c.choices[0].delta.content or "" for c in content) == fake_output(chat_ids(text), 16)
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert content[-1].model_extra["specserve"]["spec"]["draft_tokens"] > 0
    assert all(c.usage is None for c in content)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 16
    assert usage.usage.prompt_tokens == len(chat_ids(text))
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_n_choices_unary_and_streamed(oa):
    """``n``: n engine requests on the request's route, one body; streamed, the events of the
    choices interleave, each choice's first carries the role and its last the finish reason."""
    text = "choose me"
    want = fake_output(chat_ids(text), 7)
    args = dict(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=7, n=3)
    r = oa.chat.completions.create(**args)
    assert [(c.index, c.message.content, c.finish_reason) for c in r.choices] == [(i, want, "length") for i in range(3)]
    assert r.usage.prompt_tokens == len(chat_ids(text)) and r.usage.completion_tokens == 21  # the prompt once
    assert r.model_extra["specserve"]["spec"]["draft_tokens"] > 0  # every choice's counters, summed
    chunks = list(oa.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    by_index: dict[int, list] = {}
    for c in chunks[:-1]:
        by_index.setdefault(c.choices[0].index, []).append(c.choices[0])
    assert sorted(by_index) == [0, 1, 2]
    for deltas in by_index.values():
        assert "".join(d.delta.content or "" for d in deltas) == want and deltas[0].delta.role == "assistant"
        assert [d.finish_reason for d in deltas][-1] == "length" and all(d.finish_reason is None for d in deltas[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 21
    comp = oa.completions.create(model=MODEL, prompt=text, max_tokens=5, n=2, logprobs=1)
    assert [c.index for c in comp.choices] == [0, 1] and comp.choices[0].text == comp.choices[1].text
    assert [c.logprobs.text_offset for c in comp.choices] == [[0, 1, 2, 3, 4]] * 2


def test_logprobs_through_the_official_client(oa):
    """chat's logprobs / top_logprobs and the completion's legacy logprobs, unary and streamed,
    parsed by the official client's own types: one entry per token of the text, bytes that spell
    it, the alternatives asked for (the fake engine's stand-in values: it drives the shapes; the
    values' contract is the engine's, against HF, in tests/sampling/test_logprobs.py)."""
    text = "log me"
    want = fake_output(chat_ids(text), 6)
    args = dict(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=6)
    r = oa.chat.completions.create(**args, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == want and "".join(c.token for c in content) == want
    assert bytes(b for c in content for b in c.bytes).decode() == want
    assert all(c.logprob == -0.25 and len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
               for c in content)
    assert oa.chat.completions.create(**args).choices[0].logprobs is None  # not asked: none
    streamed = [c for c in oa.chat.completions.create(**args, logprobs=True, stream=True) if c.choices]
    got = [e for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert "".join(e.token for e in got) == want and all(e.top_logprobs == [] for e in got)
    comp = oa.completions.create(model=MODEL, prompt=text, max_tokens=6, logprobs=2)
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text and lp.token_logprobs == [-0.25] * 6
    assert lp.text_offset == [0, 1, 2, 3, 4, 5] and all(len(t) == 2 for t in lp.top_logprobs)
    offsets = [o for c in oa.completions.create(model=MODEL, prompt=text, max_tokens=6, logprobs=0, stream=True)
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == [0, 1, 2, 3, 4, 5]  # the offsets run on across the stream's chunks


def test_echo_and_scoring_through_the_official_client_and_grpc(addrs, oa):
    """A completion's echo: the prompt's text, then the output's; with logprobs the prompt's tokens
    come first (the first with null log-probability and alternatives), unary and streamed; with
    max_tokens 0 the prompt alone, scored (lm-eval-harness's loglikelihood request); token ids are
    echoed as their text. gRPC's prompt_logprobs give one entry per prompt token after the first,
    max_tokens 0 scores only. Stand-in values from the fake engine: the shapes are checked here, the
    values against HF in tests/sampling/test_logprobs.py."""
    text = "echo me"
    want = fake_output(FAKE.tokenize(text), 4)
    comp = oa.completions.create(model=MODEL, prompt=text, max_tokens=4, echo=True, logprobs=1)
    c = comp.choices[0]
    assert c.text == text + want and comp.usage.completion_tokens == 4 and comp.usage.prompt_tokens == len(text)
    assert "".join(c.logprobs.tokens) == c.text and c.logprobs.text_offset == list(range(len(c.text)))
    assert c.logprobs.token_logprobs == [None] + [-0.25] * (len(c.text) - 1)
    assert c.logprobs.top_logprobs[0] is None and all(len(t) == 1 for t in c.logprobs.top_logprobs[1:])
    assert oa.completions.create(model=MODEL, prompt=text, max_tokens=4, echo=True).choices[0].text == text + want
    streamed = list(oa.completions.create(model=MODEL, prompt=text, max_tokens=4, echo=True, logprobs=0, stream=True))
    assert streamed[0].choices[0].text.startswith(text) and "".join(e.choices[0].text for e in streamed) == c.text
    assert [o for e in streamed for o in e.choices[0].logprobs.text_offset] == list(range(len(c.text)))
    scored = oa.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0)
    s0 = scored.choices[0]
    assert (s0.text, s0.finish_reason, scored.usage.completion_tokens) == (text, "length", 0)
    assert s0.logprobs.tokens == list(text) and s0.logprobs.token_logprobs == [None] + [-0.25] * (len(text) - 1)
    assert scored.model_extra["specserve"]["route"] == {"path": "plain", "reason": "scoring"}  # nothing to draft
    ids = oa.completions.create(model=MODEL, prompt=FAKE.tokenize(text), max_tokens=2, echo=True)
    assert ids.choices[0].text == text + want[:2] and ids.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="max_tokens 0 needs echo"):
        oa.completions.create(model=MODEL, prompt=text, max_tokens=0)
    c = Client(addrs.grpc, "oa", TOKEN)
    g = c.generate(prompt=text, max_tokens=0, prompt_logprobs=2)
    assert (g.text, list(g.token_ids), g.finish_reason, g.usage.completion_tokens) == ("", [], 1, 0)
    assert (g.route.path, g.route.reason) == (2, "scoring")
    assert [e.chosen.token for e in g.prompt_logprobs] == [b.encode() for b in text[1:]]
    assert all(len(e.top) == 2 for e in g.prompt_logprobs)
    chunks = list(c.stream(prompt=text, max_tokens=3, prompt_logprobs=0))
    assert len(chunks[0].prompt_logprobs) == len(text) - 1 and all(not k.prompt_logprobs for k in chunks[1:])
    with pytest.raises(grpc.RpcError) as e:
        c.generate(prompt=text, max_tokens=0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "needs prompt_logprobs" in e.value.details()


def test_best_of_through_the_official_client(oa):
    """best_of runs that many candidates and answers the n best (the fake engine's are equal: the
    ranking itself is tests/deployments/test_openai_choices.py, on the real model below); usage
    counts every candidate's tokens, as OpenAI bills them; logprobs only where asked."""
    r = oa.completions.create(model=MODEL, prompt="pick me", max_tokens=5, best_of=3, n=2)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 15
    assert all(c.logprobs is None and c.text == fake_output(FAKE.tokenize("pick me"), 5) for c in r.choices)
    asked = oa.completions.create(model=MODEL, prompt="pick me", max_tokens=5, best_of=2, logprobs=1)
    assert len(asked.choices) == 1 and len(asked.choices[0].logprobs.tokens) == 5
    with pytest.raises(openai.BadRequestError, match="best_of cannot be streamed"):
        oa.completions.create(model=MODEL, prompt="pick me", max_tokens=5, best_of=2, stream=True)


def test_a_batch_of_prompts_through_the_official_client(oa):
    """A completion's batch of prompts (strings or token-id lists): choice i * n + j is prompt i's
    choice j, each prompt echoed before its own choices, usage counting each prompt once and every
    choice's tokens; streamed, the events name those indices; best_of picks per prompt; one bad
    prompt in the batch is a 400 naming it, and a batch over limits.max_choices is a 400."""
    texts = ["first one", "two"]
    r = oa.completions.create(model=MODEL, prompt=texts, max_tokens=3, n=2, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [t + fake_output(FAKE.tokenize(t), 3) for t in texts for _ in range(2)]
    assert r.usage.prompt_tokens == sum(map(len, texts)) and r.usage.completion_tokens == 12
    ids = oa.completions.create(model=MODEL, prompt=[FAKE.tokenize(t) for t in texts], max_tokens=2)
    assert [c.text for c in ids.choices] == [fake_output(FAKE.tokenize(t), 2) for t in texts]
    events = list(oa.completions.create(model=MODEL, prompt=texts, max_tokens=3, stream=True, echo=True))
    by_index = {}
    for e in events:
        for c in e.choices:
            by_index[c.index] = by_index.get(c.index, "") + c.text
    assert by_index == {i: t + fake_output(FAKE.tokenize(t), 3) for i, t in enumerate(texts)}
    best = oa.completions.create(model=MODEL, prompt=texts, max_tokens=2, best_of=2)
    assert len(best.choices) == 2 and best.usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError, match="prompt is empty"):
        oa.completions.create(model=MODEL, prompt=["fine", "  "], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="over limits.max_choices"):
        oa.completions.create(model=MODEL, prompt=["a"] * 5, max_tokens=2, n=2)


def test_tokenize_and_detokenize_over_http(addrs):
    """vLLM's /tokenize and /detokenize: a prompt's or a chat's ids as a request would feed them,
    and back; the model name, auth and the prompt rules as a completion's; what a request would do
    differently is refused."""
    url, auth = f"{addrs.http}/oa", {"Authorization": f"Bearer {TOKEN}"}

    def post(path, body, headers=auth):
        return requests.post(f"{url}{path}", json=body, headers=headers, timeout=30)

    r = post("/tokenize", {"model": MODEL, "prompt": "héllo"})
    assert r.status_code == 200 and r.json() == {"count": 6, "max_model_len": 2048, "tokens": FAKE.tokenize("héllo")}
    r = post("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                           "add_generation_prompt": True})
    assert r.json()["tokens"] == chat_ids("hi")
    assert post("/detokenize", {"tokens": FAKE.tokenize("héllo")}).json() == {"prompt": "héllo"}
    for path, body, status, match in (
            ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "exactly one"),
            ("/tokenize", {"prompt": "   "}, 400, "prompt is empty"),
            ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "add_generation_prompt": False}, 400,
             "add_generation_prompt false is not supported"),
            ("/tokenize", {"prompt": "a", "add_special_tokens": True}, 400, "add_special_tokens true"),
            ("/tokenize", {"prompt": "a", "truncate": 3}, 400, "unrecognized request argument supplied: truncate"),
            ("/tokenize", {"prompt": "a", "model": "other"}, 404, "does not exist"),
            ("/detokenize", {"tokens": [5, 99999]}, 400, r"out of range \[0, 259\)"),
            ("/detokenize", {"tokens": "abc"}, 400, "tokens")):
        r = post(path, body)
        assert r.status_code == status and re.search(match, r.json()["error"]["message"]), (path, body, r.text)
    assert post("/tokenize", {"prompt": "a"}, headers={}).status_code == 401


def test_completion_stream_raw_sse(addrs):
    with requests.post(f"{addrs.http}/oa/v1/completions", timeout=60, stream=True,
                       headers={"Authorization": f"Bearer {TOKEN}"},
                       json={"model": MODEL, "prompt": "raw sse", "max_tokens": 6, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines(decode_unicode=True) if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert all(e["object"] == "text_completion" and "usage" not in e for e in events)  # no include_usage
    assert "".join(e["choices"][0]["text"] for e in events) == fake_output(FAKE.tokenize("raw sse"), 6)


def _status(fn, **kwargs):
    with pytest.raises(openai.APIStatusError) as e:
        fn(**kwargs)
    return e.value.status_code, e.value.body


@pytest.mark.parametrize("kwargs,status,needle,param", [
    (dict(model="gpt-4o"), 404, "the model 'gpt-4o' does not exist", "model"),
    (dict(n=9), 400, "n must be in [1, 8], got 9", "n"),  # limits.max_choices
    (dict(temperature="hot"), 400, "temperature: Input should be a valid number", "temperature"),
    (dict(max_tokens=1001), 400, "max_tokens must be in [1, 1000], got 1001", None),  # the shared rule
    (dict(top_p=0), 400, "top_p must be in (0, 1]", None),
    (dict(seed=-1), 400, "seed must be in [0, 2**64)", None),
    (dict(stop=["a", "b", "c"]), 400, "stop has 3 strings, limit is 2", None),  # gRPC's cap, same text
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     400, "json_schema is not a valid JSON Schema", None),  # gRPC's rule, checked off the event loop
    (dict(response_format={"type": "json_object"}, extra_body={"regex": "[a-z]+"}), 400,
     "set at most one of response_format", "response_format"),
    (dict(extra_body={"grammar": "start: /[a-z/"}), 400, "grammar is not supported: at 1(8): invalid regex", None),
    (dict(extra_body={"guided_grammar": "start: x"}), 400, "(guided_grammar: use the grammar extension", "guided_grammar"),
    (dict(extra_body={"mode": "turbo"}), 400, "mode must be one of", "mode"),
    (dict(extra_body={"draft_scope": "tenant 7"}), 400, "draft_scope must be ASCII letters", None),  # gRPC's rule
    (dict(logprobs=False, top_logprobs=3), 400, "top_logprobs needs logprobs: true", "top_logprobs"),
    (dict(extra_body={"typical_p": 0.5}), 400, "unrecognized request argument supplied: typical_p", "typical_p"),
    (dict(extra_body={"min_p": 1.5}), 400, "min_p must be in [0, 1]", None),
    (dict(extra_body={"repetition_penalty": 0}), 400, "repetition_penalty must be in (0, 10]", None),
    (dict(reasoning_effort="low"), 400, "reasoning_effort is not supported", "reasoning_effort"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role must be one of", None),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "only text content parts are supported", "messages"),
    (dict(messages=[{"role": "user", "content": "y" * 60}]), 400, "prompt too long", None),  # engine side
])
def test_chat_errors(oa, kwargs, status, needle, param):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    args.update(kwargs)
    for stream in (False, True):  # a stream refuses with the same status before its first event
        got, body = _status(oa.chat.completions.create, stream=stream, **args)
        assert got == status and needle in body["message"], (stream, body)
        assert body["param"] == param and body["type"] == ("invalid_request_error")


def test_grpc_and_http_refuse_alike(addrs, oa):
    """One validation: the same bad request gives the same message on both front ends."""
    c = Client(addrs.grpc, "oa", TOKEN)
    with pytest.raises(grpc.RpcError) as e:
        c.generate(prompt="hi", max_tokens=1001)
    got, body = _status(oa.completions.create, model=MODEL, prompt="hi", max_tokens=1001)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and got == 400
    assert body["message"] == e.value.details() and body["code"] == "invalid_argument"
    big = "z" * 5000  # over limits.max_message_bytes (4096)
    got, body = _status(oa.completions.create, model=MODEL, prompt=big, max_tokens=4)
    assert got == 400 and "over the 4096-byte limit" in body["message"]

    def chunked():  # no Content-Length: the reader stops at the chunk that crosses the cap
        for _ in range(64):
            yield b"z" * 1024
    r = requests.post(f"{addrs.http}/oa/v1/completions", data=chunked(), timeout=30,
                      headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400 and "body is over the 4096-byte limit" in r.json()["error"]["message"]
    r = requests.post(f"{addrs.http}/oa/v1/completions", data=b"{not json", timeout=30,
                   headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def kv_full(app: str, deployment: str) -> bool:
    s = engine_stats(app, deployment)
    return s["num_running"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]


@pytest.mark.parametrize("n", [1, 2])
def test_disconnect_mid_stream_frees_kv(addrs, n):
    # plain: one token per 20 ms step, so 1000 tokens would take 20 s to finish on their own
    body = {"model": MODEL, "prompt": "disconnect me", "max_tokens": 1000, "stream": True, "mode": "plain", "n": n}
    t0 = time.monotonic()
    with requests.post(f"{addrs.http}/oa/v1/completions", json=body, timeout=60, stream=True,
                       headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        lines = r.iter_lines(decode_unicode=True)
        assert next(lines).startswith("data: ")
        wait_for(lambda: engine_stats("oa", "BatchEngine")["num_running"] == n, timeout=8,
                 what=f"{n} choices running")
        s = engine_stats("oa", "BatchEngine")
        assert s["kv_blocks_free"] < s["kv_blocks_total"]
    # the client closed the connection after its first event: every choice aborted, KV freed
    wait_for(lambda: kv_full("oa", "BatchEngine"), timeout=8, what="KV freed after the disconnect")
    assert time.monotonic() - t0 < 15  # well before the request could have finished


# -- the real model ---------------------------------------------------------------------------
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
MODES = {"speculative": 1, "plain": 2}


@pytest.fixture(scope="module")
def hf():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster.models.loader import resolve_model

    torch.set_num_threads(1)
    path = resolve_model("default").path
    return (AutoTokenizer.from_pretrained(path),
            AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval())


@pytest.mark.model
@pytest.mark.parametrize("mode", ["speculative", "plain"])
def test_real_greedy_equals_grpc_and_hf(addrs, real, hf, mode):
    from tests.deployments.test_service_model import assert_greedy_equal, hf_greedy

    r = real.completions.create(model="default", prompt=PROMPT, max_tokens=24, temperature=0,
                                extra_body={"mode": mode})
    assert r.model_extra["specserve"]["route"]["path"] == mode
    g = Client(addrs.grpc, "real").generate(prompt=PROMPT, max_tokens=24, mode=MODES[mode], timeout=300)
    prompt_ids, want = hf_greedy(hf, PROMPT, 24)
    assert_greedy_equal(hf, prompt_ids, list(g.token_ids), want)  # gRPC == HF generate
    assert r.choices[0].text == g.text and r.usage.completion_tokens == len(g.token_ids)  # HTTP == gRPC
    streamed = real.completions.create(model="default", prompt=PROMPT, max_tokens=24, temperature=0,
                                       stream=True, extra_body={"mode": mode})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == g.text


@pytest.mark.model
def test_real_stop_seed_and_chat(addrs, real):
    grpc_client = Client(addrs.grpc, "real")
    base = real.completions.create(model="default", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    cut = base[len(base) // 2:][:3]
    stopped = real.completions.create(model="default", prompt=PROMPT, max_tokens=24, temperature=0, stop=cut)
    text = stopped.choices[0].text
    assert stopped.choices[0].finish_reason == "stop" and cut not in text and base.startswith(text)
    assert grpc_client.generate(prompt=PROMPT, max_tokens=24, stop=[cut], timeout=300).text == text
    plain = {"mode": "plain"}  # one path for every sample: the seed's stream of draws is the path's
    sampled = [real.completions.create(model="default", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=s,
                                       extra_body=plain).choices[0].text for s in (7, 7, 8)]
    assert sampled[0] == sampled[1] != sampled[2]  # a seed reproduces its sample; another seed differs
    g = grpc_client.generate(prompt=PROMPT, max_tokens=16, temperature=1.0, seed=7, mode=2, timeout=300)
    assert g.text == sampled[0]  # the same seed over gRPC: the same sample
    choices = real.completions.create(model="default", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=7, n=2,
                                      extra_body=plain).choices
    assert [c.text for c in choices] == [sampled[0], sampled[2]]  # choice i: seed + i, as its own request
    chat = real.chat.completions.create(model="default", messages=[{"role": "user", "content": "Say hi."}],
                                        max_tokens=8, temperature=0)
    pb = grpc_client.pb2
    g = grpc_client.generate(messages=[pb.ChatMessage(role="user", content="Say hi.")], max_tokens=8,
                             timeout=300)
    assert chat.choices[0].message.content == g.text  # the same chat template on both front ends
    assert chat.usage.prompt_tokens == g.usage.prompt_tokens > 5


@pytest.mark.model
def test_real_draft_scope_keeps_learnt_answers_to_their_scope(addrs, real):
    """The same greedy prompt in scope A, then B, then A again: only A's repeat drafts from the
    first answer (suffix:cold learns finished answers per segment and draft scope); the OpenAI
    extension carries the scope as gRPC's field does."""
    c = Client(addrs.grpc, "real")
    prompt = "List three facts about the moon."

    def once(scope):
        return c.generate(prompt=prompt, max_tokens=32, ignore_eos=True, mode=MODES["speculative"],
                          segment="scope-test", draft_scope=scope, timeout=300)

    first, other, again = once("tenant-a"), once("tenant-b"), once("tenant-a")
    assert first.text == other.text == again.text and len(again.token_ids) == 32
    seen = [(r.spec.accepted_tokens, r.spec.draft_tokens, r.spec.drafts) for r in (first, other, again)]
    # A's repeat: its drafts come from A's first answer (the engine test measured every draft
    # accepted, ~K + 1 tokens a step); B's drafts come from its own history only
    assert again.spec.accepted_tokens >= 20 and again.spec.acceptance_rate >= 0.8, seen
    assert other.spec.accepted_tokens <= 0.6 * again.spec.accepted_tokens, seen
    r = real.completions.create(model="default", prompt=prompt, max_tokens=32, temperature=0,
                                extra_body={"mode": "speculative", "segment": "scope-test",
                                            "draft_scope": "tenant-a", "ignore_eos": True})
    assert r.choices[0].text == first.text


@pytest.mark.model
def test_real_prediction_is_drafted_from_and_changes_nothing(addrs, real):
    """OpenAI's predicted outputs through the official client on the real model: the greedy answer
    sent back as the prediction gives the same answer, drafted from it (nearly every draft kept,
    far fewer verification steps), and usage says the prediction was kept whole; half of it wrong
    still gives the same answer."""
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    args = dict(model="default", messages=messages, max_tokens=40, temperature=0,
                extra_body={"mode": "speculative", "segment": "prediction-test"})
    first = real.chat.completions.create(**args)
    answer = first.choices[0].message.content
    again = real.chat.completions.create(**args, prediction={"type": "content", "content": answer})
    assert again.choices[0].message.content == answer
    details, n = again.usage.completion_tokens_details, again.usage.completion_tokens
    assert details.rejected_prediction_tokens <= 1 and details.accepted_prediction_tokens >= n - 2, (details, n)
    spec = again.model_extra["specserve"]["spec"]  # K = 4 here: up to 5 tokens a verification step
    assert spec["acceptance_rate"] >= 0.9 and spec["accepted_tokens"] >= 0.6 * n, (spec, n)
    half = answer[: len(answer) // 2] + "".join(reversed(answer[len(answer) // 2:]))
    wrong = real.chat.completions.create(**args, prediction={"type": "content", "content": half})
    assert wrong.choices[0].message.content == answer
    assert wrong.usage.completion_tokens_details.rejected_prediction_tokens > 0
    assert first.usage.completion_tokens_details is None  # no prediction: no details


@pytest.mark.model
def test_real_logprobs_spell_the_answer_and_equal_grpcs(addrs, real):
    """On the real model through the official client: chat's logprobs have one entry per token of
    the answer (the end-of-turn token, which ends no text, has none), their bytes spell the content,
    each token is the most likely one (greedy) and is among its own top_logprobs; the values equal
    gRPC's for the same request (the same engine rows; HF's are checked at the engine)."""
    messages = [{"role": "user", "content": "Name a colour."}]
    r = real.chat.completions.create(model="default", messages=messages, max_tokens=16, temperature=0,
                                     logprobs=True, top_logprobs=2, extra_body={"mode": "speculative"})
    content, text = r.choices[0].logprobs.content, r.choices[0].message.content
    assert bytes(b for c in content for b in c.bytes).decode() == text
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6) and c.logprob <= 0 for c in content)
    pb = Client(addrs.grpc, "real").pb2
    g = Client(addrs.grpc, "real").generate(messages=[pb.ChatMessage(role="user", content="Name a colour.")],
                                            max_tokens=16, logprobs=2, mode=MODES["plain"], timeout=300)
    assert [o.chosen.logprob for o in g.logprobs][: len(content)] == pytest.approx(
        [c.logprob for c in content], abs=2e-3)  # the other path, other batch shapes: float noise only


@pytest.mark.model
def test_real_scoring_agrees_with_generation(addrs, real):
    """lm-eval-harness's loglikelihood request on the real model (echo, logprobs 1, max_tokens 0):
    scoring a prompt followed by the model's own greedy answer gives each answer token the
    log-probability generation reported for it (prefill rows vs decode rows: float noise only),
    each one its position's most likely token (is_greedy); gRPC's prompt_logprobs give the same."""
    prompt = "The capital of France is"
    gen = real.completions.create(model="default", prompt=prompt, max_tokens=8, temperature=0, logprobs=1,
                                  extra_body={"mode": "plain", "ignore_eos": True})
    answer, lp = gen.choices[0].text, gen.choices[0].logprobs
    scored = real.completions.create(model="default", prompt=prompt + answer, max_tokens=0, echo=True, logprobs=1,
                                     temperature=0)
    s = scored.choices[0]
    assert s.text == prompt + answer and s.finish_reason == "length" and scored.usage.completion_tokens == 0
    n = len(lp.tokens)
    assert s.logprobs.tokens[-n:] == lp.tokens and s.logprobs.token_logprobs[0] is None
    assert s.logprobs.token_logprobs[-n:] == pytest.approx(lp.token_logprobs, abs=2e-3)
    for token, value, top in zip(s.logprobs.tokens[-n:], s.logprobs.token_logprobs[-n:], s.logprobs.top_logprobs[-n:]):
        assert max(top.values()) == pytest.approx(value, abs=1e-6) and token in top  # greedy: its own top
    pb = Client(addrs.grpc, "real")
    g = pb.generate(prompt=prompt + answer, max_tokens=0, prompt_logprobs=0, mode=MODES["speculative"], timeout=300)
    assert [e.chosen.logprob for e in g.prompt_logprobs] == pytest.approx(s.logprobs.token_logprobs[1:], abs=2e-3)
    assert b"".join(e.chosen.token for e in g.prompt_logprobs).decode() == "".join(s.logprobs.tokens[1:])


@pytest.mark.model
def test_real_best_of_answers_the_candidate_with_the_best_logprob_per_token(real):
    """best_of 3 seeded on the plain path: candidate i is what seed + i alone gives there (as n's
    choices are), so the three are reproduced one by one and the answer is the one whose tokens'
    mean log-probability is highest; usage counts all three."""
    args = dict(model="default", prompt="Once upon a time", max_tokens=12, temperature=1.0,
                extra_body={"mode": "plain", "ignore_eos": True})
    best = real.completions.create(**args, seed=11, best_of=3)
    alone = [real.completions.create(**args, seed=11 + i, logprobs=0).choices[0] for i in range(3)]
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in alone]
    assert len({c.text for c in alone}) > 1, "seeded candidates differ"
    assert best.choices[0].text == alone[means.index(max(means))].text, (means, [c.text for c in alone])
    assert best.usage.completion_tokens == 36 and len(best.choices) == 1


@pytest.mark.model
def test_real_tokenize_counts_what_a_request_feeds(addrs):
    """On the real model: /tokenize's count is the prompt_tokens a completion and a chat of the same
    input report, and /detokenize spells the ids back to the prompt."""
    url = f"{addrs.http}/real"
    prompt = "Tokenize me, then count: naïve café"
    tok = requests.post(f"{url}/tokenize", json={"prompt": prompt}, timeout=60).json()
    comp = requests.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=300).json()
    assert tok["count"] == comp["usage"]["prompt_tokens"] and tok["max_model_len"] > 0
    assert requests.post(f"{url}/detokenize", json={"tokens": tok["tokens"]}, timeout=60).json() == {"prompt": prompt}
    messages = [{"role": "user", "content": prompt}]
    chat_tok = requests.post(f"{url}/tokenize", json={"messages": messages}, timeout=60).json()
    chat = requests.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=300).json()
    assert chat_tok["count"] == chat["usage"]["prompt_tokens"] > tok["count"]


@pytest.mark.model
def test_real_response_format_json_schema_validates(real):
    """response_format json_schema through the OpenAI client: the output parses and validates, on
    both paths (the grammar is enforced by the engine, speculation included)."""
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    for mode in ("speculative", "plain"):
        r = real.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Describe a person as JSON."}],
            max_tokens=48, temperature=0, extra_body={"mode": mode},
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
        assert r.choices[0].finish_reason == "stop", (mode, r.choices[0].message.content)
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = real.completions.create(model="default", prompt="Year:", max_tokens=8, temperature=0,
                                extra_body={"regex": "(19|20)[0-9]{2}"})
    assert re.fullmatch("(19|20)[0-9]{2}", r.choices[0].text), r.choices[0].text
    # a Lark grammar (the grammar extension): a list of one to three lowercase words, on both paths
    # equal to each other and to gRPC's
    lark = 'start: "[" WORD ("," WORD)? ("," WORD)? "]"\nWORD: /[a-z]{1,10}/\n'
    texts = set()
    for mode in ("speculative", "plain"):
        c = real.chat.completions.create(model="default", messages=[{"role": "user", "content": "Name three fruits."}],
                                         max_tokens=40, temperature=0, extra_body={"grammar": lark, "mode": mode})
        texts.add(c.choices[0].message.content)
        assert c.choices[0].finish_reason == "stop" and re.fullmatch(r"\[[a-z]{1,10}(,[a-z]{1,10}){0,2}\]", c.choices[0].message.content)
    assert len(texts) == 1, texts


@pytest.mark.model
def test_real_logit_bias_shapes_the_answer_on_both_paths(addrs, real):
    """logit_bias through the official client on the real model, greedy, both paths: -100 on the
    answer's first token makes another token first; +100 on one token makes it every token. gRPC's
    map field gives the same answer. (The values against HF: tests/sampling/test_penalties.py.)"""
    grpc_client = Client(addrs.grpc, "real")
    ids = list(grpc_client.generate(prompt=PROMPT, max_tokens=6, mode=MODES["plain"], timeout=300).token_ids)
    forced = ids[2] if ids[2] != ids[0] else ids[1]
    for mode in ("speculative", "plain"):
        args = dict(model="default", prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"mode": mode})
        banned = real.completions.create(**args, logit_bias={str(ids[0]): -100}).choices[0].text
        g = grpc_client.generate(prompt=PROMPT, max_tokens=6, mode=MODES[mode], logit_bias={ids[0]: -100},
                                 timeout=300)
        assert g.token_ids[0] != ids[0] and g.text == banned  # the same shaping on both front ends
        every = grpc_client.generate(prompt=PROMPT, max_tokens=6, mode=MODES[mode], logit_bias={forced: 100},
                                     timeout=300)
        assert list(every.token_ids) == [forced] * 6


@pytest.mark.model
def test_real_repetition_penalty_and_min_p_shape_the_answer_on_both_paths(addrs, real):
    """vLLM's repetition_penalty and min_p through the official client (extra body fields) on the
    real model, both paths: the greedy answer under a strong repetition penalty differs from the
    plain greedy one and equals gRPC's with the same field; a seeded sampled answer under min_p
    equals gRPC's too. (The values against HF's own: tests/sampling/test_penalties.py,
    tests/sampling/test_sampler.py.)"""
    grpc_client = Client(addrs.grpc, "real")
    plain = grpc_client.generate(prompt=PROMPT, max_tokens=12, mode=MODES["plain"], timeout=300).text
    for mode in ("speculative", "plain"):
        args = dict(model="default", prompt=PROMPT, max_tokens=12, temperature=0)
        penalized = real.completions.create(**args, extra_body={"mode": mode, "repetition_penalty": 2.0}).choices[0].text
        g = grpc_client.generate(prompt=PROMPT, max_tokens=12, mode=MODES[mode], repetition_penalty=2.0, timeout=300)
        assert penalized == g.text != plain
        sampled = real.completions.create(model="default", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5,
                                          extra_body={"mode": mode, "min_p": 0.3}).choices[0].text
        g = grpc_client.generate(prompt=PROMPT, max_tokens=12, mode=MODES[mode], temperature=1.0, seed=5, min_p=0.3,
                                 timeout=300)
        assert sampled == g.text


WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                 "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                           "parameters": {"type": "object", "properties": {
                                               "zone": {"type": "string", "maxLength": 24}}, "required": ["zone"],
                                               "additionalProperties": False}}}]


@pytest.mark.model
def test_real_tool_calls_through_the_official_client(real):
    """tools on the real model, parsed by the official client's own types: a named function's
    arguments validate against its schema (unary, and streamed as the same argument deltas);
    ``required`` calls one of the tools with valid arguments on both paths; the call and its result
    sent back get a text answer; ``auto`` (tool_choice unset) lets the model choose — after a
    conversation that shows it a call, it calls get_weather for a weather question and answers an
    arithmetic one in text, the same on both paths, streamed as the same call."""
    import jsonschema

    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    args = dict(model="default", messages=ask, max_tokens=64, temperature=0, tools=TOOLS)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = real.chat.completions.create(**args, tool_choice=named)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content is None  # OpenAI's, named
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_ARGS)
    deltas = [tc for c in real.chat.completions.create(**args, tool_choice=named, stream=True) if c.choices
              for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments  # greedy: the same call
    for mode in ("speculative", "plain"):
        for parallel in (True, False):  # several calls may follow one another; with false, one
            c = real.chat.completions.create(**args, tool_choice="required", parallel_tool_calls=parallel,
                                             extra_body={"mode": mode}).choices[0]
            assert c.finish_reason in ("tool_calls", "length") and c.message.tool_calls, c
            assert len(c.message.tool_calls) == 1 or parallel
            assert len({m.id for m in c.message.tool_calls}) == len(c.message.tool_calls)
            for made in c.message.tool_calls:
                assert made.function.name in ("get_weather", "get_time"), c
                schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == made.function.name)
                jsonschema.validate(json.loads(made.function.arguments), schema)
    back = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
                  {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius and sunny"}]
    answer = real.chat.completions.create(model="default", messages=back, max_tokens=24, temperature=0, tools=TOOLS,
                                          tool_choice="none").choices[0]
    assert answer.message.content and answer.message.tool_calls is None
    # a conversation that shows the model one call (this wording: the model's first token on the
    # weather question below is the call's by a margin of 0.39 in log-probability; on the arithmetic
    # one, text by 0.62)
    shown = ask + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
        {"role": "assistant", "content": "It is 18 degrees and sunny in Paris."}]
    weather = [{"role": "user", "content": "What is the weather in Berlin today?"}]
    for mode in ("speculative", "plain"):
        asked = dict(model="default", max_tokens=64, temperature=0, tools=TOOLS, extra_body={"mode": mode})
        c = real.chat.completions.create(**asked, messages=shown + weather).choices[0]
        (made,) = c.message.tool_calls
        assert c.finish_reason == "tool_calls" and c.message.content is None and made.function.name == "get_weather"
        assert json.loads(made.function.arguments)["city"] == "Berlin" and made.id.startswith("call_")
        jsonschema.validate(json.loads(made.function.arguments), WEATHER_ARGS)
        text = real.chat.completions.create(**asked, messages=shown + [
            {"role": "user", "content": "What is 2 + 2?"}]).choices[0]
        assert text.finish_reason == "stop" and text.message.tool_calls is None and "4" in text.message.content
    chunks = list(real.chat.completions.create(**asked, messages=shown + weather, stream=True))
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(s.index, s.function.name, s.function.arguments) for s in streamed] == [
        (0, "get_weather", made.function.arguments)]  # one delta, whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


@pytest.mark.model
def test_real_responses_api_calls_a_tool_and_continues_with_its_output(real):
    """The Responses API on the real model (tests/deployments/test_responses_http.py: the rest, on
    the fake engine): input items that show the model one call make it call get_weather for Berlin
    — the call the chat endpoint makes for the same messages — on both paths; the call's output sent
    back with previous_response_id gets a text answer, the chat endpoint's; text.format json_schema
    validates."""
    import jsonschema

    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    shown = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": json.dumps({"city": "Paris", "unit": "celsius"})},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees, sunny"},
             {"role": "assistant", "content": "It is 18 degrees and sunny in Paris."},
             {"role": "user", "content": "What is the weather in Berlin today?"}]
    as_chat = [shown[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": shown[1]["arguments"]}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}, shown[3], shown[4]]
    chat = real.chat.completions.create(model="default", messages=as_chat, tools=TOOLS, max_tokens=64,
                                        temperature=0).choices[0].message.tool_calls[0]
    for mode in ("speculative", "plain"):
        r = real.responses.create(model="default", input=shown, tools=flat, max_output_tokens=64, temperature=0,
                                  extra_body={"mode": mode})
        (call,) = r.output
        assert r.status == "completed" and call.type == "function_call" and call.name == "get_weather"
        assert call.arguments == chat.function.arguments and json.loads(call.arguments)["city"] == "Berlin"
    follow = real.responses.create(model="default", previous_response_id=r.id, tools=flat, tool_choice="none",
                                   input=[{"type": "function_call_output", "call_id": call.call_id,
                                           "output": "21 degrees, cloudy"}], max_output_tokens=24, temperature=0)
    answer = real.chat.completions.create(
        model="default", tools=TOOLS, tool_choice="none", max_tokens=24, temperature=0,
        messages=as_chat + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "21 degrees, cloudy"}]).choices[0].message
    assert follow.output_text and follow.output_text == answer.content
    # the conversation so far was fed on both paths above: its full blocks come from the prefix cache
    assert 0 < follow.usage.input_tokens_details.cached_tokens < follow.usage.input_tokens
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
              "required": ["name"], "additionalProperties": False}
    j = real.responses.create(model="default", input="Describe a person as JSON.", max_output_tokens=32, temperature=0,
                              text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    jsonschema.validate(json.loads(j.output_text), schema)
    ask = {"model": "default", "temperature": 0, "extra_body": {"mode": "plain"}}
    lp = real.responses.create(input="Name a colour.", max_output_tokens=8, top_logprobs=2,
                               include=["message.output_text.logprobs"], **ask).output[0].content[0].logprobs
    ref = real.chat.completions.create(messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8,
                                       logprobs=True, top_logprobs=2, **ask).choices[0].logprobs.content
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in lp] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in ref] and lp  # the chat endpoint's entries
    assert max(abs(a.logprob - b.logprob) for a, b in zip(lp, ref)) < 1e-4
