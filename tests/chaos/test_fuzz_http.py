"""Fuzz the OpenAI-compatible HTTP API (hypothesis: every body field OpenAI or we define, fields
nobody defines, values of any JSON type, nested junk) through the real Serve app's HTTP proxy.

A well-formed body (valid fields at sane values) is answered 200 (or 429). Every answer is 200 or
a documented error status (400, 401 for a wrong or missing token, 404 for
another model's name, 429) — never a 5xx, a 422 or a hang past the per-call deadline; an error body
is OpenAI's shape with a message and no internals; a 200 carries a choice with a finish reason
(unary) or ends with ``data: [DONE]`` (stream); a body field the server does not know is never
answered 200 (it is refused, not ignored). Afterwards the service answers a reference request
exactly as before. FakeEngine app only (``--fuzz-examples``, CI 200): what is fuzzed is the front end.
"""
from __future__ import annotations

import json
from collections import Counter

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.api.openai_schemas import ChatCompletionRequest, CompletionRequest
from tests.chaos.service import LEAKS, TOKEN

pytestmark = [pytest.mark.chaos, pytest.mark.ray]

ALLOWED = {200, 400, 404, 429}
KNOWN = {"chat": set(ChatCompletionRequest.model_fields), "completions": set(CompletionRequest.model_fields)}
REFERENCE = {"model": "fake", "prompt": "the cat sat. ", "max_tokens": 8, "temperature": 0}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                    st.sampled_from([0, 1, -1, 0.5, 2**64, "", "text", "auto", "none", "plain"]),
                    st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"]),
     "content": st.one_of(st.text(max_size=40), st.none(),
                          st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                          "text": st.text(max_size=10)}), max_size=3))},
    optional={"name": st.text(max_size=5), "refusal": st.none(),
              "tool_calls": st.one_of(st.none(), st.just([CALL]), json_values),
              "tool_call_id": st.sampled_from(["call_1", "call_9", ""]), "extra": json_values}), max_size=4)
FIELDS = {
    "model": st.sampled_from(["fake", "fake", "gpt-4o", "", None]),
    "max_tokens": st.one_of(st.integers(-2, 40), st.sampled_from([10**6, True, "8", 1.5])),
    "max_completion_tokens": st.one_of(st.integers(0, 20), st.none()),
    "temperature": st.one_of(st.floats(-1, 3), st.sampled_from([0, "hot", None, float("1e308")])),
    "top_p": st.one_of(st.floats(-0.5, 1.5), st.none()),
    "seed": st.one_of(st.integers(-5, 2**65), st.none()),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20), st.integers()),
    "n": st.sampled_from([1, 2, 3, 0, 9, -1, None, "2", 2.0]),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "response_format": st.one_of(
        st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "xml"},
                         {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
                         {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}]),
        json_values),
    "prediction": st.one_of(st.fixed_dictionaries({"type": st.just("content"), "content": st.text(max_size=30)}),
                            json_values),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", "any", {"type": "function"}]),
                             st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
                                 {"name": st.sampled_from(["f", "g", ""])})}), json_values),
    "tools": st.one_of(st.lists(st.one_of(st.just(TOOL), st.fixed_dictionaries({"type": st.just("function"),
                                          "function": st.fixed_dictionaries({"name": st.text(max_size=70)},
                                                                            optional={"parameters": json_values})})),
                                max_size=3), json_values),
    "parallel_tool_calls": st.one_of(st.booleans(), json_values),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 25), st.none()),
    "top_logprobs": st.one_of(st.integers(-1, 25), st.none(), st.just("3")),
    "presence_penalty": st.one_of(st.floats(-3, 3), st.sampled_from(["1", None, float("1e308")])),
    "frequency_penalty": st.floats(-3, 3),
    "logit_bias": st.one_of(st.dictionaries(st.one_of(st.integers(-5, 300).map(str), st.text(max_size=3)),
                                            st.one_of(st.floats(-150, 150), st.text(max_size=2)), max_size=5),
                            json_values),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2, 300), max_size=4), st.lists(st.integers(0, 9), min_size=65),
                                json_values),
    "min_tokens": st.one_of(st.integers(-1, 1100), st.just("2"), st.none()),
    "echo": st.one_of(st.booleans(), st.none(), json_values),
    "best_of": st.one_of(st.integers(-1, 10), st.none(), st.just("2")),
    "prompt": st.one_of(st.lists(st.text(max_size=10), max_size=10),  # a batch (chat: unrecognized)
                        st.lists(st.lists(st.integers(-1, 300), max_size=5), max_size=10)),
    "mode": st.sampled_from(["auto", "speculative", "plain", "turbo", 3]),
    "segment": st.one_of(st.text(max_size=70), st.sampled_from(["code", "chat"])),
    "draft_scope": st.one_of(st.text(max_size=70), st.sampled_from(["tenant-7"])),
    "regex": st.sampled_from(["[a-z]+", "a(b", "(a*)*b", ""]),
    "grammar": st.sampled_from(['start: "a"+', "start: foo", "", 'start: "(" start ")" | "x"']),
    "top_k": st.one_of(st.integers(-1, 60), st.text(max_size=3)),
    "ignore_eos": st.one_of(st.booleans(), json_values),
    "store": st.booleans(),
    "reasoning_effort": st.sampled_from(["low", None]),
    "min_p": st.one_of(st.floats(-1, 2), st.text(max_size=3)),  # vLLM's
    "repetition_penalty": st.one_of(st.floats(-1, 12), st.sampled_from([0, 1, None])),  # vLLM's
    "typical_p": st.floats(0, 1),  # HF's: unknown here
    "guided_json": json_values,  # vLLM's: unknown here
}


