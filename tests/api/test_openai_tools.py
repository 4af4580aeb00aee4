"""OpenAI tool calling: the plan a request's tools and tool_choice make (the schema the output is
decoded under), the messages that carry calls and results back, and the responses — no Ray, no
model (the real model through the official client: tests/deployments/test_openai_service.py)."""
import json

import jsonschema
import pytest

from cluster.api.openai_responses import Kind, Responder
from cluster.api.openai_schemas import ChatCompletionRequest, chat_fields, chat_tools, parse_body
from cluster.api.openai_tools import tool_plan
from cluster.api.responses import Accumulator
from cluster.api.status import ServiceError
from cluster.common.request import FinishReason, RequestOutput
from cluster.routing.policy import Path, RouteDecision, RouteReason

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: an empty object
DECISION = RouteDecision(Path.SPECULATIVE, RouteReason.BELOW_ENTER_THRESHOLD)


def body(**fields) -> ChatCompletionRequest:
    data = {"messages": [{"role": "user", "content": "weather in Paris?"}], **fields}
    return parse_body(json.dumps(data).encode(), ChatCompletionRequest)


def fields(**kw):
    b = body(**kw)
    return chat_fields(b, 100, "m")


def test_a_named_function_decodes_its_arguments():
    f = fields(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(f.json_schema) == WEATHER["function"]["parameters"]
    system, user = f.messages
    assert system[0] == "system" and "get_weather" in system[1] and "get_time" in system[1]
    assert "Call the function get_weather" in system[1] and user == ("user", "weather in Paris?")
    plan = chat_tools(body(tools=[NOW], tool_choice={"type": "function", "function": {"name": "now"}}))
    assert json.loads(plan.schema) == {"type": "object", "properties": {}}


def test_required_decodes_one_call_of_any_tool():
    plan = tool_plan(body(tools=[WEATHER, TIME]).tools, "required")
    schema = json.loads(plan.schema)
    jsonschema.validate({"name": "get_time", "arguments": {"zone": "UTC"}}, schema)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}, schema)
    for wrong in ({"name": "get_time", "arguments": {"city": "Oslo", "unit": "c"}},  # another tool's arguments
                  {"name": "nope", "arguments": {}}, {"name": "get_time"}, [{"name": "get_time", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    one = json.loads(tool_plan(body(tools=[TIME]).tools, "required").schema)
    assert one["properties"]["name"] == {"const": "get_time"}  # one tool: no anyOf


def test_none_lists_the_tools_and_calls_none_and_an_existing_system_message_keeps_its_text():
    f = fields(tools=[WEATHER], tool_choice="none",
               messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert f.json_schema == "" and len(f.messages) == 2
    assert f.messages[0][1].startswith("Be brief.\n\nYou have these functions:") and "do not call" in f.messages[0][1]


@pytest.mark.parametrize("kw,needle", [
    (dict(tools=[WEATHER]), "tool_choice 'auto' (the default with tools) is not supported"),
    (dict(tools=[WEATHER], tool_choice="auto"), "send tool_choice 'required'"),
    (dict(tool_choice="required"), "tool_choice needs tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}),
     "tool_choice names function 'get_time', which tools does not define"),
    (dict(tools=[WEATHER, WEATHER], tool_choice="required"), "'get_weather' is defined twice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}], tool_choice="required"),
     "tools[0].function.name must be 1-64 characters"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
     "set at most one of tool_choice"),
    (dict(tools=[WEATHER], tool_choice="required", regex="[a-z]+"), "set at most one of tool_choice"),
    (dict(functions=[{"name": "f"}]), "functions (deprecated) are not supported: send tools"),
])
def test_what_cannot_be_honoured_is_refused(kw, needle):
    with pytest.raises(ServiceError) as e:
        fields(**kw)
    assert needle in e.value.message


@pytest.mark.parametrize("kw,needle", [
    (dict(tools=[{"type": "retrieval"}]), "tools.0.type"),
    (dict(tools=[WEATHER], tool_choice="any"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "paremeters": {}}}]), "paremeters"),
])
def test_malformed_tools_are_refused_by_shape(kw, needle):
    with pytest.raises(ServiceError) as e:
        body(**kw)
    assert needle in e.value.message


def test_calls_and_results_sent_back_are_rendered_and_checked():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city":"Paris","unit":"c"}'}}
    chat = [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    f = fields(tools=[WEATHER], tool_choice="none", messages=chat)
    assert f.messages[2] == ("assistant", '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}')
    assert f.messages[3] == ("tool", "18 C, sunny") and f.json_schema == ""
    for messages, needle in (
            (chat[:2] + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}], "answers no earlier tool call"),
            (chat[:2] + [{"role": "tool", "content": "x"}], "a tool message needs tool_call_id"),
            ([{"role": "user", "content": "x", "tool_call_id": "call_1"}], "only a tool message has one"),
            ([{"role": "user", "content": "x", "tool_calls": [call]}], "only an assistant message makes calls")):
        with pytest.raises(ServiceError, match="") as e:
            fields(messages=messages)
        assert needle in e.value.message


