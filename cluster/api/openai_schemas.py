"""OpenAI request bodies (``/v1/chat/completions``, ``/v1/completions``) -> ``RequestFields``.

Owns: the JSON shapes the OpenAI-compatible front end accepts (pydantic, strict types: a string
where a number belongs is a 400, an int where a float belongs is fine; a field we do not know is a
400 naming it, as OpenAI answers "Unrecognized request argument" — never parsed past and ignored),
the model-name check (another name: NOT_FOUND -> 404), the refusal of what we do not do
(suffix, the deprecated ``functions``, audio,
reasoning effort, stored completions, speaker names, non-text content parts — each OpenAI field that changes
nothing here is accepted only at the value that
asks for nothing: ``modalities`` ["text"], ...), ``tools`` / ``tool_choice`` and the messages'
calls and results (their rules, the tools' system text and the call's schema: ``openai_tools``),
``response_format`` (``json_object`` /
``json_schema``) and the ``regex`` / ``grammar`` extensions as the same constraint gRPC's ``json_schema`` /
``regex`` / ``grammar`` carry, ``logprobs`` / ``top_logprobs`` (chat) and ``logprobs`` (completions) as gRPC's
``logprobs``, a completion's ``echo`` as gRPC's ``prompt_logprobs`` where its entries are needed
(``max_tokens`` 0 with it: the prompt scored, nothing generated), vLLM's ``stop_token_ids`` / ``min_tokens``
extensions as gRPC's fields — and the
conversion into the ``RequestFields`` that
``cluster.api.requests.validate_fields`` checks for gRPC too (every range, cap, finiteness and
constraint rule lives there, not here).
Ignores: transport, response shapes (``openai_responses``), error bodies (``openai_errors``).
"""
from __future__ import annotations

import functools
import json
from typing import Any, Literal

import grpc
from pydantic import BaseModel, ConfigDict, ValidationError

from cluster.api.openai_tools import Tool, ToolCall, ToolChoice, ToolPlan, rendered_calls, tools_preamble
from cluster.api.openai_tools import tool_plan as plan_tools
from cluster.api.requests import Limits, RequestFields
from cluster.api.status import ServiceError, invalid
from cluster.common.request import MAX_LOGPROBS, SpecMode

# response_format json_object: any JSON object (the grammar engine enforces it like a schema)
JSON_OBJECT_SCHEMA = json.dumps({"type": "object"})


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# what a client of another server most likely meant by a field we do not know
_INSTEAD = {
    "guided_json": "response_format json_schema", "guided_regex": "the regex extension",
    "guided_grammar": "the grammar extension (a Lark grammar)",
    "max_new_tokens": "max_tokens", "stop_sequences": "stop", "min_new_tokens": "min_tokens",
}


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool = False  # refused when true: no obfuscation padding here


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _Common(_Body):
    """Fields both endpoints share, OpenAI's and the specserve extensions (extra body fields)."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None  # None: OpenAI's default, 1.0
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # specserve extensions
    top_k: int | None = None
    mode: str | None = None  # auto | speculative | plain
    segment: str | None = None
    draft_scope: str | None = None
    regex: str | None = None
    grammar: str | None = None  # a Lark grammar (llguidance's dialect), gRPC's grammar
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None  # vLLM's: token ids that end the output like EOS
    min_tokens: int | None = None  # vLLM's: no stop but the budget before this many tokens
    repetition_penalty: float | None = None  # vLLM's: None is 1.0 (none)
    min_p: float | None = None  # vLLM's: None is 0 (no cut)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(_Body):
    # other keys are kept so that an image or audio part is refused by its type, not by its keys
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)
    type: str
    text: str | None = None


class Prediction(_Body):
    """Predicted output: the answer the client expects (gRPC's ``prediction``)."""

    type: Literal["content"]
    content: str | list[TextPart]


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls, sent back
    tool_call_id: str | None = None  # a tool message: the call it answers
    # OpenAI's, accepted only empty: an assistant message sent back as the client got it carries them
    name: str | None = None
    function_call: dict[str, Any] | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    annotations: list[Any] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None  # each output token's log-probability ...
    top_logprobs: int | None = None  # ... and this many most likely tokens at its position (needs logprobs)
    tools: list[Tool] | None = None  # functions the model may be made to call (``openai_tools``)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None / true: calls may follow one another; false: at most one
    functions: list[Any] | None = None  # OpenAI's deprecated form of tools: refused
    # OpenAI's, which change nothing here at the values _refuse lets through
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint; the engines' prefix caches match by tokens
    safety_identifier: str | None = None  # like user: an end-user id for the caller's records
    prediction: Prediction | None = None  # drafted from on the speculative path
    # OpenAI's, refused: this server does not do them
    audio: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None

    @functools.cached_property
    def tool_plan(self) -> ToolPlan | None:
        """The calls this request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` make (None:
        none); an ``auto`` answer follows ``response_format`` where it asks for JSON. Worked out once
        per request (the prompt's tool list, the output's constraint and the responder read it);
        INVALID_ARGUMENT naming ``tool_choice`` where it cannot be honoured."""
        auto = self.tool_choice in (None, "auto")
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls is not False,
                          _json_schema(self.response_format) if auto else "")


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # each output token's log-probability and this many most likely
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None