# what a well-meaning OpenAI client sends: the service must answer these 200
SANE = {
    "max_tokens": st.integers(1, 8),
    "temperature": st.one_of(st.just(0), st.floats(0.1, 1.5)),
    "top_p": st.floats(0.1, 1.0),
    "seed": st.integers(0, 2**63),
    "stop": st.lists(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=4), max_size=2),
    "stream": st.booleans(),
    "mode": st.sampled_from(["auto", "speculative"]),
    "segment": st.sampled_from(["code", "chat", "x" * 40]),
    "draft_scope": st.sampled_from(["", "tenant-7"]),
    "user": st.text(max_size=10),
    "top_k": st.integers(0, 40),
    "ignore_eos": st.booleans(),
    "n": st.integers(1, 3),
}
SANE_COMPLETIONS = {"logprobs": st.integers(0, 20), "echo": st.booleans(), "presence_penalty": st.floats(-2, 2),
                    "stop_token_ids": st.lists(st.integers(0, 258), max_size=3), "min_tokens": st.integers(0, 1),
                    "frequency_penalty": st.floats(-2, 2),
                    "logit_bias": st.dictionaries(st.integers(0, 258).map(str), st.floats(-100, 100), max_size=3)}
SANE_CHAT = {
    "logprobs": st.just(True), "top_logprobs": st.integers(0, 20),
    "prediction": st.fixed_dictionaries({"type": st.just("content"), "content": st.text(max_size=30)}),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
    "tools": st.just([TOOL]), "store": st.just(False),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
}
sane_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40).filter(str.strip)


