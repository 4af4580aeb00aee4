"""OpenAI response bodies, SSE chunks and error bodies from engine outputs — no Ray."""
import json

import grpc
import pytest

from cluster.api.openai_errors import error_body, error_event, http_error_body
from cluster.api.openai_responses import DONE, Kind, Responder
from cluster.api.responses import Accumulator
from cluster.api.status import ServiceError, http_status
from cluster.common.request import FinishReason, Logprob, RequestOutput, SpecStats, TokenLogprobs
from cluster.routing.policy import Path, RouteDecision, RouteReason

DECISION = RouteDecision(Path.SPECULATIVE, RouteReason.BELOW_ENTER_THRESHOLD)


def _final(text="c", reason=FinishReason.EOS, spec=True):
    stats = SpecStats()
    stats.record(4, 3)
    return RequestOutput("engine-id", [3], text, finished=True, finish_reason=reason, num_prompt_tokens=5,
                         num_output_tokens=3, spec=stats if spec else None)


def _body(r: Responder, text: str, final: RequestOutput, tokens: int, logprobs=()) -> dict:
    """A one-choice response: ``text`` in ``tokens`` tokens, ending with ``final``."""
    acc = Accumulator("engine-id", DECISION, [text], list(range(tokens)), list(logprobs), final)
    return r.body([acc], final)


def _event(line: str) -> dict:
    assert line.startswith("data: ") and line.endswith("\n\n")
    return json.loads(line[6:])


def test_unary_chat_body():
    r = Responder(Kind.CHAT, "srv1", "lbl", "m", DECISION)
    b = _body(r, "abc", _final(), 3)
    assert b["id"] == "chatcmpl-srv1" and b["object"] == "chat.completion" and b["model"] == "m"
    assert b["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "abc"}, "logprobs": None,
                             "finish_reason": "stop"}]  # EOS is OpenAI's "stop"
    assert b["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    s = b["specserve"]
    assert s["route"] == {"path": "speculative", "reason": "below_enter_threshold"}
    assert (s["request_id"], s["label"]) == ("srv1", "lbl")
    assert s["spec"]["accepted_tokens"] == 3 and s["spec"]["acceptance_rate"] == pytest.approx(0.75)


def test_unary_completion_body_and_finish_reasons():
    r = Responder(Kind.COMPLETION, "srv2", "", "m", RouteDecision(Path.PLAIN, RouteReason.MODE_PLAIN))
    b = _body(r, "xy", _final(reason=FinishReason.LENGTH, spec=False), 2)
    assert b["id"] == "cmpl-srv2" and b["object"] == "text_completion"
    assert b["choices"][0] == {"index": 0, "text": "xy", "logprobs": None, "finish_reason": "length"}
    assert "label" not in b["specserve"] and b["specserve"]["spec"] is None
    assert _body(r, "", _final(reason=FinishReason.STOP), 0)["choices"][0]["finish_reason"] == "stop"


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


def _lp(token_id: int, token: bytes, logprob: float, *top: tuple[int, bytes, float]) -> TokenLogprobs:
    return TokenLogprobs(Logprob(token_id, logprob, token), tuple(Logprob(i, v, b) for i, b, v in top))


LPS = [_lp(5, b"Hi", -0.1, (5, b"Hi", -0.1), (6, b"Hey", -2.5)),
       _lp(7, b" \xe6", -0.7, (7, b" \xe6", -0.7), (8, b"!", -0.9)),  # the first bytes of a character
       _lp(2, b"<|im_end|>", -0.01, (2, b"<|im_end|>", -0.01), (9, b".", -5.0))]  # EOS: no text, no entry


def test_chat_logprobs_unary_and_streamed():
    r = Responder(Kind.CHAT, "s", "", "m", DECISION, logprobs=True)
    b = _body(r, "Hi \ufffd", _final(), 3, LPS)
    content = b["choices"][0]["logprobs"]["content"]
    assert b["choices"][0]["logprobs"]["refusal"] is None
    assert [c["token"] for c in content] == ["Hi", " \ufffd"]  # the EOS token ended no text
    assert content[1]["bytes"] == [32, 0xE6] and content[1]["logprob"] == -0.7
    assert content[0]["top_logprobs"] == [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]},
                                          {"token": "Hey", "logprob": -2.5, "bytes": [72, 101, 121]}]
    first = _event(r.chunk(RequestOutput("e", [5], "Hi", logprobs=LPS[:1]), first=True))
    last = _event(r.chunk(RequestOutput("e", [7, 2], " \ufffd", finished=True, finish_reason=FinishReason.EOS,
                                        logprobs=LPS[1:]), first=False))
    assert [c["token"] for c in first["choices"][0]["logprobs"]["content"]] == ["Hi"]
    assert [c["token"] for c in last["choices"][0]["logprobs"]["content"]] == [" \ufffd"]
    length = _body(Responder(Kind.CHAT, "s", "", "m", DECISION, logprobs=True), "x",
                   _final(reason=FinishReason.LENGTH), 3, LPS)  # a budget's last token is text: kept
    assert len(length["choices"][0]["logprobs"]["content"]) == 3
    assert _body(Responder(Kind.CHAT, "s", "", "m", DECISION), "x", _final(), 3, LPS)["choices"][0]["logprobs"] is None


