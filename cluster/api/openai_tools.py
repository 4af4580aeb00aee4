"""OpenAI tool calling through constrained decoding: the model answers or calls, in a format it is shown.

Owns: the ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` / message ``tool_calls`` shapes and
what they ask of a chat request. The served model's chat template has no tools of its own, so the
tools are listed in a system message (name, description, parameters' JSON Schema;
``tools_preamble``) with the call format — ``<tool_call>{"name": …, "arguments": …}</tool_call>``,
one per call — and the output is decoded under a constraint the engine enforces on both paths
(``ToolPlan``): a named function (``{"type": "function", "function": {"name": …}}``) under that
function's ``parameters`` (the output is the arguments, one call); ``"required"`` under a Lark
grammar of calls only; ``"auto"`` (OpenAI's default when tools are sent) under a Lark grammar whose
first bytes choose: a call (the marker) or an answer — any text that does not start with the
marker, or, with ``response_format`` json, a JSON value of that schema. ``parallel_tool_calls``
(default true) lets calls follow one another; false allows one. The response turns the output into
``message.tool_calls`` (``parse_calls``; streamed, ``CallStream``: each call once whole, text as it
comes once it cannot be a call), finish reason ``stop`` for a named function and ``tool_calls``
otherwise as OpenAI's (``length`` when the budget cut it short; a call cut short is answered as
content). ``"none"`` lists the tools and calls none. A conversation that sends calls and results
back renders an assistant message's ``tool_calls`` in the call format and a ``tool`` message as a
``tool`` turn.
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

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"  # a call in the output: CALL_OPEN {json} CALL_CLOSE
_DECODER = json.JSONDecoder()
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}  # llguidance: compact JSON, as response_format's


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools ask of the engine (``json_schema`` or ``grammar``: the constraint the
    output is decoded under) and of the response."""

    choice: Literal["named", "required", "auto"]
    function: str | None = None  # named: the function called; the output is its arguments
    parallel: bool = True  # required / auto: several calls may follow one another
    json_schema: str = ""  # named: the arguments' JSON Schema (text)
    grammar: str = ""  # required / auto: the Lark grammar of calls (auto: or an answer)

    def message(self, text: str, call_id: str) -> tuple[str | None, list[dict]]:
        """(content, calls) of a whole output: a named function's output is its call's arguments
        (partial where cut short); otherwise the calls at its head (content: the rest, a call cut
        short) or, when it does not start with a call, the answer as content."""
        if self.function is not None:
            return None, [_call(f"{call_id}_0", self.function, text)]
        if not text.startswith(CALL_OPEN):
            return text, []
        made, rest = parse_calls(text)
        if not made:
            return text, []
        return rest or None, [_made(f"{call_id}_{k}", c) for k, c in enumerate(made)]

    def finish_reason(self, finish: str | None, called: bool) -> str | None:
        """OpenAI's: a named function's call finishes ``stop``, other calls ``tool_calls``."""
        if finish != "stop" or not called:
            return finish
        return "stop" if self.function is not None else "tool_calls"


def parse_calls(text: str) -> tuple[list[dict], str]:
    """The whole calls at the head of ``text`` (``CALL_OPEN`` {json} ``CALL_CLOSE``, a newline
    between two) and what follows them (an unfinished call, or nothing). The JSON is parsed, not
    searched for ``CALL_CLOSE``: an argument may contain the marker's text."""
    made, pos = [], 0
    while True:
        start = pos + 1 if made and text.startswith("\n", pos) else pos
        if not text.startswith(CALL_OPEN, start):
            break
        try:
            call, end = _DECODER.raw_decode(text, start + len(CALL_OPEN))
        except ValueError:
            break
        if not text.startswith(CALL_CLOSE, end) or not isinstance(call, dict):
            break
        made.append(call)
        pos = end + len(CALL_CLOSE)
    return made, text[pos:]


class CallStream:
    """One streamed choice of a required / auto plan: text in, (content, new calls) out. While the
    output could still be the start of a call nothing is said; an answer then streams as content,
    and each call comes whole (its name is known only then)."""

    def __init__(self, call_id: str) -> None:
        self.call_id = call_id
        self.text = ""
        self.calls = 0  # calls sent so far
        self.answer: bool | None = None  # None: undecided

    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict]]:
        self.text += delta
        if self.answer is None:
            if len(self.text) < len(CALL_OPEN) and CALL_OPEN.startswith(self.text) and not finished:
                return "", []
            self.answer = not self.text.startswith(CALL_OPEN)
            if self.answer:
                return self.text, []
        elif self.answer:
            return delta, []
        made, rest = parse_calls(self.text)
        new = [_made(f"{self.call_id}_{k}", c) for k, c in enumerate(made) if k >= self.calls]
        self.calls = len(made)
        if not finished:
            return "", new
        return (rest if made else self.text), new