class TokenizeBody(_Body):
    """vLLM's ``POST /tokenize``: a prompt or a chat -> the ids a request would feed the model."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = None  # a chat is tokenized with the assistant's turn opened
    add_special_tokens: bool | None = None  # a prompt is tokenized as a request's: no special tokens added


class DetokenizeBody(_Body):
    """vLLM's ``POST /detokenize``: token ids -> their text."""

    model: str | None = None
    tokens: list[int]


def parse_body(raw: bytes, cls: type[_Body]) -> _Body:
    """The request body as ``cls``; a body that is not JSON, not an object, or has a field of the
    wrong type is INVALID_ARGUMENT naming the field (``ServiceError.param`` carries it)."""
    try:
        data = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise invalid("request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        unknown = [_where(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
        if unknown:
            raise _unrecognized(unknown) from None
        err = errors[0]
        loc = [str(p) for p in err["loc"] if not _is_type_tag(p)]
        where = ".".join(loc)
        raise invalid(f"{where or 'body'}: {err['msg']}", loc[0] if loc else None) from None
    except RecursionError:
        raise invalid("request body is nested too deeply") from None


def _where(loc) -> str:
    return ".".join(str(p) for p in loc if not _is_type_tag(p))


def _unrecognized(names: list[str]) -> ServiceError:
    """OpenAI's answer to a field it does not know (400 "Unrecognized request argument supplied"),
    with what to send instead where another server's client most likely meant one of ours."""
    hints = [f"{n}: use {_INSTEAD[n]}" for n in names if n in _INSTEAD]
    return invalid(f"unrecognized request argument supplied: {', '.join(names)} — this server does not "
                   f"implement {'it' if len(names) == 1 else 'them'} and refuses rather than ignores"
                   + (f" ({'; '.join(hints)})" if hints else ""), names[0].split(".")[0])


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_type_tag(part) -> bool:
    """pydantic names the union member in an error's location (``stop.list[str].0``): not a field."""
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS or part.startswith("function-"))


def check_model(body: _Body, served: str) -> None:
    if body.model is not None and body.model != served:
        raise ServiceError(grpc.StatusCode.NOT_FOUND,
                           f"the model {body.model!r} does not exist; this server serves {served!r}", "model")


_MESSAGE_REFUSALS = {
    "name": "the chat template has no speaker names", "function_call": "functions are not supported; send tools",
    "refusal": "send the refusal text as content", "audio": "audio is not supported",
    "annotations": "annotations are not supported",
}