def test_completion_logprobs_legacy_shape_with_offsets_across_chunks():
    r = Responder(Kind.COMPLETION, "s", "", "m", DECISION, logprobs=True)
    b = _body(r, "Hi \ufffd", _final(reason=FinishReason.LENGTH), 3, LPS[:2])["choices"][0]["logprobs"]
    assert b["tokens"] == ["Hi", " \ufffd"] and b["token_logprobs"] == [-0.1, -0.7]
    assert b["text_offset"] == [0, 2]
    assert b["top_logprobs"][0] == {"Hi": -0.1, "Hey": -2.5}  # the chosen token is among them (up to n + 1)
    eos = _body(Responder(Kind.COMPLETION, "s", "", "m", DECISION, logprobs=True), "Hi \ufffd", _final(), 3, LPS)
    lp = eos["choices"][0]["logprobs"]  # a completion keeps the end-of-sequence token's entry (OpenAI's, vLLM's)
    assert lp["tokens"] == ["Hi", " \ufffd", "<|im_end|>"] and lp["text_offset"] == [0, 2, 4]
    s = Responder(Kind.COMPLETION, "s", "", "m", DECISION, logprobs=True)
    one = _event(s.chunk(RequestOutput("e", [5], "Hi", logprobs=LPS[:1]), first=True))["choices"][0]["logprobs"]
    two = _event(s.chunk(RequestOutput("e", [7], " \ufffd", logprobs=LPS[1:2]), first=False))["choices"][0]["logprobs"]
    assert one["text_offset"] == [0] and two["text_offset"] == [2]


PROMPT = [TokenLogprobs(Logprob(11, None, b"Say")), _lp(12, b" hi", -3.0, (13, b" it", -1.0), (12, b" hi", -3.0))]


