"""Client request validation and conversion (a front end's ``RequestFields`` -> typed request).

Owns: every INVALID_ARGUMENT rule of the API that needs no model (prompt shape, limits, finite
sampling values, ranges via ``SamplingParams``, stop-string caps, the client's ``request_id`` label)
in ``validate_fields``, which both front ends call: gRPC through ``validate_request`` (the proto ->
``RequestFields``), the OpenAI HTTP API through ``cluster.api.openai_schemas`` (JSON ->
``RequestFields``) — one copy of the rules — which also attaches the ``Constraint`` the engine
enforces and checks its size (characters, and the repetition bound: ``limits.max_constraint_repeat``);
the constraint check (JSON Schema / regex / Lark grammar syntax, then what the grammar engine supports:
unsupported keywords and formats are refused by name) in ``check_constraint``, kept apart because it is CPU
work on client-chosen input that the Router runs
off its event loop (size-capped first, so it is bounded; recursion and any other checker failure is
the client's INVALID_ARGUMENT); and the model-side half (tokenize, prompt length, token id range) in
``to_generation_request``, which an engine deployment runs next to its tokenizer.
Ignores: routing and transport.
"""
from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass

from google.protobuf.unknown_fields import UnknownFieldSet

from cluster.api.status import ServiceError, invalid
from cluster.common.errors import InvalidRequestError
from cluster.common.request import Constraint, ConstraintKind, GenerationRequest, SamplingParams, SpecMode
from cluster.common.segments import DEFAULT_SEGMENT
from cluster.engine.grammar_size import check_repeat_bound

CHAT_ROLES = ("system", "user", "assistant", "tool")

_MODE_FROM_PROTO = {0: SpecMode.AUTO, 1: SpecMode.SPECULATIVE, 2: SpecMode.PLAIN}


_SEGMENT = re.compile(r"[A-Za-z0-9._:/-]+")  # a traffic label: metric tag, stats and config key


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
    # the longest run of text a constraint's repetitions demand (minimum counts, multiplied when
    # nested, added in sequence): the grammar engine walks forced text one lexer state per byte
    # (cluster.engine.grammar_size)
    max_constraint_repeat: int = 8192
    max_label_chars: int = 128  # the client's request_id metadata (a label, echoed and logged)
    max_choices: int = 8  # engine requests per HTTP request: n (or best_of) x a completion's prompts

    def __post_init__(self) -> None:
        for name in ("max_tokens", "default_max_tokens", "max_prompt_tokens", "max_message_bytes",
                     "max_stop_strings", "max_stop_chars", "max_constraint_chars", "max_constraint_repeat",
                     "max_label_chars", "max_choices"):
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
    draft_scope: str = ""  # whose answers a drafter that learns from traffic may draft it from
    prediction: str = ""  # the output the client expects: the speculative path drafts from it

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
    """Python's ``re`` names a syntax error well, but the dialect is Rust's: what ``re`` refuses
    and the grammar engine parses (``\\p{L}``, ``\\x{1F600}``, class ``&&``) is not an error."""
    try:
        with warnings.catch_warnings():  # e.g. FutureWarning "possible nested set": not our log's
            warnings.simplefilter("ignore")
            re.compile(text)
    except re.error as exc:
        from cluster.engine.grammar import check_grammar

        try:
            check_grammar(Constraint(ConstraintKind.REGEX, text))
        except InvalidRequestError:
            raise invalid(f"regex does not compile: {exc}") from None


def _check_grammar(kind: ConstraintKind, text: str) -> None:
    """What the grammar engine enforces: unsupported features are refused, never ignored."""
    from cluster.engine.grammar import check_grammar

    try:
        check_grammar(Constraint(kind, text))
    except InvalidRequestError as exc:
        raise invalid(str(exc)) from None


def check_constraint(json_schema: str, regex: str, grammar: str = "") -> None:
    """The syntax of a request's constraint (at most one of the three is non-empty).

    CPU work on client input: the Router runs it off its event loop. The text is size-capped by
    ``validate_request`` first; whatever the checkers raise on what is left (``RecursionError`` on
    deep nesting, or anything else) is the client's INVALID_ARGUMENT, not an internal error."""
    constraint = _constraint(json_schema, regex, grammar)
    if constraint is None:
        return
    field = constraint.kind.value
    try:
        if constraint.kind is ConstraintKind.JSON_SCHEMA:
            _check_json_schema(json_schema)
        elif constraint.kind is ConstraintKind.REGEX:
            _check_regex(regex)
        _check_grammar(constraint.kind, constraint.text)  # a Lark grammar's syntax is the engine's own
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


