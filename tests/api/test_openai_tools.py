"""OpenAI tool calling: the plan a request's tools and tool_choice make (the schema or grammar the
output is decoded under: what it lets through, checked with the grammar engine on the default
model's tokenizer), the messages that carry calls and results back, and the responses — no Ray, no
model weights (the real model through the official client: tests/deployments/test_openai_service.py)."""
import json

import pytest

from cluster.api.openai_responses import Kind, Responder
from cluster.api.openai_schemas import ChatCompletionRequest, chat_fields, parse_body
from cluster.api.openai_tools import CALL_CLOSE, CALL_OPEN, CallStream, parse_calls, tool_plan
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


@pytest.fixture(scope="module")
def compiler(default_model_dir):
    from cluster.engine.grammar import GrammarCompiler
    from cluster.models.tokenizer import eos_token_ids, load_tokenizer

    tok = load_tokenizer(default_model_dir)
    return GrammarCompiler(tok, len(tok), eos_token_ids(tok, default_model_dir)), tok


def accepts(compiler, plan, text: str) -> bool:
    """The grammar engine lets ``text`` through token by token under ``plan``'s constraint and may
    end after it (EOS allowed)."""
    from cluster.common.request import Constraint, ConstraintKind
    from cluster.engine.grammar import GrammarError

    kind, source = ((ConstraintKind.GRAMMAR, plan.grammar) if plan.grammar
                    else (ConstraintKind.JSON_SCHEMA, plan.json_schema))
    grammars, tok = compiler
    m = grammars.matcher(Constraint(kind, source))
    try:
        for t in tok.encode(text, add_special_tokens=False):
            m.accept(t)
    except GrammarError:
        return False
    return bool(m.allowed()[min(grammars.eos_token_ids)])


def call(name: str, arguments: dict) -> str:
    return CALL_OPEN + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")) + CALL_CLOSE


def body(**fields) -> ChatCompletionRequest:
    data = {"messages": [{"role": "user", "content": "weather in Paris?"}], **fields}
    return parse_body(json.dumps(data).encode(), ChatCompletionRequest)


def fields(**kw):
    b = body(**kw)
    return chat_fields(b, 100, "m")


def test_a_named_function_decodes_its_arguments():
    f = fields(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(f.json_schema) == WEATHER["function"]["parameters"] and f.grammar == ""
    system, user = f.messages
    assert system[0] == "system" and "get_weather" in system[1] and "get_time" in system[1]
    assert "Call the function get_weather" in system[1] and user == ("user", "weather in Paris?")
    plan = body(tools=[NOW], tool_choice={"type": "function", "function": {"name": "now"}}).tool_plan
    assert json.loads(plan.json_schema) == {"type": "object", "properties": {}} and not plan.parallel


def test_a_request_works_out_its_plan_once(monkeypatch):
    import cluster.api.openai_schemas as schemas
    made = []
    monkeypatch.setattr(schemas, "plan_tools", lambda *a: made.append(a) or tool_plan(*a))
    b = body(tools=[WEATHER, TIME], tool_choice="required")
    f = chat_fields(b, 100, "m")  # the prompt's tool list and the output's grammar
    assert b.tool_plan.grammar == f.grammar and "get_time" in f.messages[0][1]  # and the responder
    assert len(made) == 1 and b.model_dump() == body(tools=[WEATHER, TIME], tool_choice="required").model_dump()


ONE_TIME, ONE_WEATHER = call("get_time", {"zone": "UTC"}), call("get_weather", {"city": "Oslo", "unit": "c"})


def test_required_decodes_calls_of_any_tool_and_nothing_else(compiler):
    f = fields(tools=[WEATHER, TIME], tool_choice="required")
    assert f.json_schema == "" and CALL_OPEN in f.grammar and "Reply with a call now" in f.messages[0][1]
    plan = body(tools=[WEATHER, TIME], tool_choice="required").tool_plan
    assert plan.parallel and accepts(compiler, plan, ONE_TIME) and accepts(compiler, plan, ONE_WEATHER)
    assert accepts(compiler, plan, ONE_TIME + "\n" + ONE_WEATHER) and accepts(compiler, plan, ONE_TIME + ONE_TIME)
    for wrong in (call("get_time", {"city": "Oslo", "unit": "c"}),  # another tool's arguments
                  call("nope", {}), CALL_OPEN + '{"name":"get_time"}' + CALL_CLOSE, "It is sunny.",
                  ONE_TIME[:-1],  # not closed
                  CALL_OPEN + '{ "name": "get_time", "arguments": {"zone": "UTC"}}' + CALL_CLOSE,  # compact JSON only
                  ONE_TIME + " and more text", ""):
        assert not accepts(compiler, plan, wrong), wrong
    single = body(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False).tool_plan
    assert not single.parallel and accepts(compiler, single, ONE_WEATHER)
    assert not accepts(compiler, single, ONE_TIME + ONE_TIME)


def test_auto_answers_or_calls_as_the_first_bytes_choose(compiler):
    f = fields(tools=[WEATHER, TIME])  # tool_choice unset: OpenAI's auto
    assert f.grammar and "otherwise answer directly" in f.messages[0][1]
    plan = body(tools=[WEATHER, TIME]).tool_plan
    assert plan.choice == "auto" and plan == body(tools=[WEATHER, TIME], tool_choice="auto").tool_plan
    for ok in ("It is sunny in Paris.", "<b>bold</b> answer", "a <tool_call> mentioned inside text", "{}",
               ONE_TIME, ONE_TIME + "\n" + ONE_WEATHER):
        assert accepts(compiler, plan, ok), ok
    for wrong in (CALL_OPEN + "sunny", ONE_TIME + " then text", call("get_weather", {"city": "Oslo"}), ""):
        assert not accepts(compiler, plan, wrong), wrong
    # with response_format json the answer follows it; a call still may be made
    typed = body(tools=[TIME], response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object", "properties": {"answer": {"type": "string"}},
                                "required": ["answer"], "additionalProperties": False}}}).tool_plan
    assert accepts(compiler, typed, '{"answer":"sunny"}') and accepts(compiler, typed, ONE_TIME)
    assert not accepts(compiler, typed, "sunny") and not accepts(compiler, typed, '{"other":1}')
    assert fields(tools=[TIME], response_format={"type": "json_object"}).json_schema == ""  # in the grammar


