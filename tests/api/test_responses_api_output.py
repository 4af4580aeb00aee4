"""The Responses API's response object and event stream from engine outputs: text, a named
function's streamed arguments, whole calls of auto / required, the budget cutting a call (no Ray,
no model)."""
import json

from cluster.api.openai_schemas import ChatCompletionRequest, parse_body
from cluster.api.openai_tools import CALL_CLOSE, CALL_OPEN
from cluster.api.responses_api import ResponseRequest, chat_body
from cluster.api.responses_api_output import ResponseEvents, ResponseShape
from cluster.common.request import FinishReason, Logprob, RequestOutput, TokenLogprobs
from cluster.routing.policy import Path, RouteDecision, RouteReason

DECISION = RouteDecision(Path.SPECULATIVE, RouteReason.BELOW_ENTER_THRESHOLD)
WEATHER = {"type": "function", "name": "w", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def shape(**fields) -> ResponseShape:
    body = parse_body(json.dumps({"input": "hi", **fields}).encode(), ResponseRequest)
    chat = parse_body(json.dumps(chat_body(body, [])).encode(), ChatCompletionRequest)
    return ResponseShape("rid", body, "m", DECISION, chat.tool_plan)


def outputs(parts: list[str], reason: FinishReason) -> list[RequestOutput]:
    return [RequestOutput("e", [i], p, finished=i == len(parts) - 1, num_prompt_tokens=5,
                          num_output_tokens=len(parts), finish_reason=reason if i == len(parts) - 1 else None)
            for i, p in enumerate(parts)]


def stream(s: ResponseShape, parts: list[str], reason: FinishReason) -> list[dict]:
    ev = ResponseEvents(s)
    raw = ev.start() + [e for out in outputs(parts, reason) for e in ev.feed(out)]
    out = []
    for text in raw:
        head, data = text.strip().split("\n")
        obj = json.loads(data[len("data: "):])
        assert head == f"event: {obj['type']}"
        out.append(obj)
    assert [o["sequence_number"] for o in out] == list(range(len(out)))
    return out


def test_text_streams_and_ends_in_the_whole_response():
    s = shape(max_output_tokens=3)
    events = stream(s, ["He", "llo", "!"], FinishReason.LENGTH)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"]
    final = events[-1]["response"]
    assert final == s.whole("Hello!", outputs(["He", "llo", "!"], FinishReason.LENGTH)[-1]) | {"created_at": final["created_at"]}
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == "Hello!" and final["usage"]["input_tokens"] == 5
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []


def lp(token: bytes, value: float) -> TokenLogprobs:
    return TokenLogprobs(Logprob(7, value, token), (Logprob(7, value, token), Logprob(8, value - 1, b"x")))


def test_logprobs_ride_on_the_text_they_make_and_an_end_of_turn_has_none():
    s = shape(include=["message.output_text.logprobs"], top_logprobs=2)
    outs = [RequestOutput("e", [1], "He", num_prompt_tokens=5, logprobs=[lp(b"H", -0.1), lp(b"e", -0.2)]),
            RequestOutput("e", [2], "", num_prompt_tokens=5, logprobs=[lp(b"\xc3", -0.3)]),  # half a character
            RequestOutput("e", [3, 4], "\u00e9", num_prompt_tokens=5, logprobs=[lp(b"\xa9", -0.4), lp(b"", -0.5)],
                          finished=True, finish_reason=FinishReason.EOS, num_output_tokens=5)]
    ev = ResponseEvents(s)
    events = [json.loads(e.strip().split("\n")[1][6:]) for out in outs for e in ev.feed(out)]
    deltas = [(e["delta"], [x["logprob"] for x in e["logprobs"]]) for e in events
              if e["type"] == "response.output_text.delta"]
    assert deltas == [("He", [-0.1, -0.2]), ("\u00e9", [-0.3, -0.4])]  # the end-of-turn token: no entry
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert next(e for e in events if e["type"] == "response.content_part.added")["part"]["logprobs"] == []
    assert [x["bytes"] for x in done["logprobs"]] == [[72], [101], [0xc3], [0xa9]]
    assert done["logprobs"][0]["top_logprobs"] == [{"token": "H", "logprob": -0.1, "bytes": [72]},
                                                  {"token": "x", "logprob": -1.1, "bytes": [120]}]
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["logprobs"] == done["logprobs"] and final["top_logprobs"] == 2
    whole = s.whole("He\u00e9", outs[-1], [t for o in outs for t in o.logprobs])
    assert whole["output"] == final["output"]  # unary: the same entries
    plain = shape()
    assert plain.whole("Hi", outs[-1], outs[0].logprobs)["output"][0]["content"][0]["logprobs"] == []  # not asked
    assert [e["logprobs"] for e in stream(plain, ["a", "b"], FinishReason.STOP) if "logprobs" in e] == [[], [], []]


def test_a_named_functions_arguments_stream_as_they_come():
    s = shape(tools=[WEATHER], tool_choice={"type": "function", "name": "w"})
    events = stream(s, ['{"city"', ':"Oslo"}'], FinishReason.STOP)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    (item,) = events[-1]["response"]["output"]
    assert item == {"type": "function_call", "id": "fc_rid_0", "call_id": "call_rid_0_0", "name": "w",
                    "arguments": '{"city":"Oslo"}', "status": "completed"}
    assert s.whole('{"city":"Oslo"}', outputs(["x"], FinishReason.STOP)[-1])["output"] == [item]


def test_auto_calls_come_whole_and_an_answer_as_text():
    s = shape(tools=[WEATHER])
    one = CALL_OPEN + '{"name":"w","arguments":{"city":"Oslo"}}' + CALL_CLOSE
    events = stream(s, [one[:9], one[9:30], one[30:] + "\n" + one[:5], one[5:], ""], FinishReason.EOS)
    calls = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(c["call_id"], c["arguments"]) for c in calls] == [("call_rid_0_0", '{"city":"Oslo"}'),
                                                                ("call_rid_0_1", '{"city":"Oslo"}')]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["output"] == calls
    text = stream(s, ["<", "b>hi</b>"], FinishReason.EOS)  # could have been a call until its second character
    assert "".join(e["delta"] for e in text if e["type"] == "response.output_text.delta") == "<b>hi</b>"
    assert text[-1]["response"]["output"][0]["type"] == "message"


