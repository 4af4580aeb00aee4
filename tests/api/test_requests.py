"""Request validation/conversion, auth and response building — no Ray."""
import json

import grpc
import pytest

from cluster.api import stubs
from cluster.api.auth import check_bearer
from cluster.api.requests import Limits, to_generation_request, validate_request
from cluster.api.responses import Accumulator, chunk
from cluster.api.status import EngineFailure, FailureKind, ServiceError
from cluster.engine.config import EngineConfig
from cluster.engine.fake_engine import FakeEngine
from cluster.engine.request import (EngineOverloadedError, EngineUnavailableError, FinishReason,
                                    InvalidRequestError, RequestOutput, SpecMode, SpecStats)
from cluster.routing.policy import Path, RouteDecision, RouteReason

pb2 = stubs.generation_pb2()
LIMITS = Limits(max_tokens=64, default_max_tokens=16, max_prompt_tokens=20, max_message_bytes=4096)


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
])
def test_invalid_requests(fields, match):
    bad(match, **fields)


def test_valid_request_conversion():
    v = validate_request(pb2.GenerateRequest(prompt="hello", temperature=0.5, top_p=0.9, top_k=5, seed=7,
                                             stop=["\n"], mode=pb2.MODE_PLAIN, segment="code",
                                             regex="[a-z]+"), "r1", LIMITS)
    assert v.params.max_tokens == 16 and v.params.temperature == 0.5 and v.params.seed == 7
    assert v.params.top_p == pytest.approx(0.9) and v.params.stop == ("\n",)
    assert v.mode is SpecMode.PLAIN and v.segment == "code" and v.constrained
    s = validate_request(pb2.GenerateRequest(prompt="x", json_schema=json.dumps({"type": "object"})), "r", LIMITS)
    assert s.constrained and s.segment == "default" and s.mode is SpecMode.AUTO


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


def test_auth():
    check_bearer([], None)  # auth off
    check_bearer([("authorization", "Bearer s3cret")], "s3cret")
    for md in ([], [("authorization", "Bearer nope")], [("authorization", "Basic s3cret")]):
        with pytest.raises(ServiceError) as e:
            check_bearer(md, "s3cret")
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_engine_failure_mapping():
    assert EngineFailure.from_exception(InvalidRequestError("x")).kind is FailureKind.INVALID_ARGUMENT
    assert EngineFailure.from_exception(EngineOverloadedError()).to_service_error().code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert EngineFailure.from_exception(KeyError("k")).kind is FailureKind.INTERNAL
    gone = EngineFailure.from_exception(EngineUnavailableError("engine process exited (code -9)"))
    assert gone.to_service_error().code == grpc.StatusCode.UNAVAILABLE
    assert gone.message == "engine process exited (code -9)"


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
    first = chunk(RequestOutput("r", [1], "a"), d, first=True, total_tokens=1)
    assert first.route.reason == "below_enter_threshold" and not first.HasField("usage")
    end = chunk(last, d, first=False, total_tokens=3)
    assert end.finished and end.usage.completion_tokens == 3 and end.spec.drafts == 1