def _refuse(body: _Common) -> None:
    """Parameters we accept in form but do not implement: a clear 400, never silently ignored."""
    checks = [
        ("response_format", sum((bool(body.regex), bool(body.grammar),
                                 bool(body.response_format and body.response_format.type != "text"))) > 1,
         "set at most one of response_format (json_object / json_schema), regex and grammar"),
        ("stream_options", body.stream_options is not None and not body.stream,
         "stream_options is only allowed with stream: true"),
        ("stream_options", bool(body.stream_options and body.stream_options.include_obfuscation),
         "stream_options.include_obfuscation is not supported"),
    ]
    if isinstance(body, ChatCompletionRequest):
        checks += [
            ("top_logprobs", bool(body.top_logprobs) and not body.logprobs,
             "top_logprobs needs logprobs: true"),
            ("functions", bool(body.functions), "functions (deprecated) are not supported: send tools"),
            ("function_call", body.function_call not in (None, "none", "auto"),
             "function_call may only be 'none' or 'auto': functions are not supported; send tools and tool_choice"),
            ("modalities", body.modalities not in (None, ["text"]), "modalities may only be ['text']"),
            ("audio", body.audio is not None, "audio output is not supported"),
            ("store", bool(body.store), "store is not supported: this server keeps no completions"),
            ("service_tier", body.service_tier not in (None, "auto", "default"),
             "service_tier may only be 'auto' or 'default': this server has one tier"),
            ("reasoning_effort", body.reasoning_effort is not None,
             "reasoning_effort is not supported: the served model does not reason before answering"),
            ("verbosity", body.verbosity is not None, "verbosity is not supported"),
            ("web_search_options", body.web_search_options is not None, "web search is not supported"),
        ]
        for i, m in enumerate(body.messages):
            for field, why in _MESSAGE_REFUSALS.items():
                if getattr(m, field):
                    checks.append(("messages", True, f"messages[{i}].{field} is not supported: {why}"))
    if isinstance(body, CompletionRequest):
        checks += [("max_tokens", body.max_tokens == 0 and not body.echo,
                    "max_tokens 0 needs echo: true (the prompt comes back, scored when logprobs is set)"),
                   ("suffix", bool(body.suffix), "suffix is not supported")]
    for param, refused, message in checks:
        if refused:
            raise invalid(message, param)


def check_choices(body: _Common, limits: Limits) -> None:
    """``n``: how many choices, each its own engine request (``limits.max_choices`` at most: n
    choices load the engines as n requests do); a completion's ``best_of``: how many candidates
    the n are chosen from (n to ``limits.max_choices``; not streamed, as OpenAI's); a completion's
    batch of prompts: its prompts times their choices (or candidates) at most ``limits.max_choices``."""
    if body.n is not None and not 1 <= body.n <= limits.max_choices:
        raise invalid(f"n must be in [1, {limits.max_choices}], got {body.n}", "n")
    best_of = getattr(body, "best_of", None)
    if best_of is not None:
        if not 1 <= best_of <= limits.max_choices:
            raise invalid(f"best_of must be in [1, {limits.max_choices}], got {best_of}", "best_of")
        if best_of < (body.n or 1):
            raise invalid(f"best_of ({best_of}) must be at least n ({body.n})", "best_of")
        if best_of > 1 and body.stream:
            raise invalid("best_of cannot be streamed: the best candidates are known only once all have "
                          "finished", "best_of")
    if isinstance(body, CompletionRequest):  # a batch of prompts: each prompt's choices are engine requests
        prompts, each = len(completion_prompts(body)), num_candidates(body)
        if prompts * each > limits.max_choices:
            raise invalid(f"a batch of {prompts} prompts x {each} {'candidates' if best_of else 'choices'} is "
                          f"{prompts * each} engine requests, over limits.max_choices ({limits.max_choices})",
                          "prompt")


def num_candidates(body: _Common) -> int:
    """Engine requests a body asks for: ``best_of`` candidates where set (a completion), else ``n``."""
    return getattr(body, "best_of", None) or body.n or 1


