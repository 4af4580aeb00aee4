"""Client request validation and conversion (``GenerateRequest`` proto -> typed request).

Owns: every INVALID_ARGUMENT rule of the API that needs no model (prompt shape, limits, sampling
ranges via ``SamplingParams``, constraint syntax) in ``validate_request``, and the model-side half
(tokenize, prompt length, token id range) in ``to_generation_request``, which an engine deployment
runs next to its tokenizer. Ignores: routing and transport.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from cluster.api.status import invalid
from cluster.engine.request import (GenerationRequest, InvalidRequestError, SamplingParams,
                                    SpecMode)

CHAT_ROLES = ("system", "user", "assistant", "tool")

_MODE_FROM_PROTO = {0: SpecMode.AUTO, 1: SpecMode.SPECULATIVE, 2: SpecMode.PLAIN}


@dataclass(slots=True, frozen=True)
class Limits:
    max_tokens: int = 1024  # cap on a request's max_tokens
    default_max_tokens: int = 128  # when the request leaves max_tokens unset
    max_prompt_tokens: int = 4096
    max_message_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("max_tokens", "default_max_tokens", "max_prompt_tokens", "max_message_bytes"):
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
    request_id: str
    prompt: PromptInput
    params: SamplingParams
    mode: SpecMode
    segment: str
    constrained: bool


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


def validate_request(pb, request_id: str, limits: Limits) -> ValidatedRequest:
    """Raises ServiceError(INVALID_ARGUMENT) with a message naming the field."""
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
    if pb.json_schema:
        _check_json_schema(pb.json_schema)
    if pb.regex:
        try:
            re.compile(pb.regex)
        except re.error as exc:
            raise invalid(f"regex does not compile: {exc}") from None
    if pb.mode not in _MODE_FROM_PROTO:
        raise invalid(f"unknown mode {pb.mode}")
    try:
        params = SamplingParams(
            max_tokens=int(max_tokens), temperature=float(pb.temperature),
            top_p=float(pb.top_p) if pb.HasField("top_p") else 1.0, top_k=int(pb.top_k),
            seed=int(pb.seed) if pb.HasField("seed") else None, stop=tuple(pb.stop),
            ignore_eos=bool(pb.ignore_eos))
    except InvalidRequestError as exc:
        raise invalid(str(exc)) from None
    segment = pb.segment.strip() or "default"
    if len(segment) > 64:
        raise invalid("segment must be at most 64 characters")
    return ValidatedRequest(request_id=request_id, prompt=prompt, params=params,
                            mode=_MODE_FROM_PROTO[pb.mode], segment=segment,
                            constrained=bool(pb.json_schema or pb.regex))


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
                             segment=req.segment, mode=req.mode, arrival_time=arrival_time)
