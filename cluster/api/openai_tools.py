"""OpenAI tool calling through constrained decoding: the model is made to call a function.

Owns: the ``tools`` / ``tool_choice`` / message ``tool_calls`` shapes and what they ask of a chat
request. The served model's chat template has no tools of its own, so the tools are listed in a
system message (name, description, parameters' JSON Schema; ``tools_preamble``). The output is
decoded under a constraint (``ToolPlan.schema``, the same engine-enforced JSON Schema as
``response_format``, on both paths): a named function (``{"type": "function", "function":
{"name": …}}``) constrains it to that function's ``parameters`` — the output is the arguments;
``"required"`` constrains it to one call ``{"name": <a tool's name>, "arguments": <its
parameters>}``. The response turns the output into ``message.tool_calls`` (one call per choice:
``parallel_tool_calls`` allows several, one is what is made), finish reason ``stop`` for a named
function and ``tool_calls`` for ``required`` as OpenAI's (``length`` when the budget cut the call
short). ``"none"`` lists the tools and calls none. ``"auto"`` — OpenAI's default when tools are
sent — needs the model to choose between answering and calling, which a model without a
tool-call format of its own cannot be relied on to do from a prompt: refused (400) naming what
works. A conversation that sends calls and results back renders an assistant message's
``tool_calls`` as the calls' JSON and a ``tool`` message as a ``tool`` turn.
Ignores: the constraint's enforcement (the engine's grammar), transport, the rest of the body
(``openai_schemas``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from cluster.api.status import invalid

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MAX_NAME_CHARS = 64  # OpenAI's rule for a function name: a-z, A-Z, 0-9, _ and -, at most 64


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON Schema of the arguments; None: no arguments
    strict: bool | None = None  # the arguments always follow the schema here (decoded under it)


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as the response gave it


class ToolCall(_Body):
    """A call an assistant message made, sent back in the conversation."""

    id: str
    type: Literal["function"]
    function: FunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools ask of the engine (``schema``) and of the response."""

    function: str | None  # a named function: the output is its arguments; None: "required"
    schema: str  # the JSON Schema (text) the output is decoded under

    def calls(self, text: str, call_id: str) -> list[dict] | None:
        """``message.tool_calls`` from the output (None when a ``required`` output does not parse,
        e.g. cut short by the budget: it is then answered as content)."""
        if self.function is not None:
            return [_call(call_id, self.function, text)]
        try:
            call = json.loads(text)
            name, arguments = call["name"], call["arguments"]
        except (ValueError, TypeError, KeyError):
            return None
        return [_call(call_id, name, json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))]

    def finish_reason(self, finish: str | None) -> str | None:
        """OpenAI's: a named function's call finishes ``stop``, a required one ``tool_calls``."""
        if finish != "stop":
            return finish
        return "stop" if self.function is not None else "tool_calls"


def _call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _parameters(f: FunctionDef) -> dict:
    return f.parameters if f.parameters is not None else {"type": "object", "properties": {}}


def _check_tools(tools: list[Tool]) -> None:
    names = set()
    for i, t in enumerate(tools):
        name = t.function.name
        if not name or len(name) > MAX_NAME_CHARS or set(name) - _NAME_CHARS:
            raise invalid(f"tools[{i}].function.name must be 1-{MAX_NAME_CHARS} characters of a-z, A-Z, 0-9, "
                          f"_ and -, got {name!r}", "tools")
        if name in names:
            raise invalid(f"tools[{i}].function.name {name!r} is defined twice", "tools")
        names.add(name)


def tool_plan(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolPlan | None:
    """The plan of a request's ``tools`` and ``tool_choice`` (None: no call is made); a choice
    that cannot be honoured is INVALID_ARGUMENT naming ``tool_choice``."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools: send the functions in tools", "tool_choice")
        return None
    _check_tools(tools)
    if choice == "none":
        return None
    if choice in (None, "auto"):
        raise invalid("tool_choice 'auto' (the default with tools) is not supported: the served model has no "
                      "tool-call format to choose between answering and calling from; send tool_choice "
                      "'required' (it calls one of the tools), a named function, or 'none'", "tool_choice")
    by_name = {t.function.name: t.function for t in tools}
    if choice == "required":
        options = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _parameters(f)},
                    "required": ["name", "arguments"], "additionalProperties": False}
                   for name, f in by_name.items()]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return ToolPlan(function=None, schema=json.dumps(schema))
    name = choice.function.name
    if name not in by_name:
        raise invalid(f"tool_choice names function {name!r}, which tools does not define "
                      f"(it defines {sorted(by_name)})", "tool_choice")
    return ToolPlan(function=name, schema=json.dumps(_parameters(by_name[name])))


def tools_preamble(tools: list[Tool], plan: ToolPlan | None) -> str:
    """The system text that lists the tools (and, when a call is to be made, says which)."""
    listed = json.dumps([{"name": t.function.name, "description": t.function.description or "",
                          "parameters": _parameters(t.function)} for t in tools], ensure_ascii=False)
    if plan is None:
        ask = "Answer in text; do not call a function now."
    elif plan.function is not None:
        ask = f"Call the function {plan.function}: reply with its arguments as one JSON object."
    else:
        ask = 'Call one of the functions: reply with {"name": <function>, "arguments": <its arguments>} as JSON.'
    return f"You have these functions:\n{listed}\n{ask}"


def rendered_calls(calls: list[ToolCall]) -> str:
    """An assistant message's ``tool_calls`` as the text the model sees for its turn: one
    ``{"name": …, "arguments": …}`` per line, the shape ``required`` decodes (the arguments as
    JSON where they parse)."""
    def arguments(text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            return text

    return "\n".join(json.dumps({"name": c.function.name, "arguments": arguments(c.function.arguments)},
                                ensure_ascii=False) for c in calls)
