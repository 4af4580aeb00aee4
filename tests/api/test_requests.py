"""Request validation/conversion, auth, failure messages and response building — no Ray."""
import json
import time

import grpc
import pytest

from cluster.api import stubs
from cluster.api.auth import check_bearer
from cluster.api.requests import (
    Limits, check_constraint, known_request_fields, request_label, to_generation_request, validate_request,
)
from cluster.api.responses import Accumulator, chunk
from cluster.api.status import EngineFailure, FailureKind, ServiceError
from cluster.common.config import EngineConfig
from cluster.common.errors import EngineOverloadedError, EngineUnavailableError, InvalidRequestError
from cluster.common.request import FinishReason, ModelLimits, RequestOutput, SpecMode, SpecStats
from cluster.engine.fake_engine import FakeEngine
from cluster.routing.policy import Path, RouteDecision, RouteReason

pb2 = stubs.generation_pb2()
LIMITS = Limits(max_tokens=64, default_max_tokens=16, max_prompt_tokens=20, max_message_bytes=4096,
                max_stop_strings=3, max_stop_chars=8, max_constraint_chars=4000, max_label_chars=10)
DEEP_JSON = "[" * 1500 + "]" * 1500  # json.loads: RecursionError
DEEP_SCHEMA = json.dumps(json.loads('{"properties": {"a": ' * 150 + "{}" + "}}" * 150))  # check_schema
DEEP_REGEX = "(" * 900 + "a" + ")" * 900  # re.compile: RecursionError


