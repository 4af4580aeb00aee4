"""Hypothesis strategies for structured-output constraints: regexes (Rust syntax), JSON Schemas
and Lark grammars (llguidance's dialect), aimed at what breaks a grammar engine.

Owns: generated constraints with huge repetition counts (``a{1000000}``, minItems, Lark ``~ n``),
nested quantifiers (``((a{2,}){3})*``), empty languages (``[a&&b]``, ``minimum`` over
``maximum``, an intersection of disjoint lexemes), unicode classes (``\\p{Greek}``, CJK, emoji,
combining marks), and rules that multiply (a Lark rule doubled ``depth`` times). ``HUGE_COUNTS``
is the family of counts the chaos fuzz sends too. Ignores: what the engine must do with them
(``tests/engine/test_grammar_agreement.py``).
"""
from __future__ import annotations

import json

from hypothesis import strategies as st

from cluster.common.request import Constraint, ConstraintKind

HUGE_COUNTS = (1_000, 10_000, 60_000, 1_000_000)  # past llguidance's forced-run fuel from ~50,000
SMALL_COUNTS = st.integers(0, 4)
UNICODE_LITERALS = ("é", "中", "ß", "\U0001f600", "e\u0301", "Ω", "ж")

_atoms = st.one_of(
    st.sampled_from(list("abcxyz019 ,:-_") + list(UNICODE_LITERALS)),
    st.sampled_from([r"\.", r"\(", r"\{", r"\\", r"\d", r"\w", r"\s", "."]),
    st.sampled_from(["[a-z]", "[^x]", "[0-9a-f]", r"[\p{L}&&[^a-z]]", r"\p{L}", r"\p{Greek}",
                     r"\P{L}", r"\p{Han}", "[ä-ü]", r"[\x{1F600}-\x{1F64F}]"]),
    st.sampled_from(["[a&&b]", r"[^\s\S]", r"[\d&&\p{Greek}]"]),  # empty languages
)


def _quantified(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    count = st.one_of(SMALL_COUNTS, SMALL_COUNTS, st.sampled_from(HUGE_COUNTS))
    return st.one_of(
        st.tuples(inner, st.sampled_from(["*", "+", "?", "*?", "+?"])).map("".join),
        st.tuples(inner, count).map(lambda t: f"{t[0]}{{{t[1]}}}"),
        st.tuples(inner, SMALL_COUNTS, count).map(lambda t: f"{t[0]}{{{t[1]},{max(t[1], t[2])}}}"),
        st.tuples(inner, count).map(lambda t: f"{t[0]}{{{t[1]},}}"),
    )


def _group(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(inner.map(lambda s: f"({s})"), inner.map(lambda s: f"(?:{s})"))


regexes: st.SearchStrategy[str] = st.recursive(
    _atoms,
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=4).map("".join),  # concatenation
        st.lists(inner, min_size=2, max_size=3).map("|".join).map(lambda s: f"({s})"),  # alternation
        _quantified(_group(inner)),  # nested quantifiers
        _quantified(inner),
    ),
    max_leaves=6,
)


def _schema_leaf() -> st.SearchStrategy[dict]:
    count = st.one_of(SMALL_COUNTS, st.sampled_from(HUGE_COUNTS))
    return st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(-3, 100)),  # span < 0: an empty language
        st.just({"type": "boolean"}),
        st.just({"type": "number"}),
        st.builds(lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
                  count, st.integers(0, 6)),
        st.builds(lambda rx: {"type": "string", "pattern": f"^{rx}$"}, regexes),
        st.lists(st.one_of(st.text(st.sampled_from("ab中é\U0001f600 "), max_size=4), st.integers(-3, 3)),
                 max_size=3).map(lambda vals: {"enum": vals}),  # [] is an empty language
        st.sampled_from(["x", 7, None, "中文"]).map(lambda v: {"const": v}),
        st.just({"allOf": [{"type": "string"}, {"type": "integer"}]}),  # empty
    )


schemas: st.SearchStrategy[dict] = st.recursive(
    _schema_leaf(),
    lambda inner: st.one_of(
        st.builds(lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo,
                                            "maxItems": lo + extra},
                  inner, st.one_of(SMALL_COUNTS, st.sampled_from(HUGE_COUNTS)), st.integers(0, 3)),
        st.dictionaries(st.sampled_from(["a", "b", "name", "ключ", "k\u0301"]), inner, min_size=1, max_size=3)
        .map(lambda props: {"type": "object", "properties": props, "required": sorted(props),
                            "additionalProperties": False}),
        st.lists(inner, min_size=2, max_size=3).map(lambda alts: {"anyOf": alts}),
    ),
    max_leaves=5,
)


def _doubled_rules(depth: int, leaf: str) -> str:
    """A rule doubled ``depth`` times: its only string is 2**depth copies of ``leaf``."""
    rules = ["start: r0"] + [f"r{i}: r{i + 1} r{i + 1}" for i in range(depth)]
    return "\n".join(rules + [f"r{depth}: {json.dumps(leaf)}"])


grammars: st.SearchStrategy[str] = st.one_of(
    regexes.map(lambda rx: f"start: A\nA: /{rx}/"),
    st.tuples(regexes, regexes).map(lambda t: f'start: "[" x ("," x)* "]"\nx: A | B\nA: /{t[0]}/\nB: /{t[1]}/'),
    st.tuples(regexes, regexes).map(lambda t: f"start: A\nA: /{t[0]}/ & /{t[1]}/"),  # may be empty
    st.tuples(regexes, regexes).map(lambda t: f"start: A\nA: /{t[0]}/ & ~/{t[1]}/"),
    st.tuples(st.sampled_from(["a", "ab", "中"]), st.one_of(SMALL_COUNTS, st.sampled_from(HUGE_COUNTS)))
    .map(lambda t: f'start: {json.dumps(t[0])} ~ {max(t[1], 1)}'),
    st.tuples(st.sampled_from(["a", "x,"]), st.integers(1, 17)).map(lambda t: _doubled_rules(t[1], t[0])),
    schemas.map(lambda s: f"start: %json {json.dumps(s)}"),
    st.just('start: A\nA: /[a-z]+/ & /[0-9]+/'),  # empty language
)

constraints: st.SearchStrategy[Constraint] = st.one_of(
    regexes.map(lambda rx: Constraint(ConstraintKind.REGEX, rx)),
    schemas.map(lambda s: Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(s))),
    grammars.map(lambda g: Constraint(ConstraintKind.GRAMMAR, g)),
)