def _acc(text: str, reason: FinishReason) -> Accumulator:
    final = RequestOutput("e", [], "", finished=True, finish_reason=reason, num_prompt_tokens=4, num_output_tokens=3)
    return Accumulator("e", DECISION, [text], [1, 2, 3], [], final)


def test_responses_carry_the_calls_with_openais_finish_reasons():
    named = chat_tools(body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    r = Responder(Kind.CHAT, "rid", "", "m", DECISION, tools=named)
    b = r.body([_acc('{"city":"Paris","unit":"c"}', FinishReason.STOP)], _acc("", FinishReason.STOP).final)
    (choice,) = b["choices"]
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_rid_0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'}}]}
    assert choice["finish_reason"] == "stop"  # a named function: OpenAI's "stop"
    cut = r.body([_acc('{"city":"Par', FinishReason.LENGTH)], _acc("", FinishReason.LENGTH).final)["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"][0]["function"]["arguments"] == '{"city":"Par'
    required = Responder(Kind.CHAT, "rid", "", "m", DECISION, tools=tool_plan(body(tools=[WEATHER, TIME]).tools, "required"))
    choice = required.body([_acc('{"name": "get_time", "arguments": {"zone": "UTC"}}', FinishReason.STOP)],
                           _acc("", FinishReason.STOP).final)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zone":"UTC"}'}
    cut = required.body([_acc('{"name": "get_t', FinishReason.LENGTH)], _acc("", FinishReason.LENGTH).final)
    assert cut["choices"][0]["message"] == {"role": "assistant", "content": '{"name": "get_t'}  # no call to show


def _events(r: Responder, parts: list[str], reason: FinishReason) -> list[dict]:
    out = []
    for i, text in enumerate(parts):
        last = i == len(parts) - 1
        event = r.chunk(RequestOutput("e", [i], text, finished=last, finish_reason=reason if last else None),
                        first=i == 0)
        if event is not None:
            out.append(json.loads(event[6:]))
    return out


def test_streamed_calls():
    named = chat_tools(body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    events = _events(Responder(Kind.CHAT, "rid", "", "m", DECISION, tools=named), ['{"city"', ':"Oslo",', '"unit":"c"}'],
                     FinishReason.STOP)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"] is None
    assert deltas[0]["tool_calls"][0] | {"function": None} == {"index": 0, "id": "call_rid_0", "type": "function",
                                                               "function": None}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city":"Oslo","unit":"c"}'
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, "stop"]
    required = tool_plan(body(tools=[WEATHER, TIME]).tools, "required")
    events = _events(Responder(Kind.CHAT, "rid", "", "m", DECISION, tools=required),
                     ['{"name": "get_time", ', '"arguments": ', '{"zone": "UTC"}}'], FinishReason.STOP)
    assert len(events) == 2  # the role first, the whole call last: its name is known only then
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    last = events[1]["choices"][0]
    assert last["delta"]["tool_calls"] == [{"index": 0, "id": "call_rid_0", "type": "function",
                                            "function": {"name": "get_time", "arguments": '{"zone":"UTC"}'}}]
    assert last["finish_reason"] == "tool_calls"