@st.composite
def bodies(draw) -> tuple[str, dict, bool]:
    """(endpoint, body, sane): half nearly sane (a valid body, then at most one field at its edges;
    ``sane`` when none), half wild."""
    endpoint = draw(st.sampled_from(["chat", "completions"]))
    if draw(st.booleans()):
        body: dict = ({"messages": [{"role": "user", "content": draw(sane_text)}]} if endpoint == "chat"
                      else {"prompt": draw(sane_text)})
        for name, strategy in (SANE | (SANE_CHAT if endpoint == "chat" else SANE_COMPLETIONS)).items():
            if draw(st.booleans()):
                body[name] = draw(strategy)
        if "top_logprobs" in body:  # OpenAI asks for both: top_logprobs alone is refused
            body["logprobs"] = True
        if endpoint == "chat" and "tools" not in body and body.get("tool_choice") not in (None, "none", "auto"):
            body["tools"] = [TOOL]  # a call needs tools; a required or named call with another constraint is refused
        if (body.get("tool_choice") not in (None, "none", "auto")
                and (body.get("response_format") or {}).get("type") == "json_object"):
            body["tool_choice"] = "none"
        if body.get("stream") and draw(st.booleans()):
            body["stream_options"] = {"include_usage": True}
        odd = draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=1))
        for name in odd:
            body[name] = draw(FIELDS[name])
        return endpoint, body, not odd
    body = {}
    if endpoint == "chat" or draw(st.booleans()):
        body["messages"] = draw(st.one_of(messages, json_values))
    if endpoint == "completions" or draw(st.integers(0, 9)) == 0:
        body["prompt"] = draw(st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(-1, 300), max_size=10),
                                        st.lists(st.text(max_size=5), max_size=3), json_values))
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=6, unique=True)):
        body[name] = draw(FIELDS[name])
    for name in draw(st.lists(st.text(min_size=1, max_size=8), max_size=2)):  # fields nobody defines
        body[name] = draw(json_values)
    return endpoint, body, False


def post(base: str, endpoint: str, raw: bytes, auth: str | None, timeout: float) -> tuple[int, str, str]:
    """(status, content type, text) of one call; status 0 means it hung past ``timeout``."""
    headers = {"content-type": "application/json"} | ({"authorization": auth} if auth else {})
    path = "chat/completions" if endpoint == "chat" else "completions"
    try:
        r = requests.post(f"{base}/fake/v1/{path}", data=raw, headers=headers, timeout=timeout)
    except requests.Timeout:
        return 0, "", "timeout"
    return r.status_code, r.headers.get("content-type", ""), r.text


def report(chaos_report, section: str, statuses: Counter, bad: list[str]) -> None:
    """Record a fuzz run's counts in the chaos report, then fail on any broken answer."""
    chaos_report.record(section, "examples", sum(statuses.values()))
    chaos_report.record(section, "statuses", {str(k): v for k, v in sorted(statuses.items())})
    chaos_report.record(section, "failures", len(bad))
    chaos_report.record(section, "failure_samples", bad[:20])
    assert not bad, f"{len(bad)} of {sum(statuses.values())} answers broke the contract:\n" + "\n".join(bad[:15])


def common_problem(status: int, text: str) -> str | None:
    """What is wrong with any answer (a status not documented, internals shown, an error body
    not OpenAI's shape: a message and a type), or None."""
    if status not in ALLOWED:
        return f"status {status}"
    if any(m in text for m in LEAKS):
        return "internals in the answer"
    if status != 200:
        err = json.loads(text).get("error", {})
        return None if err.get("message") and err.get("type") else "error body without message/type"
    return None


def judge(status: int, ctype: str, text: str, endpoint: str, body: dict, stream: bool) -> str | None:
    """What is wrong with this answer, or None."""
    if status != 200 or common_problem(status, text):
        return common_problem(status, text)
    unknown = set(body) - KNOWN[endpoint]
    if unknown:
        return f"unknown fields {sorted(unknown)} answered 200"
    if stream:
        if "text/event-stream" not in ctype or not text.rstrip().endswith("data: [DONE]"):
            return "stream did not end with data: [DONE]"
        return None
    choice = json.loads(text)["choices"][0]
    return (None if choice["finish_reason"] in ("stop", "length", "tool_calls")
            else f"finish_reason {choice['finish_reason']}")


