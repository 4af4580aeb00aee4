"""OpenAI's Responses API request (``POST /v1/responses``) -> a chat request and its conversation.

Owns: the JSON shape of a Responses body this server accepts (pydantic, strict; an unknown field
is 400 naming it, as the chat endpoint's), the refusal of what it does not do (images and files,
reasoning, ``include`` beyond the answer's log-probabilities, ``background``, ``truncation:
"auto"``, hosted tools — each accepted only at the value that asks for nothing), and the
conversion into the chat body the chat endpoint would get (``chat_body``): ``instructions`` a
system message first, an ``input`` string one user message, input items messages (``developer``
as ``system``), ``function_call`` items an assistant's ``tool_calls`` (consecutive calls one
message), ``function_call_output`` items ``tool`` messages; flat function ``tools`` the chat
endpoint's nested ones; ``text.format`` its ``response_format``; ``max_output_tokens`` its
``max_completion_tokens``; ``include`` [``message.output_text.logprobs``] with ``top_logprobs``
its ``logprobs`` / ``top_logprobs``. A response that continues another (``previous_response_id``)
starts from that response's stored conversation — its input and output, not its instructions, as
OpenAI's — so every rule of the chat endpoint (tool results answer earlier calls, roles, sizes,
constraints) holds here too, with the same messages.
Ignores: storing responses (``deployments.response_store``), the response's shape
(``cluster.api.responses_api_output``), transport.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.api.status import invalid
from cluster.common.request import MAX_LOGPROBS

LOGPROBS = "message.output_text.logprobs"  # the one ``include`` value served: the answer's log-probabilities


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ContentPart(_Body):
    type: str  # input_text / output_text; others refused by type
    text: str | None = None
    annotations: list[Any] | None = None  # an output_text sent back as received
    logprobs: list[Any] | None = None
    # an input_image / input_file's own keys, so that it is refused by its type
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None
    file_data: str | None = None
    filename: str | None = None
    file_url: str | None = None


class InputItem(_Body):
    """One input item: a message (``type`` "message" or absent, with ``role``), a
    ``function_call`` or a ``function_call_output`` — the keys of each, other types refused."""

    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None
    id: str | None = None  # an output item sent back as received
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class FunctionTool(_Body):
    type: str  # "function"; hosted tools (web_search, file_search, ...) refused by type
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # "schema" would shadow BaseModel's
    description: str | None = None
    strict: bool | None = None


class TextOptions(_Body):
    format: TextFormat | None = None
    verbosity: str | None = None  # "medium" (what there is) only


class ResponseRequest(_Body):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None  # None: OpenAI's default, 1.0
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None  # None: true, OpenAI's default
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # OpenAI's, accepted only at the value that asks for nothing
    truncation: str | None = None  # "disabled"
    reasoning: dict[str, Any] | None = None  # {} or effort null
    include: list[str] | None = None  # [] or [LOGPROBS]
    background: bool | None = None  # false
    service_tier: str | None = None  # auto / default
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None  # with include [LOGPROBS]: this many most likely tokens per position
    stream_options: dict[str, Any] | None = None  # include_obfuscation false
    # specserve extensions (gRPC's fields)
    top_k: int | None = None
    seed: int | None = None
    mode: str | None = None
    segment: str | None = None
    draft_scope: str | None = None

    @property
    def stored(self) -> bool:
        return self.store is not False

    @property
    def wants_logprobs(self) -> bool:
        """``include`` asks for the answer's log-probabilities (each ``output_text``'s ``logprobs``)."""
        return LOGPROBS in (self.include or ())


def _refuse(body: ResponseRequest) -> None:
    """What this server does not do: a clear 400 naming the field, never ignored."""
    checks = [
        ("truncation", body.truncation not in (None, "disabled"),
         "truncation may only be 'disabled': a conversation longer than the model's context is refused"),
        ("reasoning", bool(body.reasoning) and any(v is not None for v in body.reasoning.values()),
         "reasoning is not supported: the served model does not reason"),
        ("include", bool(set(body.include or ()) - {LOGPROBS}),
         f"include may only list {LOGPROBS!r} (no reasoning, search or file items here), "
         f"got {sorted(set(body.include or ()) - {LOGPROBS})}"),
        ("include", body.wants_logprobs and bool(body.tools) and body.tool_choice != "none",
         f"include {LOGPROBS!r} with tools is not supported: log-probabilities come with a text answer only"),
        ("background", bool(body.background), "background responses are not supported: send them in the foreground"),
        ("service_tier", body.service_tier not in (None, "auto", "default"),
         "service_tier may only be 'auto' or 'default'"),
        ("top_logprobs", body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS,
         f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}"),
        ("top_logprobs", bool(body.top_logprobs) and not body.wants_logprobs,
         f"top_logprobs needs include [{LOGPROBS!r}]: without it no log-probabilities are returned"),
        ("max_tool_calls", body.max_tool_calls is not None,
         "max_tool_calls is not supported: parallel_tool_calls false allows one call"),
        ("stream_options", bool(body.stream_options) and any(body.stream_options.values()),
         "stream_options is not supported on /v1/responses"),
        ("text", bool(body.text and body.text.verbosity not in (None, "medium")),
         "text.verbosity may only be 'medium'"),
    ]
    for param, bad, message in checks:
        if bad:
            raise invalid(message, param)


def _text(content: str | list[ContentPart] | None, where: str, kinds: tuple[str, ...]) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.type not in kinds:
            raise invalid(f"{where}[{j}].type {part.type!r} is not supported: only {' / '.join(kinds)} parts "
                          "(text) are", "input")
        parts.append(part.text or "")
    return "".join(parts)


_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def input_messages(body: ResponseRequest) -> list[dict]:
    """The body's ``input`` as chat messages (JSON shape of the chat endpoint's ``messages``)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict] = []
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if item.type == "message":
            if item.role not in _ROLES:
                raise invalid(f"{where}.role must be one of {sorted(_ROLES)}, got {item.role!r}", "input")
            kinds = ("output_text", "refusal") if item.role == "assistant" else ("input_text",)
            out.append({"role": _ROLES[item.role], "content": _text(item.content, f"{where}.content", kinds)})
        elif item.type == "function_call":
            if not (item.call_id and item.name) or item.arguments is None:
                raise invalid(f"{where}: a function_call item needs call_id, name and arguments", "input")
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)  # calls made together: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            if not item.call_id or item.output is None:
                raise invalid(f"{where}: a function_call_output item needs call_id and output", "input")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        else:
            raise invalid(f"{where}.type {item.type!r} is not supported: message, function_call and "
                          "function_call_output items are", "input")
    return out