@dataclass(slots=True, frozen=True)
class RequestFields:
    """A request as a front end read it off its wire, before any rule: the one input of the rules.

    gRPC fills it from ``GenerateRequest`` (``fields_from_proto``), the OpenAI HTTP front end from
    its JSON body (``cluster.api.openai_schemas``); ``validate_fields`` applies every rule to both,
    so the two front ends cannot disagree. ``size`` is the request's size on the wire (bytes)."""

    size: int
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content)
    token_ids: tuple[int, ...] | None = None
    max_tokens: int | None = None  # None: the server default
    temperature: float = 0.0
    top_p: float | None = None  # None: 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    mode: SpecMode = SpecMode.AUTO
    segment: str = ""
    json_schema: str = ""
    regex: str = ""
    grammar: str = ""  # a Lark grammar (llguidance's dialect)
    ignore_eos: bool = False
    draft_scope: str = ""
    prediction: str = ""
    logprobs: int | None = None  # None: no log-probabilities; n: each token's and its n most likely
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    repetition_penalty: float | None = None  # None: 1.0 (none)
    min_p: float = 0.0


def check_size(size: int, limits: Limits) -> None:
    """A request's size on the wire; a front end checks it before parsing the request at all."""
    if size > limits.max_message_bytes:
        raise invalid(f"request is {size} bytes, over the {limits.max_message_bytes}-byte limit")


def check_known_fields(pb) -> None:
    """A ``GenerateRequest`` (or another request message: ``TokenizeRequest``) carrying a field this
    server's proto does not define (a newer client's field, or one made up) is INVALID_ARGUMENT: proto3 would
    parse past it and the field would be
    silently ignored — the request answered as if it had not been sent. Its chat messages and token
    ids likewise. ``ModelInfoResponse.request_fields`` tells a client beforehand what is known."""
    parts = [(pb.DESCRIPTOR.name, pb)] + [(f"messages[{i}]", m) for i, m in enumerate(getattr(pb, "messages", ()))]
    if "prompt_token_ids" in pb.DESCRIPTOR.fields_by_name and pb.HasField("prompt_token_ids"):
        parts.append(("prompt_token_ids", pb.prompt_token_ids))
    for where, msg in parts:
        numbers = sorted({f.field_number for f in UnknownFieldSet(msg)})
        if numbers:
            listed = ", ".join(map(str, numbers))
            raise invalid(f"{where} carries field number {listed}, which this server does not implement "
                          f"(its specserve.v1 has no such field; ModelInfo lists request_fields): "
                          f"the field would be ignored, so the request is refused — upgrade the server "
                          f"or leave the field unset")


def known_request_fields(pb2) -> list[str]:
    """Every ``GenerateRequest`` field this server implements, by name (``ModelInfo.request_fields``):
    all its proto defines, since ``check_known_fields`` refuses the rest."""
    return [f.name for f in pb2.GenerateRequest.DESCRIPTOR.fields]


def fields_from_proto(pb, limits: Limits) -> RequestFields:
    """``GenerateRequest`` -> ``RequestFields``; the size cap first (before copying what may be a
    huge message), then fields this server does not know (refused, never ignored), and the wire's
    own shape check (the mode enum)."""
    size = pb.ByteSize()
    check_size(size, limits)
    check_known_fields(pb)
    if pb.mode not in _MODE_FROM_PROTO:
        raise invalid(f"unknown mode {pb.mode}")
    return RequestFields(
        size=size, prompt=pb.prompt or None,
        messages=tuple((m.role, m.content) for m in pb.messages) or None,
        token_ids=tuple(pb.prompt_token_ids.ids) if pb.HasField("prompt_token_ids") else None,
        max_tokens=pb.max_tokens if pb.HasField("max_tokens") else None,
        temperature=float(pb.temperature), top_p=float(pb.top_p) if pb.HasField("top_p") else None,
        top_k=int(pb.top_k), seed=int(pb.seed) if pb.HasField("seed") else None, stop=tuple(pb.stop),
        mode=_MODE_FROM_PROTO[pb.mode], segment=pb.segment, json_schema=pb.json_schema, regex=pb.regex,
        grammar=pb.grammar,
        ignore_eos=bool(pb.ignore_eos), draft_scope=pb.draft_scope, prediction=pb.prediction,
        logprobs=int(pb.logprobs) if pb.HasField("logprobs") else None,
        prompt_logprobs=int(pb.prompt_logprobs) if pb.HasField("prompt_logprobs") else None,
        presence_penalty=float(pb.presence_penalty), frequency_penalty=float(pb.frequency_penalty),
        logit_bias=tuple(pb.logit_bias.items()), stop_token_ids=tuple(pb.stop_token_ids),
        min_tokens=int(pb.min_tokens),
        repetition_penalty=float(pb.repetition_penalty) if pb.HasField("repetition_penalty") else None,
        min_p=float(pb.min_p))