def _mode(value: str | None) -> SpecMode:
    if value is None:
        return SpecMode.AUTO
    try:
        return SpecMode(value.lower())
    except ValueError:
        raise invalid(f"mode must be one of {[m.value for m in SpecMode]}, got {value!r}",
                           "mode") from None


def _json_schema(rf: ResponseFormat | None) -> str:
    """``response_format`` -> the JSON Schema text gRPC's ``json_schema`` carries ("" for text)."""
    if rf is None or rf.type == "text":
        return ""
    if rf.type == "json_object":
        return JSON_OBJECT_SCHEMA
    schema = (rf.json_schema or {}).get("schema")
    if not isinstance(schema, dict):
        raise invalid("response_format json_schema needs json_schema.schema, a JSON Schema object",
                      "response_format")
    return json.dumps(schema)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (token ids as JSON object keys) -> (token id, bias) pairs."""
    pairs = []
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise invalid(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        pairs.append((token, value))
    return tuple(pairs)


def _common(body: _Common, size: int, max_tokens: int | None) -> dict:
    stop = body.stop
    return dict(presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                logit_bias=_logit_bias(body.logit_bias), size=size, max_tokens=max_tokens,
                json_schema=_json_schema(body.response_format), regex=body.regex or "",
                grammar=body.grammar or "",
                stop_token_ids=tuple(body.stop_token_ids or ()), min_tokens=body.min_tokens or 0,
                repetition_penalty=body.repetition_penalty, min_p=body.min_p or 0.0,
                temperature=1.0 if body.temperature is None else body.temperature, top_p=body.top_p,
                top_k=body.top_k or 0, seed=body.seed,
                stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
                mode=_mode(body.mode), segment=body.segment or "", ignore_eos=bool(body.ignore_eos),
                draft_scope=body.draft_scope or "")


def _text(content: str | list[TextPart] | None, where: str, param: str) -> str:
    """A content field (a message's, the prediction's): a string, or text parts joined; any other
    part is refused by its type, a text part's unknown key as an unrecognized argument."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise invalid(f"{where}[{j}]: only text content parts are supported, got type {part.type!r}", param)
        if part.model_extra:
            raise _unrecognized([f"{where.replace('[', '.').replace(']', '')}.{j}.{k}" for k in part.model_extra])
        texts.append(part.text)
    return "".join(texts)


def _num_logprobs(value: int | None, param: str) -> int | None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise invalid(f"{param} must be in [0, {MAX_LOGPROBS}], got {value}", param)
    return value