def test_calls_are_parsed_not_searched_for_the_closing_marker():
    tricky = call("get_weather", {"city": "</tool_call>", "unit": "c"})
    made, rest = parse_calls(tricky + "\n" + ONE_TIME + CALL_OPEN + '{"name":"get')
    assert [c["name"] for c in made] == ["get_weather", "get_time"] and made[0]["arguments"]["city"] == CALL_CLOSE
    assert rest == CALL_OPEN + '{"name":"get'
    assert parse_calls("plain text") == ([], "plain text")
    assert parse_calls(CALL_OPEN + "[1]" + CALL_CLOSE) == ([], CALL_OPEN + "[1]" + CALL_CLOSE)  # not an object


def test_none_lists_the_tools_and_calls_none_and_an_existing_system_message_keeps_its_text():
    f = fields(tools=[WEATHER], tool_choice="none",
               messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert f.json_schema == "" and len(f.messages) == 2
    assert f.messages[0][1].startswith("Be brief.\n\nYou have these functions:") and "do not call" in f.messages[0][1]


@pytest.mark.parametrize("kw,needle", [
    (dict(tool_choice="required"), "tool_choice needs tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}),
     "tool_choice names function 'get_time', which tools does not define"),
    (dict(tools=[WEATHER, WEATHER], tool_choice="required"), "'get_weather' is defined twice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}], tool_choice="required"),
     "tools[0].function.name must be 1-64 characters"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
     "with tool_choice required or a named function set neither response_format"),
    (dict(tools=[WEATHER], tool_choice="required", regex="[a-z]+"), "set neither response_format, regex nor grammar"),
    (dict(tools=[WEATHER], regex="[a-z]+"), "with auto, response_format only"),
    (dict(tools=[WEATHER], grammar='start: "a"'), "with auto, response_format only"),
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
    assert f.messages[2] == ("assistant", CALL_OPEN + '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
                             + CALL_CLOSE)
    assert f.messages[3] == ("tool", "18 C, sunny") and f.json_schema == "" and f.grammar == ""
    for messages, needle in (
            (chat[:2] + [{"role": "tool", "tool_call_id": "call_9", "content": "x"}], "answers no earlier tool call"),
            (chat[:2] + [{"role": "tool", "content": "x"}], "a tool message needs tool_call_id"),
            ([{"role": "user", "content": "x", "tool_call_id": "call_1"}], "only a tool message has one"),
            ([{"role": "user", "content": "x", "tool_calls": [call]}], "only an assistant message makes calls")):
        with pytest.raises(ServiceError) as e:
            fields(messages=messages)
        assert needle in e.value.message


def _acc(text: str, reason: FinishReason) -> Accumulator:
    final = RequestOutput("e", [], "", finished=True, finish_reason=reason, num_prompt_tokens=4, num_output_tokens=3)
    return Accumulator("e", DECISION, [text], [1, 2, 3], [], final)


def test_responses_carry_the_calls_with_openais_finish_reasons():
    named = body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}).tool_plan
    r = Responder(Kind.CHAT, "rid", "", "m", DECISION, tools=named)
    b = r.body([_acc('{"city":"Paris","unit":"c"}', FinishReason.STOP)], _acc("", FinishReason.STOP).final)
    (choice,) = b["choices"]
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_rid_0_0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'}}]}
    assert choice["finish_reason"] == "stop"  # a named function: OpenAI's "stop"
    cut = r.body([_acc('{"city":"Par', FinishReason.LENGTH)], _acc("", FinishReason.LENGTH).final)["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"][0]["function"]["arguments"] == '{"city":"Par'
    for choice_ in ("required", "auto"):
        plan = body(tools=[WEATHER, TIME], tool_choice=choice_).tool_plan
        calls = Responder(Kind.CHAT, "rid", "", "m", DECISION, tools=plan)
        two = calls.body([_acc(ONE_TIME + "\n" + ONE_WEATHER, FinishReason.EOS)], _acc("", FinishReason.EOS).final)
        choice = two["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert [c["id"] for c in choice["message"]["tool_calls"]] == ["call_rid_0_0", "call_rid_0_1"]
        assert [c["function"] for c in choice["message"]["tool_calls"]] == [
            {"name": "get_time", "arguments": '{"zone":"UTC"}'},
            {"name": "get_weather", "arguments": '{"city":"Oslo","unit":"c"}'}]
        cut = calls.body([_acc(ONE_TIME + CALL_OPEN + '{"name":"get_w', FinishReason.LENGTH)],
                         _acc("", FinishReason.LENGTH).final)["choices"][0]
        assert cut["finish_reason"] == "length" and len(cut["message"]["tool_calls"]) == 1
        assert cut["message"]["content"] == CALL_OPEN + '{"name":"get_w'  # the call cut short: shown as text
        first_cut = calls.body([_acc(CALL_OPEN + '{"name": "get_t', FinishReason.LENGTH)],
                               _acc("", FinishReason.LENGTH).final)["choices"][0]
        assert first_cut["message"] == {"role": "assistant", "content": CALL_OPEN + '{"name": "get_t'}  # no call
    auto = Responder(Kind.CHAT, "rid", "", "m", DECISION, tools=body(tools=[WEATHER]).tool_plan)
    answer = auto.body([_acc("It is sunny.", FinishReason.EOS)], _acc("", FinishReason.EOS).final)["choices"][0]
    assert answer["message"] == {"role": "assistant", "content": "It is sunny."} and answer["finish_reason"] == "stop"


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
    named = body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}).tool_plan
    events = _events(Responder(Kind.CHAT, "rid", "", "m", DECISION, tools=named), ['{"city"', ':"Oslo",', '"unit":"c"}'],
                     FinishReason.STOP)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"] is None
    assert deltas[0]["tool_calls"][0] | {"function": None} == {"index": 0, "id": "call_rid_0_0", "type": "function",
                                                               "function": None}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city":"Oslo","unit":"c"}'
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, "stop"]
    required = body(tools=[WEATHER, TIME], tool_choice="required").tool_plan
    events = _events(Responder(Kind.CHAT, "rid", "", "m", DECISION, tools=required),
                     [ONE_TIME[:5], ONE_TIME[5:20], ONE_TIME[20:] + "\n" + ONE_WEATHER[:9], ONE_WEATHER[9:], ""],
                     FinishReason.EOS)
    assert len(events) == 4  # the role first, each call once whole (its name is known only then), the finish
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert events[1]["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "id": "call_rid_0_0", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":"UTC"}'}}]
    assert events[2]["choices"][0]["delta"]["tool_calls"][0]["index"] == 1
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, None, "tool_calls"]
    auto = body(tools=[WEATHER]).tool_plan
    events = _events(Responder(Kind.CHAT, "rid", "", "m", DECISION, tools=auto), ["<", "tool", " is a word", ""],
                     FinishReason.EOS)  # a prefix of the marker is held, then sent as text once it is not one
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == "<tool is a word"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any("tool_calls" in e["choices"][0]["delta"] for e in events)


def test_a_call_stream_holds_only_what_could_still_be_a_call():
    s = CallStream("c")
    assert s.feed("<tool", False) == ("", []) and s.answer is None
    assert s.feed("_call>", False) == ("", []) and s.answer is False
    content, made = s.feed(ONE_TIME[len(CALL_OPEN):], False)
    assert content == "" and [m["id"] for m in made] == ["c_0"]
    assert s.feed(CALL_OPEN + '{"na', True) == (CALL_OPEN + '{"na', [])  # cut short: the rest as text
    text = CallStream("c")
    assert text.feed("Hi", False) == ("Hi", []) and text.feed(" there", True) == (" there", [])
    short = CallStream("c")
    assert short.feed("<tool_", True) == ("<tool_", [])  # ended while it could have been a call