def test_fuzz_openai_http_fake_engine_app(chaos_service, chaos_report, fuzz_examples):
    chaos_service.apps("fake")
    base, good = chaos_service.http, f"Bearer {TOKEN}"
    reference = post(base, "completions", json.dumps(REFERENCE).encode(), good, 60)
    assert reference[0] == 200, reference
    statuses: Counter = Counter()
    bad: list[str] = []

    @settings(max_examples=fuzz_examples[0], deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(case=bodies(), cred=st.sampled_from(["good"] * 8 + ["missing", "wrong"]))
    def one(case, cred):
        endpoint, body, sane = case
        auth = {"good": good, "missing": None, "wrong": "Bearer nope"}[cred]
        raw = json.dumps(body, allow_nan=True).encode()
        status, ctype, text = post(base, endpoint, raw, auth, 30)
        statuses[status] += 1
        if cred != "good":
            problem = None if status == 401 else f"status {status} without a good token"
        else:
            problem = "hang" if status == 0 else judge(status, ctype, text, endpoint, body, body.get("stream") is True)
            if problem is None and sane and status not in (200, 429):
                problem = f"a well-formed body answered {status}"
        if problem:  # collected, not raised: one run counts every failure
            shown = raw if len(raw) < 300 else raw[:300] + b"..."
            bad.append(f"{problem} ({cred}, {endpoint}): {text[:200]!r} for {shown!r}")

    one()
    report(chaos_report, "fuzz_http_fake", statuses, bad)
    after = post(base, "completions", json.dumps(REFERENCE).encode(), good, 60)
    assert after[0] == 200 and json.loads(after[2])["choices"][0]["text"] == json.loads(reference[2])["choices"][0]["text"]
    assert statuses[200] > 0 and statuses[400] > 0  # the fuzz reached both sides


RESPONSE_FIELDS = {
    "model": st.sampled_from(["fake", "fake", "gpt-5", None]),
    "input": st.one_of(st.text(max_size=30), json_values, st.lists(st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "developer", "assistant", "system", "critic"]),
                               "content": st.one_of(st.text(max_size=20), st.lists(st.fixed_dictionaries(
                                   {"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                    "text": st.text(max_size=10)}), max_size=2))}),
        st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.sampled_from(["c1", ""]),
                               "name": st.sampled_from(["f", ""]), "arguments": st.sampled_from(["{}", "{", ""])}),
        st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.sampled_from(["c1", "c9"]),
                               "output": st.text(max_size=10)}),
        st.fixed_dictionaries({"type": st.sampled_from(["item_reference", "reasoning", "message"])}),
        json_values), max_size=4)),
    "instructions": st.one_of(st.text(max_size=20), st.none(), json_values),
    "max_output_tokens": st.one_of(st.integers(-2, 70), st.none(), st.just("5")),
    "temperature": st.one_of(st.floats(-1, 3), st.none()),
    "stream": st.booleans(),
    "store": st.one_of(st.booleans(), st.none(), json_values),
    "previous_response_id": st.one_of(st.sampled_from(["resp_nope", ""]), st.none()),
    "tools": st.one_of(st.lists(st.one_of(st.just({"type": "function", "name": "f", "parameters": TOOL["function"]["parameters"]}),
                                          st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"])})),
                                max_size=2), json_values),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", {"type": "function", "name": "f"}]), json_values),
    "text": st.one_of(st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                                       {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
                                       {"format": {"type": "json_schema"}}, {"verbosity": "low"}]), json_values),
    "reasoning": st.one_of(st.none(), st.just({"effort": "high"}), json_values),
    "truncation": st.sampled_from(["disabled", "auto", None]),
    "include": st.one_of(st.just([]), st.just(["message.output_text.logprobs"]), st.just(["reasoning.encrypted_content"])),
    "top_logprobs": st.one_of(st.none(), st.integers(-1, 22), st.just("3")),
    "metadata": st.one_of(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3), json_values),
}
KNOWN_RESPONSE = set(__import__("cluster.api.responses_api", fromlist=["ResponseRequest"]).ResponseRequest.model_fields)


@st.composite
def response_bodies(draw) -> tuple[dict, bool]:
    """(body, sane): half a valid body (text input, a small budget, maybe streamed or unstored),
    half any mix of the fields at any values."""
    if draw(st.booleans()):
        body = {"model": "fake", "input": draw(sane_text), "max_output_tokens": draw(st.integers(1, 8)),
                "stream": draw(st.booleans()), "store": draw(st.booleans())}
        if draw(st.booleans()):
            body["instructions"] = draw(sane_text)
        return body, True
    body = {name: draw(strategy) for name, strategy in RESPONSE_FIELDS.items() if draw(st.booleans())}
    for name in draw(st.lists(st.text(min_size=1, max_size=8), max_size=1)):
        body[name] = draw(json_values)
    return body, False