def bad(match, **fields):
    with pytest.raises(ServiceError, match=match) as e:
        validate_request(pb2.GenerateRequest(**fields), "r", LIMITS)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("fields,match", [
    (dict(), "prompt is empty"),
    (dict(prompt="   "), "prompt is empty"),
    (dict(prompt="hi", messages=[pb2.ChatMessage(role="user", content="x")]), "prompt and messages"),
    (dict(prompt="hi", max_tokens=0), r"max_tokens must be in \[1, 64\]"),
    (dict(prompt="hi", max_tokens=65), r"max_tokens must be in \[1, 64\]"),
    (dict(prompt="hi", temperature=-0.1), "temperature must be >= 0"),
    (dict(prompt="hi", top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(prompt="hi", top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(prompt="hi", json_schema="{not json"), "json_schema is not valid JSON"),
    (dict(prompt="hi", json_schema=json.dumps({"type": "nonsense"})), "not a valid JSON Schema"),
    (dict(prompt="hi", regex="(unclosed"), "regex does not compile"),
    (dict(prompt="x" * 5000), "over the 4096-byte limit"),
    (dict(messages=[pb2.ChatMessage(role="wizard", content="x")]), "role must be one of"),
    (dict(prompt_token_ids=pb2.TokenIds(ids=[])), "prompt is empty"),
    (dict(prompt="hi", temperature=float("inf")), "temperature must be a finite number, got inf"),
    (dict(prompt="hi", temperature=float("nan")), "temperature must be a finite number, got nan"),
    (dict(prompt="hi", top_p=float("nan")), "top_p must be a finite number, got nan"),
    (dict(prompt="hi", top_p=float("-inf")), "top_p must be a finite number, got -inf"),
    (dict(prompt="hi", stop=["a", "b", "c", "d"]), "stop has 4 strings, limit is 3"),
    (dict(prompt="hi", stop=["ok", "123456789"]), r"stop\[1\] is 9 characters, limit is 8"),
    (dict(prompt="hi", json_schema=" " * 4001), "json_schema is 4001 characters, over the 4000-character limit"),
    (dict(prompt="hi", regex="a" * 4001), "regex is 4001 characters, over the 4000-character limit"),
    (dict(prompt="hi", json_schema=DEEP_JSON), "json_schema is nested too deeply"),
    (dict(prompt="hi", json_schema=DEEP_SCHEMA), "json_schema is nested too deeply"),
    (dict(prompt="hi", regex=DEEP_REGEX), "regex is nested too deeply"),
    (dict(prompt="hi", segment="ünïcödé"), "segment must be ASCII letters"),  # a metric tag (fuzz)
    (dict(prompt="hi", segment="a b"), "segment must be ASCII letters"),
    (dict(prompt="hi", draft_scope="tenant 7"), "draft_scope must be ASCII letters"),
    (dict(prompt="hi", draft_scope="t\x1f7"), "draft_scope must be ASCII letters"),
    (dict(prompt="hi", draft_scope="t" * 65), "draft_scope must be at most 64 characters"),
])
def test_invalid_requests(fields, match):
    bad(match, **fields)


def test_segment_labels_that_are_accepted():
    for segment in ("code", "tenant-7/chat", "v1.2:json_mode", "A_b"):
        assert validate_request(pb2.GenerateRequest(prompt="hi", segment=segment), "r1", LIMITS).segment == segment


def test_valid_request_conversion():
    v = validate_request(pb2.GenerateRequest(prompt="hello", temperature=0.5, top_p=0.9, top_k=5, seed=7,
                                             stop=["\n"], mode=pb2.MODE_PLAIN, segment="code",
                                             regex="[a-z]+"), "r1", LIMITS)
    assert v.params.max_tokens == 16 and v.params.temperature == 0.5 and v.params.seed == 7
    assert v.params.top_p == pytest.approx(0.9) and v.params.stop == ("\n",)
    assert v.mode is SpecMode.PLAIN and v.segment == "code" and v.constrained
    s = validate_request(pb2.GenerateRequest(prompt="x", json_schema=json.dumps({"type": "object"})), "r", LIMITS)
    assert s.constrained and s.segment == "default" and s.mode is SpecMode.AUTO


def test_caps_allow_what_they_allow():
    v = validate_request(pb2.GenerateRequest(prompt="hi", stop=["a", "b", "12345678"], temperature=1e-30,
                                             top_p=0.5), "r", LIMITS)
    assert v.params.stop == ("a", "b", "12345678") and v.params.temperature == pytest.approx(1e-30)
    assert validate_request(pb2.GenerateRequest(prompt="hi", regex="(" * 50 + "a" + ")" * 50), "r",
                            LIMITS).constrained


def test_constraint_check_is_separable_and_bounded():
    """The Router validates without the constraint's syntax and checks it apart (in a thread)."""
    pb = pb2.GenerateRequest(prompt="hi", regex=DEEP_REGEX)
    assert validate_request(pb, "r", LIMITS, constraints=False).constrained  # size only
    too_big = pb2.GenerateRequest(prompt="hi", regex="a" * 4001)
    with pytest.raises(ServiceError, match="over the 4000-character limit"):
        validate_request(too_big, "r", LIMITS, constraints=False)  # the size cap is never skipped
    for schema, regex, needle in ((DEEP_JSON, "", "json_schema is nested too deeply"),
                                  ("", DEEP_REGEX, "regex is nested too deeply"),
                                  ("", "a(b", "regex does not compile")):
        t0 = time.monotonic()
        with pytest.raises(ServiceError, match=needle) as e:
            check_constraint(schema, regex)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and time.monotonic() - t0 < 5
    check_constraint(json.dumps({"type": "object"}), "")
    check_constraint("", "[a-z]+")


def test_request_id_is_the_servers_and_the_clients_only_a_label():
    label = request_label([("application", "x"), ("request_id", "mine")], LIMITS)
    v = validate_request(pb2.GenerateRequest(prompt="hi"), "server-uuid", LIMITS, label=label)
    assert (v.request_id, v.label, v.echo_id) == ("server-uuid", "mine", "mine")
    engine = FakeEngine(EngineConfig())
    assert to_generation_request(v, engine, LIMITS, 259).request_id == "server-uuid"
    unlabelled = validate_request(pb2.GenerateRequest(prompt="hi"), "server-uuid", LIMITS)
    assert unlabelled.echo_id == "server-uuid" and request_label([("application", "x")], LIMITS) == ""
    with pytest.raises(ServiceError, match="request_id metadata must be at most 10 characters") as e:
        request_label([("request_id", "x" * 11)], LIMITS)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_tokenize_and_prompt_length():
    engine = FakeEngine(EngineConfig())
    ok = validate_request(pb2.GenerateRequest(prompt="abc"), "r", LIMITS)
    req = to_generation_request(ok, engine, LIMITS, vocab_size=engine.vocab_size)
    assert req.prompt_token_ids == engine.tokenize("abc") and req.request_id == "r"
    long = validate_request(pb2.GenerateRequest(prompt="y" * 21), "r", LIMITS)
    with pytest.raises(InvalidRequestError, match="prompt too long: 21 tokens, limit is 20"):
        to_generation_request(long, engine, LIMITS, vocab_size=engine.vocab_size)
    ids = validate_request(pb2.GenerateRequest(prompt_token_ids=pb2.TokenIds(ids=[1, 999])), "r", LIMITS)
    with pytest.raises(InvalidRequestError, match="out of range"):
        to_generation_request(ids, engine, LIMITS, vocab_size=engine.vocab_size)
    chat = validate_request(pb2.GenerateRequest(messages=[pb2.ChatMessage(role="user", content="q")]), "r", LIMITS)
    assert to_generation_request(chat, engine, LIMITS, 259).prompt_token_ids == engine.tokenize("<user>q\n<assistant>")


def test_draft_scope_reaches_the_engine_request():
    engine = FakeEngine(EngineConfig())
    for scope in ("", "tenant-7", "bench-1a2b/routed/grpc", "t" * 64):
        v = validate_request(pb2.GenerateRequest(prompt="abc", draft_scope=scope), "r", LIMITS)
        assert v.draft_scope == scope
        assert to_generation_request(v, engine, LIMITS, vocab_size=engine.vocab_size).draft_scope == scope


def test_prediction_reaches_the_engine_request_as_tokens():
    engine = FakeEngine(EngineConfig())
    v = validate_request(pb2.GenerateRequest(prompt="abc", prediction="the answer"), "r", LIMITS)
    assert to_generation_request(v, engine, LIMITS, engine.vocab_size).prediction_token_ids == tuple(
        engine.tokenize("the answer"))
    plain = validate_request(pb2.GenerateRequest(prompt="abc"), "r", LIMITS)
    assert to_generation_request(plain, engine, LIMITS, engine.vocab_size).prediction_token_ids == ()
    with pytest.raises(ServiceError, match="prediction needs speculative decoding, and mode PLAIN never drafts"):
        validate_request(pb2.GenerateRequest(prompt="abc", prediction="x", mode=2), "r", LIMITS)
    long = validate_request(pb2.GenerateRequest(prompt="abc", prediction="p" * (LIMITS.max_prompt_tokens + 1)),
                            "r", LIMITS)
    with pytest.raises(InvalidRequestError, match=f"prediction too long: {LIMITS.max_prompt_tokens + 1} tokens"):
        to_generation_request(long, engine, LIMITS, engine.vocab_size)


def test_logprobs_reach_the_sampling_params_and_out_of_range_is_refused():
    assert validate_request(pb2.GenerateRequest(prompt="abc"), "r", LIMITS).params.logprobs is None
    for n in (0, 7, 20):  # 0 is set, not unset: each token's own log-probability, no alternatives
        assert validate_request(pb2.GenerateRequest(prompt="abc", logprobs=n), "r", LIMITS).params.logprobs == n
    with pytest.raises(ServiceError, match=r"logprobs must be an integer in \[0, 20\], got 21"):
        validate_request(pb2.GenerateRequest(prompt="abc", logprobs=21), "r", LIMITS)


def test_a_logit_bias_outside_the_vocabulary_is_refused_next_to_the_model():
    engine = FakeEngine(EngineConfig())
    v = validate_request(pb2.GenerateRequest(prompt="abc", logit_bias={engine.vocab_size: 1.0}), "r", LIMITS)
    req = to_generation_request(v, engine, LIMITS, engine.vocab_size)
    with pytest.raises(InvalidRequestError, match=f"logit_bias token id {engine.vocab_size} outside the vocabulary"):
        ModelLimits(engine.vocab_size, 1024, 4096).check(req)


def test_min_tokens_and_stop_token_ids_are_checked():
    v = validate_request(pb2.GenerateRequest(prompt="abc", max_tokens=8, min_tokens=8, stop_token_ids=[3]), "r", LIMITS)
    assert (v.params.min_tokens, v.params.stop_token_ids) == (8, (3,))
    assert v.params.holds_ends(7) and not v.params.holds_ends(8) and not v.params.shapes_logits
    for pb, match in (
            (pb2.GenerateRequest(prompt="abc", max_tokens=8, min_tokens=9),
             r"min_tokens must be an integer in \[0, max_tokens = 8\], got 9"),
            (pb2.GenerateRequest(prompt="abc", min_tokens=17), r"max_tokens = 16\]"),  # the default budget
            (pb2.GenerateRequest(prompt="abc", stop_token_ids=[-1]), r"stop_token_ids must be token ids \(>= 0\)"),
            (pb2.GenerateRequest(prompt="abc", stop_token_ids=list(range(65))), "stop_token_ids has 65 ids, limit is 64"),
            (pb2.GenerateRequest(prompt="abc", min_tokens=2, regex="[a-z]+"),
             "min_tokens cannot be combined with regex"),
            (pb2.GenerateRequest(prompt="abc", min_tokens=2, grammar='start: "a"+'),
             "min_tokens cannot be combined with grammar")):
        with pytest.raises(ServiceError, match=match):
            validate_request(pb, "r", LIMITS)
    engine = FakeEngine(EngineConfig())
    far = validate_request(pb2.GenerateRequest(prompt="abc", stop_token_ids=[engine.vocab_size]), "r", LIMITS)
    with pytest.raises(InvalidRequestError, match=f"stop_token_ids token id {engine.vocab_size} outside the vocabulary"):
        ModelLimits(engine.vocab_size, 1024, 4096).check(to_generation_request(far, engine, LIMITS, engine.vocab_size))


def test_auth():
    check_bearer([], None)  # auth off
    check_bearer([("authorization", "Bearer s3cret")], "s3cret")
    for md in ([], [("authorization", "Bearer nope")], [("authorization", "Basic s3cret")]):
        with pytest.raises(ServiceError) as e:
            check_bearer(md, "s3cret")
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_engine_failure_mapping():
    bad_input = EngineFailure.from_exception(InvalidRequestError("prompt too long"), "id1")
    assert bad_input.kind is FailureKind.INVALID_ARGUMENT and bad_input.message == "prompt too long"
    full = EngineFailure.from_exception(EngineOverloadedError(), "id1").to_service_error()
    assert full.code == grpc.StatusCode.RESOURCE_EXHAUSTED and full.message == "engine queue is full"
    gone = EngineFailure.from_exception(EngineUnavailableError("engine process exited (code -9)"), "id1")
    assert gone.to_service_error().code == grpc.StatusCode.UNAVAILABLE
    assert "stopped; retry" in gone.message and "-9" not in gone.message


def test_unexpected_exception_text_never_reaches_the_client():
    leak = RuntimeError("Traceback (most recent call last): pid=4242 node 10.1.2.3 actor ffff0001")
    for exc in (leak, KeyError("k"), RecursionError("deep")):
        f = EngineFailure.from_exception(exc, "abc123")
        assert f.kind is FailureKind.INTERNAL and f.message == "internal error (id abc123)"
        assert f.to_service_error().code == grpc.StatusCode.INTERNAL


def test_response_building():
    d = RouteDecision(Path.SPECULATIVE, RouteReason.BELOW_ENTER_THRESHOLD)
    spec = SpecStats()
    spec.record(4, 3)
    acc = Accumulator("r", d)
    acc.add(RequestOutput("r", [1, 2], "ab"))
    last = RequestOutput("r", [3], "c", finished=True, finish_reason=FinishReason.LENGTH,
                         num_prompt_tokens=5, num_output_tokens=3, spec=spec)
    acc.add(last)
    r = acc.response()
    assert r.text == "abc" and list(r.token_ids) == [1, 2, 3] and r.finish_reason == pb2.FINISH_REASON_LENGTH
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 3
    assert r.route.path == pb2.PATH_SPECULATIVE and r.route.reason == "below_enter_threshold"
    assert r.spec.accepted_tokens == 3 and r.spec.acceptance_rate == pytest.approx(0.75)
    assert r.request_id == "r"
    first = chunk(RequestOutput("engine-id", [1], "a"), d, first=True, total_tokens=1, request_id="label")
    assert first.route.reason == "below_enter_threshold" and not first.HasField("usage")
    assert first.request_id == "label"  # the id the caller echoes, not the engine's
    end = chunk(last, d, first=False, total_tokens=3, request_id="label")
    assert end.finished and end.usage.completion_tokens == 3 and end.spec.drafts == 1


def _unknown(number: int, value: int = 1) -> bytes:
    from google.protobuf.internal.encoder import _VarintBytes

    return _VarintBytes(number << 3) + _VarintBytes(value)


def _nested(number: int, payload: bytes) -> bytes:
    """A GenerateRequest of one length-delimited field ``number`` holding ``payload``."""
    from google.protobuf.internal.encoder import _VarintBytes

    return _VarintBytes(number << 3 | 2) + _VarintBytes(len(payload)) + payload


@pytest.mark.parametrize("raw,where", [
    (pb2.GenerateRequest(prompt="hi").SerializeToString() + _unknown(99), "GenerateRequest carries field number 99"),
    (pb2.GenerateRequest(prompt="hi").SerializeToString() + _unknown(41) + _unknown(40),
     "GenerateRequest carries field number 40, 41"),
    (_nested(3, pb2.TokenIds(ids=[1, 2]).SerializeToString() + _unknown(2)), "prompt_token_ids carries field number 2"),
    (_nested(2, pb2.ChatMessage(role="user", content="x").SerializeToString() + _unknown(7)),
     "messages.0. carries field number 7"),
])
def test_a_field_number_the_proto_lacks_is_refused_not_ignored(raw, where):
    with pytest.raises(ServiceError, match=where) as e:
        validate_request(pb2.GenerateRequest.FromString(raw), "r", LIMITS)
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT and "does not implement" in e.value.message


def test_known_request_fields_are_every_field_of_the_proto():
    names = known_request_fields(pb2)
    assert names[:3] == ["prompt", "messages", "prompt_token_ids"] and names[-1] == "min_p"
    assert len(names) == len(pb2.GenerateRequest.DESCRIPTOR.fields) == 26
    # a request using every one of them parses and validates: nothing the list names is refused
    ok = pb2.GenerateRequest(prompt="hi", max_tokens=3, temperature=0.5, top_p=0.9, top_k=4, seed=1, stop=["x"],
                             mode=1, segment="chat", regex="[a-z]+", ignore_eos=True, draft_scope="t1",
                             prediction="hi there", logprobs=2, presence_penalty=0.5, frequency_penalty=0.25,
                             logit_bias={7: -1.5}, stop_token_ids=[5, 9], prompt_logprobs=1,
                             repetition_penalty=1.5, min_p=0.25)
    v = validate_request(pb2.GenerateRequest.FromString(ok.SerializeToString()), "r", LIMITS)
    assert (v.draft_scope, v.prediction, v.params.logprobs, v.params.prompt_logprobs) == ("t1", "hi there", 2, 1)
    assert (v.params.repetition_penalty, v.params.min_p) == (1.5, 0.25)
    ok.ClearField("regex")  # min_tokens is refused with a constraint
    ok.min_tokens = 2
    v = validate_request(pb2.GenerateRequest.FromString(ok.SerializeToString()), "r", LIMITS)
    assert (v.params.stop_token_ids, v.params.min_tokens) == ((5, 9), 2)
    assert (v.params.presence_penalty, v.params.frequency_penalty, v.params.logit_bias) == (0.5, 0.25, ((7, -1.5),))


def test_max_tokens_zero_is_a_scoring_request_only_with_prompt_logprobs():
    scoring = validate_request(pb2.GenerateRequest(prompt="hi there", max_tokens=0, prompt_logprobs=0), "r", LIMITS)
    assert scoring.params.scores_only and scoring.params.prompt_logprobs == 0
    with pytest.raises(ServiceError, match=r"0 only scores the prompt: it needs prompt_logprobs"):
        validate_request(pb2.GenerateRequest(prompt="hi", max_tokens=0), "r", LIMITS)
    with pytest.raises(ServiceError, match=r"prompt_logprobs must be an integer in \[0, 20\]"):
        validate_request(pb2.GenerateRequest(prompt="hi", prompt_logprobs=21), "r", LIMITS)
    unset = validate_request(pb2.GenerateRequest(prompt="hi"), "r", LIMITS)
    assert unset.params.prompt_logprobs is None and not unset.params.scores_only


def test_repetition_penalty_and_min_p_are_carried_and_checked():
    v = validate_request(pb2.GenerateRequest(prompt="abc", repetition_penalty=1.3, min_p=0.1), "r", LIMITS)
    assert v.params.repetition_penalty == pytest.approx(1.3) and v.params.min_p == pytest.approx(0.1)
    assert v.params.shapes_logits
    unset = validate_request(pb2.GenerateRequest(prompt="abc"), "r", LIMITS).params
    assert (unset.repetition_penalty, unset.min_p, unset.shapes_logits) == (1.0, 0.0, False)
    for pb, match in (
            (pb2.GenerateRequest(prompt="abc", repetition_penalty=0.0), r"repetition_penalty must be in \(0, 10\] \(1 = none\), got 0.0"),
            (pb2.GenerateRequest(prompt="abc", repetition_penalty=11), r"repetition_penalty must be in \(0, 10\]"),
            (pb2.GenerateRequest(prompt="abc", repetition_penalty=float("nan")), "repetition_penalty must be a finite number"),
            (pb2.GenerateRequest(prompt="abc", min_p=-0.5), r"min_p must be in \[0, 1\] \(0 = none\), got -0.5"),
            (pb2.GenerateRequest(prompt="abc", min_p=float("inf")), "min_p must be a finite number")):
        with pytest.raises(ServiceError, match=match):
            validate_request(pb, "r", LIMITS)
