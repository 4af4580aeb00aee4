"""OpenAI request bodies -> RequestFields -> the one validation gRPC uses too — no Ray."""
import dataclasses
import json

import grpc
import pytest

from cluster.api import stubs
from cluster.api.openai_schemas import (
    ChatCompletionRequest, CompletionRequest, DetokenizeBody, TokenizeBody, chat_fields, check_choices,
    completion_batch, echoed_prompts, num_candidates, parse_body, tokenize_body,
)
from cluster.api.requests import Limits, validate_fields, validate_request
from cluster.api.status import ServiceError
from cluster.common.request import SpecMode

LIMITS = Limits(max_tokens=64, default_max_tokens=16, max_message_bytes=4096, max_stop_strings=3)
pb2 = stubs.generation_pb2()


def chat(**body):
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}).encode()
    body = parse_body(raw, ChatCompletionRequest)
    check_choices(body, LIMITS)  # as the HTTP front end reads a body
    return chat_fields(body, len(raw), "m")


def completion(**body):
    raw = json.dumps({"prompt": "hi", **body}).encode()
    body = parse_body(raw, CompletionRequest)
    check_choices(body, LIMITS)
    return completion_batch(body, len(raw), "m")[0]


def refused(fn, match, param=None, code=grpc.StatusCode.INVALID_ARGUMENT, **body):
    with pytest.raises(ServiceError, match=match) as e:
        fn(**body)
    assert e.value.code == code and e.value.param == param