def test_echo_puts_the_prompt_and_its_entries_first():
    """A completion's echo: the prompt's text, then the output's; its logprobs have the prompt's
    entries first (the first token's log-probability and alternatives null, as OpenAI's) and the
    output's offsets continue after the prompt's text — unary, and streamed on the first chunk."""
    final = RequestOutput("e", [7], " \ufffd", finished=True, finish_reason=FinishReason.LENGTH, num_prompt_tokens=2,
                          num_output_tokens=2)
    r = Responder(Kind.COMPLETION, "s", "", "m", DECISION, logprobs=True, echo=("Say hi",))
    acc = Accumulator("e", DECISION, ["Hi", " \ufffd"], [5, 7], LPS[:2], final, PROMPT)
    choice = r.body([acc], final)["choices"][0]
    assert choice["text"] == "Say hiHi \ufffd"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["Say", " hi", "Hi", " \ufffd"] and lp["token_logprobs"] == [None, -3.0, -0.1, -0.7]
    assert lp["top_logprobs"][:2] == [None, {" it": -1.0, " hi": -3.0}] and lp["text_offset"] == [0, 3, 6, 8]
    assert r.body([acc], final)["usage"]["completion_tokens"] == 2  # the echoed prompt is not output
    spelled = Responder(Kind.COMPLETION, "s", "", "m", DECISION, echo=("",))  # token ids: spelled from the entries
    assert spelled.body([acc], final)["choices"][0] == {"index": 0, "text": "Say hiHi \ufffd", "logprobs": None,
                                                       "finish_reason": "length"}
    s = Responder(Kind.COMPLETION, "s", "", "m", DECISION, logprobs=True, echo=("Say hi",))
    one = _event(s.chunk(RequestOutput("e", [5], "Hi", logprobs=LPS[:1], prompt_logprobs=PROMPT), first=True))
    two = _event(s.chunk(RequestOutput("e", [7], " \ufffd", logprobs=LPS[1:2]), first=False))
    assert one["choices"][0]["text"] == "Say hiHi" and two["choices"][0]["text"] == " \ufffd"
    assert one["choices"][0]["logprobs"]["text_offset"] == [0, 3, 6] and two["choices"][0]["logprobs"]["text_offset"] == [8]
    scored = Responder(Kind.COMPLETION, "s", "", "m", DECISION, logprobs=True, echo=("Say hi",))  # max_tokens 0
    only = _event(scored.chunk(RequestOutput("e", [], "", finished=True, finish_reason=FinishReason.LENGTH,
                                             prompt_logprobs=PROMPT), first=True))["choices"][0]
    assert (only["text"], only["finish_reason"], only["logprobs"]["tokens"]) == ("Say hi", "length", ["Say", " hi"])


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


def test_n_choices_unary_and_streamed():
    """Each choice its own index, text, finish reason and logprobs (completion offsets per choice);
    usage counts the prompt once and every choice's tokens; the counters are the summary's."""
    r = Responder(Kind.COMPLETION, "s", "", "m", DECISION, logprobs=True)
    a = Accumulator("e", DECISION, ["Hi"], [5], LPS[:1], _final(reason=FinishReason.LENGTH))
    b = Accumulator("e", DECISION, ["Hi", " \ufffd"], [5, 7], LPS[:2], _final(reason=FinishReason.STOP))
    summary = _final(spec=False)
    body = r.body([a, b], summary)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "Hi", "length"), (1, "Hi \ufffd", "stop")]
    assert [c["logprobs"]["text_offset"] for c in body["choices"]] == [[0], [0, 2]]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["specserve"]["spec"] is None  # the summary's counters, not one choice's
    s = Responder(Kind.CHAT, "s", "", "m", DECISION)
    events = [_event(s.chunk(RequestOutput("e-1", [5], "x"), first=True, index=1)),
              _event(s.chunk(RequestOutput("e-0", [5], "y"), first=True, index=0)),
              _event(s.chunk(RequestOutput("e-1", [6], "z"), first=False, index=1))]
    assert [(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in events] == [
        (1, {"role": "assistant", "content": "x"}), (0, {"role": "assistant", "content": "y"}), (1, {"content": "z"})]
    c = Responder(Kind.COMPLETION, "s", "", "m", DECISION, logprobs=True)
    offsets = [_event(c.chunk(RequestOutput("e", [5], "Hi", logprobs=LPS[:1]), first=f, index=i))
               ["choices"][0]["logprobs"]["text_offset"] for i, f in ((0, True), (1, True), (0, False))]
    assert offsets == [[0], [0], [2]]  # each choice's text runs on from its own last offset
