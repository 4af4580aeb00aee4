"""The repetition bound of a constraint (``cluster.engine.grammar_size``): the longest run of text
its minimum counts demand (multiplied when nested, added in sequence, the longest alternative) in
regexes, JSON Schemas and Lark grammars; braces that are not counts (classes, ``\\p{..}``, string
literals) and maxima are not counted; over the limit the error names ``limits.max_constraint_repeat``."""
from __future__ import annotations

import json

import pytest

from cluster.common.errors import InvalidRequestError
from cluster.common.request import Constraint, ConstraintKind
from cluster.engine.grammar_size import (
    check_repeat_bound, lark_repeat_bound, regex_repeat_bound, repeat_bound, schema_repeat_bound,
)


@pytest.mark.parametrize("rx,bound", [
    ("abc", 3), ("a*b+c?", 3), ("^ab$", 2), ("a{1000000}", 1_000_000), ("a{7,}", 7), ("a{3,90}", 3),
    ("a{0,1000000}", 1), ("(a{5000}){0,3}", 5000),  # a count of 0 may still take its operand once
    ("(a{1000}){1000}", 1_000_000), ("((a{2}){3}){4}", 24), ("(a{10}b){20}", 220),
    ("(a|b{3}){4}", 12), ("(a{100000}|b)", 100_000), (r"\d{3}-\d{4}", 8), ("[a-z]{2,6}-[0-9]{2,3}", 5),
    ("a{2}b{9}", 11), ("(?:x{2,}){3}", 6), ("(?i)ab{3}", 4), ("(?P<n>a{4})b", 5),
    (r"\p{L}{3,10}", 3), (r"\x{41}{7}", 7), (r"[{]{5}", 5), (r"[a-z&&[^{}]]{6}", 6), (r"\{99999\}", 7),
    ("a{", 2), ("(a", 1), ("a)", 2),  # malformed: counted as far as it goes
])
def test_regex_bound(rx, bound):
    assert regex_repeat_bound(rx) == bound


def test_schema_bound_counts_minima_and_patterns_anywhere():
    assert schema_repeat_bound({"type": "array", "minItems": 100_000, "items": {"const": 1}}) == 100_000
    assert schema_repeat_bound({"properties": {"a": {"anyOf": [{"type": "string", "minLength": 70}]}}}) == 70
    assert schema_repeat_bound({"properties": {"a": {"pattern": "^x{50}$"}}}) == 50
    assert schema_repeat_bound({"patternProperties": {"^k{40}$": {}}}) == 40
    assert schema_repeat_bound({"type": "string", "maxLength": 10**9}) == 1  # maxima are free
    assert schema_repeat_bound({"minLength": True}) == 1 and schema_repeat_bound({"minItems": float("inf")}) == 1
    deep = {"items": {}}
    node = deep["items"]
    for _ in range(5000):  # iterative walk: no RecursionError
        node["items"] = {}
        node = node["items"]
    node["minItems"] = 9
    assert schema_repeat_bound(deep) == 9


def test_lark_bound_counts_lexemes_operators_and_embedded_schemas():
    assert lark_repeat_bound('start: A\nA: /a{1000000}/') == 1_000_000
    assert lark_repeat_bound('start: "a" ~ 100000') == 100_000
    assert lark_repeat_bound('start: "a" ~ 3..900') == 3
    assert lark_repeat_bound('start: A\nA: "a"{20000}') == 20_000
    assert lark_repeat_bound('start: %json {"type": "array", "minItems": 70000}') == 70_000
    assert lark_repeat_bound('start: %json {"type": "string", "pattern": "^b{123}$"}') == 123
    # inside a string literal a '/', braces or '~ n' are text, not a regex or a count
    assert lark_repeat_bound('start: "a/x{99999}/ ~ 5000 {7000}"') == 1
    assert lark_repeat_bound('start: "[" item ("," item)? "]"\nitem: W\nW: /[a-z]{1,8}/ & ~/0[0-9]+/') == 2  # /0[0-9]+/


def test_over_the_limit_is_refused_naming_the_limit():
    c = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({"type": "array", "minItems": 5000}))
    assert repeat_bound(c) == 5000
    check_repeat_bound(c, 5000)
    with pytest.raises(InvalidRequestError, match=r"^json_schema demands a run of 5000 characters, over "
                                                  r"the limits.max_constraint_repeat limit of 4999"):
        check_repeat_bound(c, 4999)
    assert repeat_bound(Constraint(ConstraintKind.JSON_SCHEMA, "{not json")) == 1  # the syntax check's to refuse