def test_chat_body_to_fields():
    f = chat(model="m", max_completion_tokens=7, max_tokens=3, temperature=0, top_p=0.5, seed=3, stop="\n",
             top_k=4, mode="PLAIN", segment="code", ignore_eos=True, user="u",
             draft_scope="tenant-7",
             messages=[{"role": "system", "content": "be brief"},
                       {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert f.messages == (("system", "be brief"), ("user", "ab"))
    assert (f.max_tokens, f.temperature, f.top_p, f.seed, f.stop, f.top_k) == (7, 0, 0.5, 3, ("\n",), 4)
    assert f.mode is SpecMode.PLAIN and f.segment == "code" and f.ignore_eos and f.prompt is None
    assert f.draft_scope == "tenant-7"
    d = chat()
    assert d.temperature == 1.0 and d.max_tokens is None and d.mode is SpecMode.AUTO  # OpenAI's defaults


def test_completion_prompt_shapes():
    assert completion(prompt="abc").prompt == "abc"
    assert completion(prompt=[5, 6]).token_ids == (5, 6)
    assert completion(prompt=["one"]).prompt == "one" and completion(prompt=[[7, 8]]).token_ids == (7, 8)
    batch = completion_batch(parse_body(b'{"prompt": ["a", "b"], "max_tokens": 3, "echo": true}', CompletionRequest),
                             60, "m")  # a batch: one RequestFields per prompt, the rest the same
    assert [f.prompt for f in batch] == ["a", "b"] and {f.max_tokens for f in batch} == {3}
    ids = completion_batch(parse_body(b'{"prompt": [[1, 2], [3]], "echo": true}', CompletionRequest), 40, "m")
    assert [f.token_ids for f in ids] == [(1, 2), (3,)] and {f.prompt_logprobs for f in ids} == {0}  # spelled
    refused(completion, r"a batch of 3 prompts x 3 choices is 9 engine requests, over limits.max_choices \(8\)",
            "prompt", prompt=["a", "b", "c"], n=3)
    refused(completion, r"a batch of 2 prompts x 5 candidates is 10 engine requests", "prompt",
            prompt=["a", "b"], best_of=5)
    completion(prompt=["a"] * 8)  # at the cap
    assert completion(prompt=[]).token_ids == ()  # the shared rule says "no ids" (below)
    with pytest.raises(ServiceError, match="prompt_token_ids has no ids"):
        validate_fields(completion(prompt=[]), "r", LIMITS)


@pytest.mark.parametrize("body,match,param", [
    (dict(temperature="0.5"), "temperature: Input should be a valid number", "temperature"),
    (dict(max_tokens=True), "max_tokens: Input should be a valid integer", "max_tokens"),
    (dict(stop=5), "stop: Input should be a valid", "stop"),
    (dict(stream="yes"), "stream: Input should be a valid boolean", "stream"),
    (dict(messages="hi"), "messages: Input should be a valid list", "messages"),
    (dict(messages=[{"content": "x"}]), "messages.0.role: Field required", "messages"),
    (dict(n=0), r"n must be in \[1, 8\], got 0", "n"),
    (dict(n=9), r"n must be in \[1, 8\], got 9", "n"),  # limits.max_choices
    (dict(n="2"), "n: Input should be a valid integer", "n"),
    (dict(logprobs=3), "logprobs: Input should be a valid boolean", "logprobs"),  # chat's is a switch
    (dict(top_logprobs=2), "top_logprobs needs logprobs: true", "top_logprobs"),
    (dict(logprobs=True, top_logprobs=21), r"top_logprobs must be in \[0, 20\], got 21", "top_logprobs"),
    (dict(presence_penalty="high"), "presence_penalty: Input should be a valid number", "presence_penalty"),
    (dict(logit_bias={"fifty": 1}), "logit_bias keys must be token ids, got 'fifty'", "logit_bias"),
    (dict(tools=[{"type": "function"}]), "tools.0.function: Field required", "tools"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format json_schema needs json_schema.schema", "response_format"),
    (dict(response_format={"type": "xml"}), "response_format.type: Input should be", "response_format"),
    (dict(regex="a+", response_format={"type": "json_object"}), "set at most one of response_format",
     "response_format"),
    (dict(mode="fast"), "mode must be one of", "mode"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "only text content parts",
     "messages"),
])
def test_chat_refusals(body, match, param):
    refused(chat, match, param, **body)


@pytest.mark.parametrize("body,match,param", [
    (dict(typical_p=0.9), r"unrecognized request argument supplied: typical_p — this server does not implement it",
     "typical_p"),
    (dict(length_penalty=1.1, guided_json={}),
     r"length_penalty, guided_json — .* \(guided_json: use response_format json_schema\)",
     "length_penalty"),
    (dict(messages=[{"role": "user", "content": "x", "cache": True}]), "supplied: messages.0.cache", "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]}]),
     "supplied: messages.0.content.0.cache_control", "messages"),
    (dict(response_format={"type": "json_object", "strict": True}), "supplied: response_format.strict",
     "response_format"),
    (dict(stream=True, stream_options={"include_usage": True, "chunk": 1}), "supplied: stream_options.chunk",
     "stream_options"),
])
def test_a_field_we_do_not_know_is_refused_never_ignored(body, match, param):
    """OpenAI answers 400 "Unrecognized request argument supplied"; so do we — a vLLM client's
    typical_p or guided_json parsed past and ignored would change the output without a word."""
    refused(chat, match, param, **body)
    if "messages" not in body:
        refused(completion, match, param, **body)


def test_openai_fields_that_ask_for_nothing_are_accepted():
    """The fields an OpenAI client may send at their do-nothing value change nothing here."""
    f = chat(tool_choice="none", function_call="auto", parallel_tool_calls=True, modalities=["text"], store=False,
             metadata={"k": "v"}, service_tier="auto", prompt_cache_key="p", safety_identifier="s",
             stream=True, stream_options={"include_usage": True, "include_obfuscation": False},
             messages=[{"role": "user", "content": "a"},
                       {"role": "assistant", "content": "b", "refusal": None, "tool_calls": None,
                        "function_call": None, "audio": None, "annotations": []},
                       {"role": "user", "content": "c"}])
    bare = chat(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                          {"role": "user", "content": "c"}])
    assert dataclasses.replace(f, size=bare.size) == bare  # only the body's bytes differ (stream: not a field)


@pytest.mark.parametrize("body,match,param", [
    (dict(tool_choice="required"), "tool_choice needs tools", "tool_choice"),  # the rest: test_openai_tools.py
    (dict(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice needs tools", "tool_choice"),
    (dict(function_call={"name": "f"}), "function_call may only", "function_call"),
    (dict(modalities=["text", "audio"]), r"modalities may only be \['text'\]", "modalities"),
    (dict(audio={"voice": "alloy", "format": "wav"}), "audio output is not supported", "audio"),
    (dict(store=True), "store is not supported", "store"),
    (dict(service_tier="priority"), "service_tier may only be 'auto' or 'default'", "service_tier"),
    (dict(prediction={"type": "image", "content": "x"}), "prediction.type: Input should be 'content'", "prediction"),
    (dict(prediction={"type": "content", "content": [{"type": "image_url", "image_url": {}}]}),
     r"prediction.content\[0\]: only text content parts are supported, got type 'image_url'", "prediction"),
    (dict(prediction={"type": "content", "content": [{"type": "text", "text": "a", "cache": 1}]}),
     "unrecognized request argument supplied: prediction.content.0.cache", "prediction"),
    (dict(prediction={"type": "content", "content": "x"}, mode="plain"), "prediction needs speculative decoding",
     None),
    (dict(reasoning_effort="low"), "reasoning_effort is not supported", "reasoning_effort"),
    (dict(verbosity="low"), "verbosity is not supported", "verbosity"),
    (dict(web_search_options={}), "web search is not supported", "web_search_options"),
    (dict(stream=True, stream_options={"include_obfuscation": True}), "include_obfuscation is not supported",
     "stream_options"),
    (dict(stream_options={"include_usage": True}), "stream_options is only allowed with stream: true",
     "stream_options"),
    (dict(messages=[{"role": "user", "content": "x", "name": "bob"}]), r"messages\[0\].name is not supported",
     "messages"),
    (dict(messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": "1", "tool_call_id": "c"}]),
     r"messages\[1\].tool_call_id 'c' answers no earlier tool call", "messages"),
])
def test_openai_fields_we_do_not_do_are_refused(body, match, param):
    refused(lambda **b: validate_fields(chat(**b), "r", LIMITS), match, param, **body)


def test_prediction_is_grpcs_prediction():
    """OpenAI's predicted output becomes gRPC's ``prediction`` (text parts joined)."""
    assert chat(prediction={"type": "content", "content": "def f():\n    return 1"}).prediction == "def f():\n    return 1"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert chat(prediction={"type": "content", "content": parts}).prediction == "ab"
    assert chat().prediction == ""


def test_response_format_text_is_plain_output():
    assert chat(response_format={"type": "text"}).json_schema == ""


def test_response_format_and_regex_are_grpcs_constraints():
    """json_object / json_schema / the regex extension become the json_schema / regex fields gRPC
    carries (one validation, one enforcement)."""
    assert json.loads(chat(response_format={"type": "json_object"}).json_schema) == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    f = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert json.loads(f.json_schema) == schema and f.regex == ""
    f = chat(regex="[a-z]+")
    assert f.regex == "[a-z]+" and f.json_schema == ""


def test_completion_refusals_and_model():
    refused(completion, "max_tokens 0 needs echo: true", "max_tokens", max_tokens=0)
    refused(completion, "suffix is not supported", "suffix", suffix="x")
    refused(completion, "the model 'other' does not exist; this server serves 'm'", "model",
            grpc.StatusCode.NOT_FOUND, model="other")
    for raw, match in ((b"{nope", "not valid JSON"), (b"[1]", "must be a JSON object"), (b"", "JSON object")):
        with pytest.raises(ServiceError, match=match):
            parse_body(raw, CompletionRequest)


@pytest.mark.parametrize("http,grpc_fields", [
    (dict(max_tokens=65), dict(max_tokens=65)),
    (dict(top_p=1.5), dict(top_p=1.5)),
    (dict(temperature=-1), dict(temperature=-1)),
    (dict(stop=["a", "b", "c", "d"]), dict(stop=["a", "b", "c", "d"])),
    (dict(prompt="  "), dict(prompt="  ")),
    (dict(segment="s" * 65), dict(segment="s" * 65)),
    (dict(regex="a{1000000}"), dict(regex="a{1000000}")),  # limits.max_constraint_repeat
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "array", "minItems": 99999}}}), dict(json_schema=json.dumps({"type": "array", "minItems": 99999}))),
])
def test_one_validation_two_front_ends(http, grpc_fields):
    """The same bad request is refused with the same message whichever front end it came through."""
    with pytest.raises(ServiceError) as via_grpc:
        validate_request(pb2.GenerateRequest(**{"prompt": "hi", **grpc_fields}), "r", LIMITS)
    with pytest.raises(ServiceError) as via_http:
        validate_fields(completion(**http), "r", LIMITS)
    assert via_http.value.message == via_grpc.value.message
    assert via_http.value.code == via_grpc.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_http_body_size_and_seed_range_use_the_shared_rules():
    with pytest.raises(ServiceError, match="over the 4096-byte limit"):
        validate_fields(completion(prompt="x" * 5000), "r", LIMITS)
    for seed in (-1, 1 << 64):
        with pytest.raises(ServiceError, match=r"seed must be in \[0, 2\*\*64\)"):
            validate_fields(completion(seed=seed), "r", LIMITS)
    ok = validate_fields(completion(seed=(1 << 64) - 1, temperature=0.7), "r", LIMITS)
    assert ok.params.seed == (1 << 64) - 1 and ok.params.max_tokens == 16 and not ok.constrained


def test_logprobs_become_grpcs_logprobs():
    """chat: logprobs switches them on, top_logprobs says how many alternatives; completions:
    logprobs is the number; unset or off: none (not 0, which still reports each token's own)."""
    assert chat().logprobs is None and chat(logprobs=False).logprobs is None
    assert chat(logprobs=True).logprobs == 0 and chat(logprobs=True, top_logprobs=5).logprobs == 5
    assert chat(logprobs=False, top_logprobs=0).logprobs is None
    assert completion().logprobs is None and completion(logprobs=0).logprobs == 0
    assert completion(logprobs=20).logprobs == 20
    assert validate_fields(chat(logprobs=True, top_logprobs=3), "r", LIMITS).params.logprobs == 3
    refused(completion, r"logprobs must be in \[0, 20\], got 21", "logprobs", logprobs=21)
    refused(completion, "logprobs: Input should be a valid integer", "logprobs", logprobs=True)
    refused(chat, r"top_logprobs must be in \[0, 20\], got -1", "top_logprobs", logprobs=True, top_logprobs=-1)


def test_penalties_and_logit_bias_become_grpcs_fields_and_its_ranges_apply():
    f = chat(presence_penalty=0.5, frequency_penalty=-1, logit_bias={"50": -100, "7": 2.5})
    assert (f.presence_penalty, f.frequency_penalty, dict(f.logit_bias)) == (0.5, -1.0, {50: -100, 7: 2.5})
    params = validate_fields(f, "r", LIMITS).params
    assert params.logit_bias == ((7, 2.5), (50, -100.0)) and params.shapes_logits
    assert not validate_fields(chat(), "r", LIMITS).params.shapes_logits  # unset: nothing shaped
    for body, match in ((dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
                        (dict(logit_bias={"3": 101}), r"logit_bias\[3\] must be in \[-100, 100\]"),
                        (dict(logit_bias={"-3": 1}), "logit_bias keys must be token ids"),
                        (dict(logit_bias={str(i): 1 for i in range(301)}), "logit_bias names 301 tokens, limit is 300")):
        with pytest.raises(ServiceError, match=match):
            validate_fields(completion(**body), "r", LIMITS)


def test_min_tokens_and_stop_token_ids_are_vllms_extensions():
    f = completion(min_tokens=3, stop_token_ids=[5, 7], max_tokens=9)
    params = validate_fields(f, "r", LIMITS).params
    assert (params.min_tokens, params.stop_token_ids) == (3, (5, 7))
    assert validate_fields(chat(), "r", LIMITS).params.min_tokens == 0
    for body, match in ((dict(min_tokens=10, max_tokens=9), r"min_tokens must be an integer in \[0, max_tokens = 9\]"),
                        (dict(min_tokens=-1), r"min_tokens must be an integer in \[0"),
                        (dict(min_tokens=2, response_format={"type": "json_object"}),
                         "min_tokens cannot be combined with json_schema")):
        with pytest.raises(ServiceError, match=match):
            validate_fields(chat(**body), "r", LIMITS, constraints=False)
    refused(chat, "stop_token_ids.0: Input should be a valid integer", "stop_token_ids", stop_token_ids=["a"])
    refused(chat, r"\(min_new_tokens: use min_tokens\)", "min_new_tokens", min_new_tokens=3)


def test_n_choices_within_limits_max_choices():
    for n in (None, 1, 3, LIMITS.max_choices):  # each choice is its own engine request (the Router's)
        chat(n=n)
        completion(n=n)
    raw = json.dumps({"prompt": "hi", "n": 3}).encode()
    with pytest.raises(ServiceError, match=r"n must be in \[1, 2\], got 3"):
        check_choices(parse_body(raw, CompletionRequest), dataclasses.replace(LIMITS, max_choices=2))


def test_best_of_is_n_to_max_choices_and_never_streamed():
    for best_of, n in ((1, None), (3, 2), (LIMITS.max_choices, 1), (2, 2)):
        completion(best_of=best_of, n=n)
    refused(completion, r"best_of must be in \[1, 8\], got 9", "best_of", best_of=9)
    refused(completion, r"best_of must be in \[1, 8\], got 0", "best_of", best_of=0)
    refused(completion, r"best_of \(2\) must be at least n \(3\)", "best_of", best_of=2, n=3)
    refused(completion, "best_of cannot be streamed", "best_of", best_of=2, stream=True)
    completion(best_of=1, stream=True)  # one candidate: nothing to choose, streams as usual
    refused(chat, "unrecognized request argument supplied: best_of", "best_of", best_of=2)  # completions only
    assert num_candidates(parse_body(b'{"prompt": "x", "best_of": 3, "n": 2}', CompletionRequest)) == 3
    assert num_candidates(parse_body(b'{"prompt": "x", "n": 2}', CompletionRequest)) == 2


def test_echo_asks_for_the_prompts_entries_where_they_are_needed():
    """A text prompt echoes as sent (no entries needed unless scored); token ids are spelled from
    their entries' bytes; logprobs scores the prompt with as many alternatives; max_tokens 0 is a
    scoring request (prompt_logprobs set, so the shared rules let it through)."""
    assert completion(echo=True).prompt_logprobs is None
    assert completion(echo=True, logprobs=3).prompt_logprobs == 3
    assert completion(echo=True, prompt=[5, 6, 7]).prompt_logprobs == 0
    assert completion(logprobs=3).prompt_logprobs is None  # no echo: the output's alone
    scoring = completion(echo=True, max_tokens=0, logprobs=1)
    assert (scoring.max_tokens, scoring.prompt_logprobs) == (0, 1)
    v = validate_fields(scoring, "r", LIMITS)
    assert v.params.scores_only and v.params.logprobs == 1
    assert completion(echo=True, max_tokens=0).prompt_logprobs == 0
    for prompt, want in (("say hi", ("say hi",)), (["say hi"], ("say hi",)), ([1, 2], ("",)), ([[1, 2]], ("",)),
                         (["a", "b"], ("a", "b")), ([[1], [2, 3]], ("", ""))):
        assert echoed_prompts(parse_body(json.dumps({"prompt": prompt, "echo": True}).encode(), CompletionRequest)) == want
    assert echoed_prompts(parse_body(b'{"prompt": "x"}', CompletionRequest)) is None
    refused(chat, "unrecognized request argument supplied: echo", "echo", echo=True)  # OpenAI's chat has none


def test_tokenize_bodies():
    def tok(**body):
        return tokenize_body(parse_body(json.dumps(body).encode(), TokenizeBody), "m")

    assert tok(prompt="hi") == ("hi", [])
    assert tok(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
               add_generation_prompt=True, model="m") == ("", [("user", "ab")])
    refused(tok, "set exactly one of prompt and messages", "prompt")
    refused(tok, "add_special_tokens true is not supported", "add_special_tokens", prompt="x", add_special_tokens=True)
    refused(tok, "add_generation_prompt false", "add_generation_prompt", messages=[], add_generation_prompt=False)
    refused(tok, r"messages\[0\]: /tokenize takes a message's role and content only", "messages",
            messages=[{"role": "tool", "content": "x", "tool_call_id": "c1"}])
    refused(tok, "does not exist", "model", grpc.StatusCode.NOT_FOUND, prompt="x", model="other")
    assert parse_body(b'{"tokens": [1, 2]}', DetokenizeBody).tokens == [1, 2]