def _messages(body: ChatCompletionRequest) -> tuple[tuple[str, str], ...]:
    """(role, text) of each message: an assistant's calls rendered after its content, a tool
    message's result as its content (its ``tool_call_id`` must answer an earlier call); with tools,
    their list in the first system message (one is put first where none is)."""
    out, called = [], set()
    for i, m in enumerate(body.messages):
        text = _text(m.content, f"messages[{i}].content", "messages")
        if m.tool_calls:
            if m.role != "assistant":
                raise invalid(f"messages[{i}].tool_calls: only an assistant message makes calls", "messages")
            text = "\n".join(filter(None, (text, rendered_calls(m.tool_calls))))
            called.update(c.id for c in m.tool_calls)
        if (m.role == "tool") != (m.tool_call_id is not None):
            raise invalid(f"messages[{i}]: a tool message needs tool_call_id, and only a tool message has one",
                          "messages")
        if m.tool_call_id is not None and m.tool_call_id not in called:
            raise invalid(f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no earlier tool call", "messages")
        out.append((m.role, text))
    if body.tools:
        preamble = tools_preamble(body.tools, body.tool_plan)
        if out and out[0][0] == "system":
            out[0] = ("system", f"{out[0][1]}\n\n{preamble}" if out[0][1] else preamble)
        else:
            out.insert(0, ("system", preamble))
    return tuple(out)


def chat_fields(body: ChatCompletionRequest, size: int, served: str) -> RequestFields:
    check_model(body, served)
    _refuse(body)
    top = _num_logprobs(body.top_logprobs, "top_logprobs")
    plan = body.tool_plan
    messages = _messages(body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    prediction = "" if body.prediction is None else _text(body.prediction.content, "prediction.content", "prediction")
    common = _common(body, size, max_tokens)
    if plan is not None:  # the output is decoded under the calls' constraint
        others = [name for name in ("json_schema", "regex", "grammar") if common[name]]
        if others and not (plan.choice == "auto" and others == ["json_schema"]):  # auto's answer follows the format
            raise invalid("a tool call is decoded under its own grammar: with tool_choice required or a named "
                          "function set neither response_format, regex nor grammar; with auto, response_format "
                          "only (the answer follows it)", "tool_choice")
        common["json_schema"], common["grammar"] = plan.json_schema, plan.grammar
    return RequestFields(messages=messages, prediction=prediction, logprobs=(top or 0) if body.logprobs else None,
                         **common)


def completion_batch(body: CompletionRequest, size: int, served: str) -> list[RequestFields]:
    """One ``RequestFields`` per prompt of the body's batch (a string or token ids is a batch of
    one), the same in every field but the prompt."""
    check_model(body, served)
    _refuse(body)
    common = _common(body, size, body.max_tokens)
    common["logprobs"] = _num_logprobs(body.logprobs, "logprobs")
    out = []
    for prompt in completion_prompts(body):
        fields = dict(common)
        if body.echo:  # the prompt's entries: scored when logprobs is set, the echoed text of token ids
            needed = fields["logprobs"] is not None or not isinstance(prompt, str) or body.max_tokens == 0
            fields["prompt_logprobs"] = (fields["logprobs"] or 0) if needed else None
        out.append(RequestFields(prompt=prompt, **fields) if isinstance(prompt, str)
                   else RequestFields(token_ids=tuple(prompt), **fields))
    return out


def echoed_prompts(body: CompletionRequest) -> tuple[str, ...] | None:
    """Per prompt of the batch, the text a completion with ``echo`` puts before each of its choices'
    outputs: a text prompt as it was sent; "" for token ids (their text is spelled from the
    prompt's entries, ``openai_responses``); None without echo."""
    if not body.echo:
        return None
    return tuple(p if isinstance(p, str) else "" for p in completion_prompts(body))


def completion_prompts(body: CompletionRequest) -> list[str | list[int]]:
    """The body's batch of prompts, each a string or token ids (OpenAI's four shapes: a string,
    token ids, a list of strings, a list of token-id lists)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def tokenize_body(body: TokenizeBody, served: str) -> tuple[str, list[tuple[str, str]]]:
    """(prompt, messages) of a ``/tokenize`` body, exactly one of them set; what a generation
    request would do differently is refused (a chat without the assistant's turn opened, special
    tokens added to a prompt), as is anything but role and text content in a message."""
    check_model(body, served)
    if body.add_generation_prompt is False:
        raise invalid("add_generation_prompt false is not supported: a chat is tokenized as a request "
                      "feeds it, with the assistant's turn opened", "add_generation_prompt")
    if body.add_special_tokens:
        raise invalid("add_special_tokens true is not supported: a prompt is tokenized as a request feeds it, "
                      "with no special tokens added", "add_special_tokens")
    if (body.prompt is None) == (body.messages is None):
        raise invalid("set exactly one of prompt and messages", "prompt")
    messages = []
    for i, m in enumerate(body.messages or ()):
        if m.tool_calls or m.tool_call_id or any(getattr(m, f) for f in _MESSAGE_REFUSALS):
            raise invalid(f"messages[{i}]: /tokenize takes a message's role and content only", "messages")
        messages.append((m.role, _text(m.content, f"messages[{i}].content", "messages")))
    return body.prompt or "", messages