def _tools(body: ResponseRequest) -> list[dict] | None:
    if body.tools is None:
        return None
    out = []
    for i, t in enumerate(body.tools):
        if t.type != "function":
            raise invalid(f"tools[{i}].type {t.type!r} is not supported: function tools only (no hosted tools)",
                          "tools")
        if not t.name:
            raise invalid(f"tools[{i}] needs a name", "tools")
        fn = {"name": t.name, **{k: v for k, v in (("description", t.description), ("parameters", t.parameters),
                                                    ("strict", t.strict)) if v is not None}}
        out.append({"type": "function", "function": fn})
    return out


def _response_format(body: ResponseRequest) -> dict | None:
    fmt = body.text.format if body.text else None
    if fmt is None:
        return None
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    if fmt.schema_ is None:
        raise invalid("text.format json_schema needs schema, a JSON Schema object", "text")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_}}


def chat_body(body: ResponseRequest, history: list[dict]) -> dict:
    """The chat-completions body this response asks for: ``history`` (the previous response's
    conversation, or none) then this body's input, after its instructions."""
    _refuse(body)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
    messages += input_messages(body)
    out: dict[str, Any] = {"messages": messages, "stream": body.stream}
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction) else body.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice["name"]}}
    for key, value in (("model", body.model), ("max_completion_tokens", body.max_output_tokens),
                       ("temperature", body.temperature), ("top_p", body.top_p), ("tools", _tools(body)),
                       ("tool_choice", choice), ("parallel_tool_calls", body.parallel_tool_calls),
                       ("response_format", _response_format(body)), ("user", body.user), ("top_k", body.top_k),
                       ("seed", body.seed), ("mode", body.mode), ("segment", body.segment),
                       ("draft_scope", body.draft_scope)):
        if value is not None:
            out[key] = value
    if body.wants_logprobs:
        out["logprobs"], out["top_logprobs"] = True, body.top_logprobs or 0
    return out


def conversation(history: list[dict], body: ResponseRequest, output: list[dict]) -> list[dict]:
    """What a response that continues this one starts from: the history, this input, and this
    response's output as the assistant's turn (text, then calls) — its instructions left out."""
    turn = []
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                       "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if text or calls:
        turn.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
    return history + input_messages(body) + turn


def json_size(value: Any) -> int:
    """The characters of ``value`` as JSON (what a stored conversation weighs)."""
    return len(json.dumps(value, ensure_ascii=False))
