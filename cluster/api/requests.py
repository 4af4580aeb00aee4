"""Client request validation and conversion (``GenerateRequest`` proto -> typed request).

Owns: every INVALID_ARGUMENT rule of the API that needs no model (prompt shape, limits, finite
sampling values, ranges via ``SamplingParams``, stop-string caps, the client's ``request_id`` label)
in ``validate_request`` (which also attaches the ``Constraint`` the engine enforces); the
constraint check (JSON Schema / regex syntax, then what the grammar engine supports: unsupported
keywords and formats are refused by name) in ``check_constraint``,
kept apart because it is CPU work on client-chosen input that the Router runs off its event loop
(size-capped first, so it is bounded; recursion and any other checker failure is the client's
INVALID_ARGUMENT); and the model-side half (tokenize, prompt length, token id range) in
``to_generation_request``, which an engine deployment runs next to its tokenizer.
Ignores: routing and transport.
"""
from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass

from cluster.api.status import ServiceError, invalid
from cluster.engine.request import (Constraint, ConstraintKind, GenerationRequest,
                                    InvalidRequestError, SamplingParams, SpecMode)

CHAT_ROLES = ("system", "user", "assistant", "tool")

_MODE_FROM_PROTO = {0: SpecMode.AUTO, 1: SpecMode.SPECULATIVE, 2: SpecMode.PLAIN}


@dataclass(slots=True, frozen=True)
class Limits:
    max_tokens: int = 1024  # cap on a request's max_tokens
    default_max_tokens: int = 128  # when the request leaves max_tokens unset
    max_prompt_tokens: int = 4096
    max_message_bytes: int = 1 << 20
    # each stop string is searched for after every token of the request: bound that work
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # per stop string
    max_constraint_chars: int = 16384  # json_schema / regex text; bounds the checker's work
    max_label_chars: int = 128  # the client's request_id metadata (a label, echoed and logged)

    def __post_init__(self) -> None:
        for name in ("max_tokens", "default_max_tokens", "max_prompt_tokens", "max_message_bytes",
                     "max_stop_strings", "max_stop_chars", "max_constraint_chars", "max_label_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"limits.{name} must be >= 1")
        if self.default_max_tokens > self.max_tokens:
            object.__setattr__(self, "default_max_tokens", self.max_tokens)


@dataclass(slots=True, frozen=True)
class PromptInput:
    """Exactly one of the three is set."""

    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)
    token_ids: tuple[int, ...] | None = None


@dataclass(slots=True, frozen=True)
class ValidatedRequest:
    request_id: str  # assigned by the server, unique: the engine's request id and KVSync seq id
    prompt: PromptInput
    params: SamplingParams
    mode: SpecMode
    segment: str
    constrained: bool
    label: str = ""  # the client's request_id metadata: echoed back and logged, never an id
    constraint: Constraint | None = None  # what the engine enforces on the output (constrained)

    @property
    def echo_id(self) -> str:
        """The id a response carries: the client's label when it sent one, else the server's."""
        return self.label or self.request_id


