"""Constraints at the API: what the grammar engine cannot enforce is refused (INVALID_ARGUMENT,
naming the feature, within a bounded time), and what it can travels to the engine request."""
import json
import time

import grpc
import pytest

from cluster.api import stubs
from cluster.api.requests import Limits, check_constraint, to_generation_request, validate_request
from cluster.api.status import ServiceError
from cluster.common.config import EngineConfig
from cluster.common.request import Constraint, ConstraintKind
from cluster.engine.fake_engine import FakeEngine

pb2 = stubs.generation_pb2()
LIMITS = Limits()


@pytest.mark.parametrize("schema,regex,needle", [
    (json.dumps({"type": "object", "not": {"required": ["a"]}}), "", "not"),
    (json.dumps({"type": "object", "if": {"type": "object"}, "then": {"required": ["a"]}}), "", "if"),
    (json.dumps({"type": "string", "format": "credit-card"}), "", "credit-card"),
    ("", r"(?=a)a", "regex"),  # lookaround
    ("", r"(a)\1", "regex"),  # backreference
    ("", "[a-z", "regex"),
])
def test_unsupported_or_pathological_constraints_are_refused_fast(schema, regex, needle):
    t0 = time.monotonic()
    with pytest.raises(ServiceError, match=needle) as e:
        check_constraint(schema, regex)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and time.monotonic() - t0 < 5


@pytest.mark.parametrize("schema,regex", [
    ("", "(a|aa)*" * 200 + "b{1000}" * 10),  # exponential for a backtracking or DFA-building engine
    (json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,900}"}
                                                    for i in range(150)}}), ""),  # big and wide
    (json.dumps({"type": "array", "items": {"type": "string", "maxLength": 1000}, "maxItems": 1000}), ""),
])
def test_pathological_constraints_are_answered_in_bounded_time(schema, regex):
    """llguidance builds its lexer lazily: these compile (the engine's first-mask time limit
    bounds the rest); whatever the answer, it comes fast and is never an internal error."""
    t0 = time.monotonic()
    try:
        check_constraint(schema, regex)
    except ServiceError as e:
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT
    assert time.monotonic() - t0 < 5


def test_schema_and_regex_together_are_refused():
    with pytest.raises(ServiceError, match="at most one of json_schema, regex and grammar"):
        validate_request(pb2.GenerateRequest(prompt="x", json_schema="{}", regex="a"), "r", LIMITS)
    with pytest.raises(ServiceError, match=r"at most one of json_schema, regex and grammar \(got regex and grammar\)"):
        validate_request(pb2.GenerateRequest(prompt="x", regex="a", grammar='start: "a"'), "r", LIMITS)


@pytest.mark.parametrize("grammar,needle", [
    ("start: foo", 'unknown name: "foo"'),  # a rule that is never defined
    ("start: /[a-z/", "invalid regex"),
    ('start: "a" %ignore', "Expected value"),  # not Lark
    ('start: %json {"type": "object", "not": {}}', r'Unimplemented keys: \["not"\]'),  # an embedded schema's gaps
    ("rule: \"a\"", "start"),  # no start rule
])
def test_a_grammar_the_engine_cannot_build_is_refused_naming_why(grammar, needle):
    with pytest.raises(ServiceError, match=needle) as e:
        validate_request(pb2.GenerateRequest(prompt="x", grammar=grammar), "r", LIMITS)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.message.startswith("grammar ")


def test_a_grammar_travels_to_the_engine_request_and_counts_against_the_size_cap():
    grammar = 'start: "yes" | "no" | NUM\nNUM: /[0-9]+/ & ~/0[0-9]+/'
    v = validate_request(pb2.GenerateRequest(prompt="x", grammar=grammar), "r", LIMITS)
    assert v.constrained and v.constraint == Constraint(ConstraintKind.GRAMMAR, grammar)
    engine = FakeEngine(EngineConfig())
    assert to_generation_request(v, engine, LIMITS, engine.vocab_size).constraint == v.constraint
    big = 'start: "a"' + " " * LIMITS.max_constraint_chars
    with pytest.raises(ServiceError, match=f"grammar is {len(big)} characters, over the"):
        validate_request(pb2.GenerateRequest(prompt="x", grammar=big), "r", LIMITS)