def validate_request(pb, request_id: str, limits: Limits, *, label: str = "",
                     constraints: bool = True) -> ValidatedRequest:
    """``validate_fields`` of a ``GenerateRequest`` proto (the gRPC front end)."""
    return validate_fields(fields_from_proto(pb, limits), request_id, limits, label=label, constraints=constraints)


def prompt_input(f: RequestFields) -> PromptInput:
    """The request's one prompt (text, chat messages or token ids), by the API's prompt rules."""
    given = [name for name, present in (("prompt", f.prompt is not None), ("messages", bool(f.messages)),
                                        ("prompt_token_ids", f.token_ids is not None)) if present]
    if len(given) > 1:
        raise invalid(f"set exactly one of prompt, messages, prompt_token_ids (got {' and '.join(given)})")
    if not given or (f.prompt is not None and not f.prompt.strip()):
        raise invalid("prompt is empty: set prompt, messages or prompt_token_ids")
    if f.prompt is not None:
        return PromptInput(text=f.prompt)
    if f.messages:
        for i, (role, _) in enumerate(f.messages):
            if role not in CHAT_ROLES:
                raise invalid(f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {role!r}")
        if not any(content.strip() for _, content in f.messages):
            raise invalid("prompt is empty: every message has empty content")
        return PromptInput(messages=tuple(f.messages))
    ids = tuple(f.token_ids or ())
    if not ids:
        raise invalid("prompt is empty: prompt_token_ids has no ids")
    if any(t < 0 for t in ids):
        raise invalid("prompt_token_ids must be non-negative")
    return PromptInput(token_ids=ids)


def validate_fields(f: RequestFields, request_id: str, limits: Limits, *, label: str = "",
                    constraints: bool = True) -> ValidatedRequest:
    """Every model-free rule of the API, for both front ends. Raises ServiceError(INVALID_ARGUMENT)
    with a message naming the field. ``request_id`` is the server's own id for the request;
    ``label`` the client's. ``constraints=False`` leaves the constraint's syntax (not its size) to
    the caller's ``check_constraint``."""
    check_size(f.size, limits)
    prompt = prompt_input(f)
    max_tokens = f.max_tokens if f.max_tokens is not None else limits.default_max_tokens
    scoring = max_tokens == 0 and f.prompt_logprobs is not None  # the prompt's log-probabilities, no output
    if not scoring and not 1 <= max_tokens <= limits.max_tokens:
        raise invalid(f"max_tokens must be in [1, {limits.max_tokens}], got {max_tokens}"
                      + (" (0 only scores the prompt: it needs prompt_logprobs)" if max_tokens == 0 else ""))
    constraint = constraint_of(f)
    for name in _CONSTRAINT_FIELDS:
        if len(getattr(f, name)) > limits.max_constraint_chars:
            raise invalid(f"{name} is {len(getattr(f, name))} characters, over the "
                          f"{limits.max_constraint_chars}-character limit")
    if constraint is not None:
        try:
            check_repeat_bound(constraint, limits.max_constraint_repeat)
        except InvalidRequestError as exc:
            raise invalid(str(exc)) from None
    if constraints and constraint is not None:
        check_constraint(f.json_schema, f.regex, f.grammar)
    if len(f.stop) > limits.max_stop_strings:
        raise invalid(f"stop has {len(f.stop)} strings, limit is {limits.max_stop_strings}")
    for i, s in enumerate(f.stop):
        if len(s) > limits.max_stop_chars:
            raise invalid(f"stop[{i}] is {len(s)} characters, limit is {limits.max_stop_chars}")
    if f.seed is not None and not 0 <= f.seed < 1 << 64:
        raise invalid(f"seed must be in [0, 2**64), got {f.seed}")
    try:
        params = SamplingParams(
            max_tokens=int(max_tokens), temperature=_finite("temperature", float(f.temperature)),
            top_p=_finite("top_p", float(f.top_p)) if f.top_p is not None else 1.0, top_k=int(f.top_k),
            seed=f.seed, stop=tuple(f.stop), ignore_eos=bool(f.ignore_eos), logprobs=f.logprobs,
            prompt_logprobs=f.prompt_logprobs,
            presence_penalty=f.presence_penalty, frequency_penalty=f.frequency_penalty, logit_bias=f.logit_bias,
            stop_token_ids=tuple(f.stop_token_ids), min_tokens=f.min_tokens,
            repetition_penalty=1.0 if f.repetition_penalty is None else f.repetition_penalty, min_p=f.min_p)
    except InvalidRequestError as exc:
        raise invalid(str(exc)) from None
    if params.min_tokens and constraint is not None:
        raise invalid(f"min_tokens cannot be combined with {constraint.kind.value}: the grammar decides where "
                      "the output may end")
    segment = f.segment.strip() or DEFAULT_SEGMENT
    _check_label("segment", segment)  # it becomes a metric tag and a stats key: keep it plain
    scope = f.draft_scope
    if scope:  # a key of the drafter's memory, sent over KVSync
        _check_label("draft_scope", scope)
    if f.prediction and f.mode is SpecMode.PLAIN:
        raise invalid("prediction needs speculative decoding, and mode PLAIN never drafts: "
                      "leave mode AUTO (or SPECULATIVE) or leave prediction unset")
    return ValidatedRequest(request_id=request_id, prompt=prompt, params=params, mode=f.mode,
                            segment=segment, constrained=constraint is not None, label=label,
                            constraint=constraint, draft_scope=scope,
                            prediction=f.prediction)


def _check_label(name: str, value: str) -> None:
    """A plain label (``segment``, ``draft_scope``): at most 64 characters of ``_SEGMENT``'s."""
    if len(value) > 64:
        raise invalid(f"{name} must be at most 64 characters")
    if not _SEGMENT.fullmatch(value):
        raise invalid(f"{name} must be ASCII letters, digits and . _ : / - only, got {value[:64]!r}")


_CONSTRAINT_FIELDS = ("json_schema", "regex", "grammar")  # ConstraintKind's values: at most one set


def constraint_of(f: RequestFields) -> Constraint | None:
    """The request's constraint; more than one of ``json_schema``, ``regex``, ``grammar`` is
    INVALID_ARGUMENT."""
    return _constraint(f.json_schema, f.regex, f.grammar)


def _constraint(json_schema: str, regex: str, grammar: str) -> Constraint | None:
    given = [(name, text) for name, text in zip(_CONSTRAINT_FIELDS, (json_schema, regex, grammar)) if text]
    if len(given) > 1:
        raise invalid(f"set at most one of json_schema, regex and grammar (got {' and '.join(n for n, _ in given)})")
    return Constraint(ConstraintKind(given[0][0]), given[0][1]) if given else None


def tokenize_prompt(p: PromptInput, engine, vocab_size: int) -> list[int]:
    """The ids the model is fed for a prompt: text tokenized, a chat through the chat template with
    the assistant's turn opened, token ids checked against the vocabulary. Raises
    InvalidRequestError (an id out of range, nothing left after tokenization)."""
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
    return ids


def to_generation_request(req: ValidatedRequest, engine, limits: Limits, vocab_size: int,
                          arrival_time: float = 0.0) -> GenerationRequest:
    """Tokenize with ``engine`` (EngineProtocol) and check the prompt against the limits.

    Raises InvalidRequestError (INVALID_ARGUMENT at the service)."""
    ids = tokenize_prompt(req.prompt, engine, vocab_size)
    if len(ids) > limits.max_prompt_tokens:
        raise InvalidRequestError(
            f"prompt too long: {len(ids)} tokens, limit is {limits.max_prompt_tokens}")
    predicted = tuple(engine.tokenize(req.prediction)) if req.prediction else ()
    if len(predicted) > limits.max_prompt_tokens:
        raise InvalidRequestError(
            f"prediction too long: {len(predicted)} tokens, limit is {limits.max_prompt_tokens}")
    return GenerationRequest(request_id=req.request_id, prompt_token_ids=ids, params=req.params,
                             segment=req.segment, mode=req.mode, arrival_time=arrival_time,
                             constraint=req.constraint, draft_scope=req.draft_scope,
                             prediction_token_ids=predicted)