def _check_json_schema(text: str) -> None:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise invalid(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise invalid("json_schema must be a JSON object (a JSON Schema document)")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        raise invalid(f"json_schema is not a valid JSON Schema: {exc.message}") from None


def _check_regex(text: str) -> None:
    try:
        with warnings.catch_warnings():  # e.g. FutureWarning "possible nested set": not our log's
            warnings.simplefilter("ignore")
            re.compile(text)
    except re.error as exc:
        raise invalid(f"regex does not compile: {exc}") from None


def _check_grammar(kind: ConstraintKind, text: str) -> None:
    """What the grammar engine enforces: unsupported features are refused, never ignored."""
    from cluster.engine.grammar import check_grammar

    try:
        check_grammar(Constraint(kind, text))
    except InvalidRequestError as exc:
        raise invalid(str(exc)) from None


def check_constraint(json_schema: str, regex: str) -> None:
    """The syntax of a request's constraint (at most one of the two is non-empty).

    CPU work on client input: the Router runs it off its event loop. The text is size-capped by
    ``validate_request`` first; whatever the checkers raise on what is left (``RecursionError`` on
    deep nesting, or anything else) is the client's INVALID_ARGUMENT, not an internal error."""
    field, check = ("json_schema", _check_json_schema) if json_schema else ("regex", _check_regex)
    kind = ConstraintKind.JSON_SCHEMA if json_schema else ConstraintKind.REGEX
    try:
        check(json_schema or regex)
        _check_grammar(kind, json_schema or regex)
    except ServiceError:
        raise
    except RecursionError:
        raise invalid(f"{field} is nested too deeply") from None
    except Exception as exc:  # noqa: BLE001 - the checker rejects this input; say so, not how
        raise invalid(f"{field} could not be checked ({type(exc).__name__})") from None


def request_label(metadata, limits: Limits) -> str:
    """The client's ``request_id`` metadata, if any: a label only (echoed back, logged)."""
    label = next((v for k, v in metadata or () if k.lower() == "request_id"), "") or ""
    if isinstance(label, bytes):
        label = label.decode("utf-8", "replace")
    if len(label) > limits.max_label_chars:
        raise invalid(f"request_id metadata must be at most {limits.max_label_chars} characters")
    return label


def _finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise invalid(f"{name} must be a finite number, got {value}")
    return value


def validate_request(pb, request_id: str, limits: Limits, *, label: str = "",
                     constraints: bool = True) -> ValidatedRequest:
    """Raises ServiceError(INVALID_ARGUMENT) with a message naming the field. ``request_id`` is the
    server's own id for the request; ``label`` the client's. ``constraints=False`` leaves the
    constraint's syntax (not its size) to the caller's ``check_constraint``."""
    size = pb.ByteSize()
    if size > limits.max_message_bytes:
        raise invalid(f"request is {size} bytes, over the {limits.max_message_bytes}-byte limit")
    has_ids = pb.HasField("prompt_token_ids")
    given = [name for name, present in (("prompt", bool(pb.prompt)), ("messages", len(pb.messages) > 0),
                                        ("prompt_token_ids", has_ids)) if present]
    if len(given) > 1:
        raise invalid(f"set exactly one of prompt, messages, prompt_token_ids (got {' and '.join(given)})")
    if not given or (pb.prompt and not pb.prompt.strip()):
        raise invalid("prompt is empty: set prompt, messages or prompt_token_ids")
    if pb.prompt:
        prompt = PromptInput(text=pb.prompt)
    elif pb.messages:
        for i, m in enumerate(pb.messages):
            if m.role not in CHAT_ROLES:
                raise invalid(f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {m.role!r}")
        if not any(m.content.strip() for m in pb.messages):
            raise invalid("prompt is empty: every message has empty content")
        prompt = PromptInput(messages=tuple((m.role, m.content) for m in pb.messages))
    else:
        ids = tuple(pb.prompt_token_ids.ids)
        if not ids:
            raise invalid("prompt is empty: prompt_token_ids has no ids")
        if any(t < 0 for t in ids):
            raise invalid("prompt_token_ids must be non-negative")
        prompt = PromptInput(token_ids=ids)

    max_tokens = pb.max_tokens if pb.HasField("max_tokens") else limits.default_max_tokens
    if not 1 <= max_tokens <= limits.max_tokens:
        raise invalid(f"max_tokens must be in [1, {limits.max_tokens}], got {max_tokens}")
    if pb.json_schema and pb.regex:
        raise invalid("set at most one of json_schema and regex")
    for name in ("json_schema", "regex"):
        if len(getattr(pb, name)) > limits.max_constraint_chars:
            raise invalid(f"{name} is {len(getattr(pb, name))} characters, over the "
                          f"{limits.max_constraint_chars}-character limit")
    if constraints and (pb.json_schema or pb.regex):
        check_constraint(pb.json_schema, pb.regex)
    if len(pb.stop) > limits.max_stop_strings:
        raise invalid(f"stop has {len(pb.stop)} strings, limit is {limits.max_stop_strings}")
    for i, s in enumerate(pb.stop):
        if len(s) > limits.max_stop_chars:
            raise invalid(f"stop[{i}] is {len(s)} characters, limit is {limits.max_stop_chars}")
    if pb.mode not in _MODE_FROM_PROTO:
        raise invalid(f"unknown mode {pb.mode}")
    try:
        params = SamplingParams(
            max_tokens=int(max_tokens), temperature=_finite("temperature", float(pb.temperature)),
            top_p=_finite("top_p", float(pb.top_p)) if pb.HasField("top_p") else 1.0, top_k=int(pb.top_k),
            seed=int(pb.seed) if pb.HasField("seed") else None, stop=tuple(pb.stop),
            ignore_eos=bool(pb.ignore_eos))
    except InvalidRequestError as exc:
        raise invalid(str(exc)) from None
    segment = pb.segment.strip() or "default"
    if len(segment) > 64:
        raise invalid("segment must be at most 64 characters")
    return ValidatedRequest(request_id=request_id, prompt=prompt, params=params,
                            mode=_MODE_FROM_PROTO[pb.mode], segment=segment,
                            constrained=bool(pb.json_schema or pb.regex), label=label,
                            constraint=_constraint(pb.json_schema, pb.regex))


def _constraint(json_schema: str, regex: str) -> Constraint | None:
    if json_schema:
        return Constraint(ConstraintKind.JSON_SCHEMA, json_schema)
    return Constraint(ConstraintKind.REGEX, regex) if regex else None


def to_generation_request(req: ValidatedRequest, engine, limits: Limits, vocab_size: int,
                          arrival_time: float = 0.0) -> GenerationRequest:
    """Tokenize with ``engine`` (EngineProtocol) and check the prompt against the limits.

    Raises InvalidRequestError (INVALID_ARGUMENT at the service)."""
    p = req.prompt
    if p.text is not None:
        ids = list(engine.tokenize(p.text))
    elif p.messages is not None:
        ids = list(engine.apply_chat_template([{"role": r, "content": c} for r, c in p.messages]))
    else:
        ids = list(p.token_ids or ())
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt_token_ids out of range [0, {vocab_size}): {bad[:5]}")
    if not ids:
        raise InvalidRequestError("prompt is empty after tokenization")
    if len(ids) > limits.max_prompt_tokens:
        raise InvalidRequestError(
            f"prompt too long: {len(ids)} tokens, limit is {limits.max_prompt_tokens}")
    return GenerationRequest(request_id=req.request_id, prompt_token_ids=ids, params=req.params,
                             segment=req.segment, mode=req.mode, arrival_time=arrival_time,
                             constraint=req.constraint)