def judge_response(status: int, ctype: str, text: str, body: dict) -> str | None:
    if status != 200 or common_problem(status, text):
        return common_problem(status, text)
    if set(body) - KNOWN_RESPONSE:
        return f"unknown fields {sorted(set(body) - KNOWN_RESPONSE)} answered 200"
    if body.get("stream") is True:
        last = [line for line in text.splitlines() if line.startswith("event: ")][-1]
        return None if last in ("event: response.completed", "event: response.incomplete") else f"stream ended {last}"
    answer = json.loads(text)
    if answer["object"] != "response" or answer["status"] not in ("completed", "incomplete"):
        return "not a response"
    entries = [e for item in answer["output"] if item["type"] == "message"
               for part in item["content"] for e in part["logprobs"]]
    if entries and (body.get("include") != ["message.output_text.logprobs"]
                    or len(entries) > answer["usage"]["output_tokens"]):
        return f"{len(entries)} logprobs entries for include {body.get('include')!r}"
    return None


def judge_items(url: str, response_id: str, query: dict, auth: str) -> str | None:
    """GET the stored response's input items with this query: a list page, or 400 naming a parameter."""
    r = requests.get(f"{url}/{response_id}/input_items", params=query, headers={"authorization": auth}, timeout=30)
    if r.status_code == 400:
        return None if r.json()["error"]["param"] in query else f"input_items 400 naming none of {sorted(query)}"
    if r.status_code != 200:  # (evicted is 404: the store holds the last 1000 here)
        return f"input_items {query} answered {r.status_code}: {r.text[:200]!r}"
    page = r.json()
    return None if page["object"] == "list" and len(page["data"]) <= 100 else f"input_items not a list page: {r.text[:200]!r}"


def test_fuzz_openai_responses_api_fake_engine_app(chaos_service, chaos_report, fuzz_examples):
    """/v1/responses the same way: every answer 200 or a documented error, never a 5xx or a hang;
    a stream ends with response.completed / .incomplete; then the service answers as before."""
    chaos_service.apps("fake")
    url, good = f"{chaos_service.http}/fake/v1/responses", f"Bearer {TOKEN}"
    statuses: Counter = Counter()
    bad: list[str] = []

    @settings(max_examples=max(fuzz_examples[0] // 2, 20), deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(case=response_bodies(), query=st.dictionaries(st.sampled_from(["after", "limit", "order", "include", "x"]),
                                                         st.one_of(st.text(max_size=6), st.integers(-5, 200).map(str)),
                                                         max_size=3))
    def one(case, query):
        body, sane = case
        raw = json.dumps(body, allow_nan=True).encode()
        try:
            r = requests.post(url, data=raw, headers={"content-type": "application/json", "authorization": good},
                              timeout=30)
            status, ctype, text = r.status_code, r.headers.get("content-type", ""), r.text
        except requests.Timeout:
            status, ctype, text = 0, "", "timeout"
        statuses[status] += 1
        problem = "hang" if status == 0 else judge_response(status, ctype, text, body)
        if problem is None and sane and status not in (200, 429):
            problem = f"a well-formed body answered {status}"
        if problem is None and status == 200 and body.get("store") is not False and body.get("stream") is not True:
            problem = judge_items(url, json.loads(text)["id"], query, good)  # its input items, any query
        if problem:
            bad.append(f"{problem}: {text[:200]!r} for {raw[:300]!r}")

    one()
    report(chaos_report, "fuzz_http_responses", statuses, bad)
    after = post(chaos_service.http, "completions", json.dumps(REFERENCE).encode(), good, 60)
    assert after[0] == 200 and statuses[200] > 0 and statuses[400] > 0
