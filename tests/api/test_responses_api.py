"""The Responses API body -> the chat body it asks for, and the conversation a continuation starts
from (no Ray, no model; end to end: tests/deployments/test_responses_http.py)."""
import json

import pytest

from cluster.api.openai_schemas import ChatCompletionRequest, chat_fields, parse_body
from cluster.api.responses_api import ResponseRequest, chat_body, conversation, input_messages
from cluster.api.status import ServiceError


def req(**fields) -> ResponseRequest:
    return parse_body(json.dumps({"input": "hi", **fields}).encode(), ResponseRequest)


def test_input_items_become_the_chat_messages():
    body = req(instructions="Be brief.", input=[
        {"role": "developer", "content": "Use metric units."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Oslo?"}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{\"city\":\"Oslo\"}"},
        {"type": "function_call", "call_id": "c2", "name": "t", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "4 C"},
        {"type": "function_call_output", "call_id": "c2", "output": "noon"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "It is 4 C at noon.", "annotations": []}]}])
    chat = chat_body(body, [])
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use metric units."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [  # calls made together: one turn
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"city\":\"Oslo\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "t", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4 C"}, {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "assistant", "content": "It is 4 C at noon."}]
    fields = chat_fields(parse_body(json.dumps(chat).encode(), ChatCompletionRequest), 100, "m")
    assert fields.messages[2] == ("user", "Weather in Oslo?") and fields.messages[4] == ("tool", "4 C")


def test_settings_become_the_chat_endpoints():
    body = req(max_output_tokens=7, temperature=0.5, top_p=0.9, parallel_tool_calls=False, tool_choice="required",
               tools=[{"type": "function", "name": "w", "description": "weather", "strict": True,
                       "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}],
               text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
               seed=3, top_k=5, mode="plain", segment="chat", draft_scope="t1")
    chat = chat_body(body, [])
    assert chat["max_completion_tokens"] == 7 and chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["tools"] == [{"type": "function", "function": {"name": "w", "description": "weather", "strict": True,
                                                               "parameters": body.tools[0].parameters}}]
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert (chat["seed"], chat["top_k"], chat["mode"], chat["segment"], chat["draft_scope"]) == (3, 5, "plain", "chat", "t1")
    assert "logprobs" not in chat and "top_logprobs" not in chat  # not asked for
    asked = chat_body(req(include=["message.output_text.logprobs"], top_logprobs=4), [])
    assert (asked["logprobs"], asked["top_logprobs"]) == (True, 4)
    assert chat_body(req(include=["message.output_text.logprobs"]), [])["top_logprobs"] == 0
    assert "logprobs" in chat_body(req(include=["message.output_text.logprobs"], tool_choice="none",
                                       tools=[{"type": "function", "name": "f"}]), [])  # no call can be made
    named = chat_body(req(tool_choice={"type": "function", "name": "w"}), [])
    assert named["tool_choice"] == {"type": "function", "function": {"name": "w"}}
    assert chat_body(req(text={"format": {"type": "json_object"}}), [])["response_format"] == {"type": "json_object"}


def test_a_continuation_starts_from_the_history_and_stores_its_output_as_the_assistants_turn():
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    body = req(input="c", instructions="not carried")
    assert chat_body(body, history)["messages"] == [{"role": "system", "content": "not carried"}, *history,
                                                    {"role": "user", "content": "c"}]
    output = [{"type": "function_call", "call_id": "k1", "name": "f", "arguments": "{}"},
              {"type": "message", "content": [{"type": "output_text", "text": "tail"}]}]
    assert conversation(history, body, output) == [*history, {"role": "user", "content": "c"}, {
        "role": "assistant", "content": "tail",
        "tool_calls": [{"id": "k1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    assert conversation([], body, [{"type": "message", "content": []}]) == [{"role": "user", "content": "c"}]


@pytest.mark.parametrize("fields,param,needle", [
    (dict(input=[{"role": "critic", "content": "x"}]), "input", "input[0].role must be one of"),
    (dict(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]), "input",
     "'input_file' is not supported"),
    (dict(input=[{"role": "assistant", "content": [{"type": "input_text", "text": "x"}]}]), "input",
     "only output_text / refusal parts"),
    (dict(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), "input", "needs call_id, name and arguments"),
    (dict(input=[{"type": "function_call_output", "call_id": "c"}]), "input", "needs call_id and output"),
    (dict(tools=[{"type": "function"}]), "tools", "tools[0] needs a name"),
    (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text", "needs schema"),
    (dict(text={"verbosity": "high"}), "text", "verbosity may only be 'medium'"),
    (dict(service_tier="flex"), "service_tier", "may only be 'auto' or 'default'"),
    (dict(top_logprobs=3), "top_logprobs", "top_logprobs needs include ['message.output_text.logprobs']"),
    (dict(top_logprobs=21, include=["message.output_text.logprobs"]), "top_logprobs", "must be in [0, 20], got 21"),
    (dict(include=["reasoning.encrypted_content"]), "include", "got ['reasoning.encrypted_content']"),
    (dict(include=["message.output_text.logprobs"], tools=[{"type": "function", "name": "f"}]), "include",
     "with tools is not supported"),
    (dict(max_tool_calls=2), "max_tool_calls", "not supported"),
])
def test_refusals_name_the_field(fields, param, needle):
    with pytest.raises(ServiceError) as e:
        chat_body(req(**fields), [])
    assert needle in e.value.message and e.value.param == param


def test_what_asks_for_nothing_is_accepted():
    body = req(truncation="disabled", reasoning={"effort": None}, include=[], background=False, service_tier="auto",
               store=True, user="u", safety_identifier="s", prompt_cache_key="p", top_logprobs=0,
               stream_options={"include_obfuscation": False})
    assert chat_body(body, [])["messages"] == [{"role": "user", "content": "hi"}] and body.stored
    assert not req(store=False).stored and req().stored  # OpenAI's default: stored
    assert input_messages(req(input="")) == [{"role": "user", "content": ""}]  # the chat rules refuse it later