def _made(call_id: str, call: dict) -> dict:
    """A parsed call as ``tool_calls`` carries it (its arguments re-serialized compactly)."""
    arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False, separators=(",", ":"))
    return _call(call_id, str(call.get("name", "")), arguments)
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


def tool_plan(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool = True,
              answer_schema: str = "") -> ToolPlan | None:
    """The plan of a request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (None: no
    call is made); ``answer_schema``: ``response_format``'s JSON Schema, which an ``auto`` answer
    follows. A choice that cannot be honoured is INVALID_ARGUMENT naming ``tool_choice``."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools: send the functions in tools", "tool_choice")
        return None
    _check_tools(tools)
    if choice == "none":
        return None
    by_name = {t.function.name: t.function for t in tools}
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in by_name:
            raise invalid(f"tool_choice names function {name!r}, which tools does not define "
                          f"(it defines {sorted(by_name)})", "tool_choice")
        return ToolPlan("named", function=name, parallel=False, json_schema=json.dumps(_parameters(by_name[name])))
    auto = choice in (None, "auto")
    return ToolPlan("auto" if auto else "required", parallel=parallel,
                    grammar=calls_grammar(by_name, parallel, answer=auto, answer_schema=answer_schema))


def calls_grammar(functions: dict[str, FunctionDef], parallel: bool, answer: bool, answer_schema: str = "") -> str:
    """The Lark grammar (llguidance's dialect) of the output: one call, or with ``parallel`` calls
    separated by an optional newline — each ``{"name": <a tool's name>, "arguments": <that tool's
    parameters>}`` between the markers — and with ``answer`` the alternative of an answer: any text
    that does not start with ``CALL_OPEN``, or a JSON value of ``answer_schema`` where one is given."""
    options = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _parameters(f)},
                "required": ["name", "arguments"], "additionalProperties": False} for name, f in functions.items()]
    call = {**_COMPACT, **(options[0] if len(options) == 1 else {"anyOf": options})}
    rules = [f"start: {'answer | ' if answer else ''}calls",
             'calls: call ("\\n"? call)*' if parallel else "calls: call",
             f'call: "{CALL_OPEN}" call_body "{CALL_CLOSE}"',
             f"call_body: %json {json.dumps(call)}"]
    if answer and answer_schema:
        rules.append(f"answer: %json {json.dumps({**_COMPACT, **json.loads(answer_schema)})}")
    elif answer:
        rules += ["answer: TEXT", f"TEXT: /(?s:.+)/ & ~/{CALL_OPEN}(?s:.*)/"]
    return "\n".join(rules) + "\n"


def tools_preamble(tools: list[Tool], plan: ToolPlan | None) -> str:
    """The system text that lists the tools and says how a call is written (and, when one must be
    made, which)."""
    listed = json.dumps([{"name": t.function.name, "description": t.function.description or "",
                          "parameters": _parameters(t.function)} for t in tools], ensure_ascii=False)
    form = (f'To call a function, write {CALL_OPEN}{{"name": <function>, "arguments": <its arguments>}}{CALL_CLOSE}'
            + (" (one per call; several calls may follow one another)." if plan is None or plan.parallel else "."))
    if plan is None:
        ask = "Answer in text; do not call a function now."
    elif plan.function is not None:
        return f"You have these functions:\n{listed}\nCall the function {plan.function}: reply with its arguments as one JSON object."
    elif plan.choice == "required":
        ask = f"{form} Reply with a call now."
    else:
        ask = f"{form} Call a function when it helps answer; otherwise answer directly."
    return f"You have these functions:\n{listed}\n{ask}"


def rendered_calls(calls: list[ToolCall]) -> str:
    """An assistant message's ``tool_calls`` as the text the model sees for its turn: the call
    format, one per line (the arguments as JSON where they parse)."""
    def arguments(text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            return text

    return "\n".join(CALL_OPEN + json.dumps({"name": c.function.name, "arguments": arguments(c.function.arguments)},
                                            ensure_ascii=False) + CALL_CLOSE for c in calls)