def test_a_call_cut_short_is_answered_as_text_after_the_whole_calls():
    s = shape(tools=[WEATHER], tool_choice="required")
    one = CALL_OPEN + '{"name":"w","arguments":{}}' + CALL_CLOSE
    out = s.whole(one + CALL_OPEN + '{"na', outputs(["x"], FinishReason.LENGTH)[-1])
    assert [i["type"] for i in out["output"]] == ["function_call", "message"]
    assert out["output"][1]["content"][0]["text"] == CALL_OPEN + '{"na' and out["status"] == "incomplete"
    events = stream(s, [one, CALL_OPEN + '{"na'], FinishReason.LENGTH)
    assert events[-1]["response"]["output"][1]["content"][0]["text"] == CALL_OPEN + '{"na'


def test_the_request_is_echoed():
    r = shape(instructions="x", temperature=0.2, metadata={"a": "b"}, store=False, tools=[WEATHER],
              text={"format": {"type": "json_object"}}).response("completed", [], None)
    assert (r["instructions"], r["temperature"], r["metadata"], r["store"]) == ("x", 0.2, {"a": "b"}, False)
    assert r["tools"] == [WEATHER] and r["tool_choice"] == "auto" and r["text"] == {"format": {"type": "json_object"}}
    assert r["specserve"]["route"] == {"path": "speculative", "reason": DECISION.reason.value} and r["usage"] is None