def test_the_constraint_travels_to_the_engine_request():
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    v = validate_request(pb2.GenerateRequest(prompt="x", json_schema=schema), "r", LIMITS)
    assert v.constrained and v.constraint == Constraint(ConstraintKind.JSON_SCHEMA, schema)
    engine = FakeEngine(EngineConfig())
    assert to_generation_request(v, engine, LIMITS, engine.vocab_size).constraint == v.constraint
    r = validate_request(pb2.GenerateRequest(prompt="x", regex="[0-9]+"), "r", LIMITS)
    assert to_generation_request(r, engine, LIMITS, engine.vocab_size).constraint.kind is ConstraintKind.REGEX
    plain = validate_request(pb2.GenerateRequest(prompt="x"), "r", LIMITS)
    assert not plain.constrained and to_generation_request(plain, engine, LIMITS, engine.vocab_size).constraint is None


@pytest.mark.parametrize("field,text,bound", [
    ("regex", "a{1000000}", 1_000_000),  # issue 64's held-out fuzz request
    ("regex", "(x{100}y){100}", 10_100),
    ("regex", "[bc]a{5000}b{5000}", 10_001),  # runs in sequence add up
    ("json_schema", json.dumps({"type": "array", "minItems": 20_000, "items": {"const": 1}}), 20_000),
    ("json_schema", json.dumps({"type": "string", "pattern": "^a{9000}$"}), 9000),
    ("grammar", 'start: "a" ~ 100000', 100_000),
    ("grammar", "start: A\nA: /[ab]a{300000}/", 300_001),
])
def test_a_constraint_forcing_too_many_repetitions_is_refused_naming_the_limit(field, text, bound):
    """Before any grammar is built (the Router's validation, both front ends): the text such a
    constraint forces would run llguidance out of lexer fuel or Earley items at a step."""
    with pytest.raises(ServiceError) as e:
        validate_request(pb2.GenerateRequest(prompt="x", **{field: text}), "r", LIMITS)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.message == (f"{field} demands a run of {bound} characters, over the "
                               f"limits.max_constraint_repeat limit of {LIMITS.max_constraint_repeat} "
                               "(minimum repetition counts, multiplied when nested and added in sequence)")
    roomy = Limits(max_constraint_repeat=bound)  # the limit is the operator's: at the bound it passes
    assert validate_request(pb2.GenerateRequest(prompt="x", **{field: text}), "r", roomy).constrained


def test_repetitions_within_the_limit_and_maxima_pass():
    for rx in ("a{8192}", "[a-z]{0,1000000}", r"\d{3}-\d{4}", "x" * 8000):
        assert validate_request(pb2.GenerateRequest(prompt="x", regex=rx), "r", LIMITS).constrained
    schema = json.dumps({"type": "array", "maxItems": 10**6, "items": {"type": "string", "maxLength": 10**6}})
    assert validate_request(pb2.GenerateRequest(prompt="x", json_schema=schema), "r", LIMITS).constrained
    with pytest.raises(ValueError, match="limits.max_constraint_repeat must be >= 1"):
        Limits(max_constraint_repeat=0)


@pytest.mark.parametrize("regex", [r"\p{L}{2,5}", r"\p{Greek}+", r"[\x{1F600}-\x{1F64F}]", r"[\p{L}&&[^a-z]]+"])
def test_rust_regex_syntax_python_lacks_is_accepted(regex):
    """The regex dialect is Rust's (docs/structured-output.md): unicode classes and \\x{..} escapes,
    which Python's re refuses, pass; a regex neither parses is still 'does not compile'."""
    assert validate_request(pb2.GenerateRequest(prompt="x", regex=regex), "r", LIMITS).constrained
    with pytest.raises(ServiceError, match=r"regex does not compile: bad escape \\p"):
        validate_request(pb2.GenerateRequest(prompt="x", regex=r"\p{Nonsense}("), "r", LIMITS)
