"""OpenAI response bodies, SSE chunks and error bodies from engine outputs — no Ray."""
import json

import grpc
import pytest

from cluster.api.openai_errors import error_body, error_event, http_error_body
from cluster.api.openai_responses import DONE, Kind, Responder
from cluster.api.status import ServiceError, http_status
from cluster.common.request import FinishReason, RequestOutput, SpecStats
from cluster.routing.policy import Path, RouteDecision, RouteReason

DECISION = RouteDecision(Path.SPECULATIVE, RouteReason.BELOW_ENTER_THRESHOLD)


def _final(text="c", reason=FinishReason.EOS, spec=True):
    stats = SpecStats()
    stats.record(4, 3)
    return RequestOutput("engine-id", [3], text, finished=True, finish_reason=reason, num_prompt_tokens=5,
                         num_output_tokens=3, spec=stats if spec else None)


def _event(line: str) -> dict:
    assert line.startswith("data: ") and line.endswith("\n\n")
    return json.loads(line[6:])


def test_unary_chat_body():
    r = Responder(Kind.CHAT, "srv1", "lbl", "m", DECISION)
    b = r.body("abc", _final(), 3)
    assert b["id"] == "chatcmpl-srv1" and b["object"] == "chat.completion" and b["model"] == "m"
    assert b["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "abc"}, "logprobs": None,
                             "finish_reason": "stop"}]  # EOS is OpenAI's "stop"
    assert b["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    s = b["specserve"]
    assert s["route"] == {"path": "speculative", "reason": "below_enter_threshold"}
    assert (s["request_id"], s["label"]) == ("srv1", "lbl")
    assert s["spec"]["accepted_tokens"] == 3 and s["spec"]["acceptance_rate"] == pytest.approx(0.75)


def test_unary_completion_body_and_finish_reasons():
    r = Responder(Kind.COMPLETION, "srv2", "", "m", RouteDecision(Path.PLAIN, RouteReason.MODE_PLAIN))
    b = r.body("xy", _final(reason=FinishReason.LENGTH, spec=False), 2)
    assert b["id"] == "cmpl-srv2" and b["object"] == "text_completion"
    assert b["choices"][0] == {"index": 0, "text": "xy", "logprobs": None, "finish_reason": "length"}
    assert "label" not in b["specserve"] and b["specserve"]["spec"] is None
    assert r.body("", _final(reason=FinishReason.STOP), 0)["choices"][0]["finish_reason"] == "stop"


def test_chat_stream_chunks_with_usage():
    r = Responder(Kind.CHAT, "s", "", "m", DECISION, include_usage=True)
    first = _event(r.chunk(RequestOutput("e", [1], "a"), first=True))
    mid = _event(r.chunk(RequestOutput("e", [2], "b"), first=False))
    last = _event(r.chunk(_final(), first=False))
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert first["specserve"]["route"]["path"] == "speculative" and "spec" not in first["specserve"]
    assert mid["choices"][0] == {"index": 0, "delta": {"content": "b"}, "logprobs": None, "finish_reason": None}
    assert "specserve" not in mid
    assert last["choices"][0]["finish_reason"] == "stop" and last["specserve"]["spec"]["drafts"] == 1
    usage = _event(r.usage_chunk(_final(), 3))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 8
    assert {first["id"], mid["id"], last["id"], usage["id"]} == {"chatcmpl-s"}
    assert DONE == "data: [DONE]\n\n"


def test_completion_stream_chunks_without_usage():
    r = Responder(Kind.COMPLETION, "s", "", "m", DECISION)
    e = _event(r.chunk(RequestOutput("e", [1], "a"), first=True))
    assert e["object"] == "text_completion" and "usage" not in e and e["choices"][0]["text"] == "a"
    empty_end = _event(r.chunk(_final(text=""), first=False))
    assert empty_end["choices"][0]["text"] == "" and empty_end["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("code,status,etype", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
    (grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "server_error"),
    (grpc.StatusCode.INTERNAL, 500, "server_error"),
])
def test_error_bodies_from_the_one_status_table(code, status, etype):
    got, body = error_body(ServiceError(code, "what went wrong", "field"))
    assert got == status == http_status(code)
    assert body == {"error": {"message": "what went wrong", "type": etype, "param": "field",
                              "code": code.name.lower()}}


def test_wrong_model_code_and_error_event():
    _, body = error_body(ServiceError(grpc.StatusCode.NOT_FOUND, "no such model", "model"))
    assert body["error"]["code"] == "model_not_found"
    assert http_error_body(405, "Method Not Allowed")["error"] == {
        "message": "Method Not Allowed", "type": "invalid_request_error", "param": None, "code": None}
    ev = _event(error_event(ServiceError(grpc.StatusCode.INTERNAL, "internal error (id x)")))
    assert ev["error"]["message"] == "internal error (id x)" and ev["error"]["param"] is None
