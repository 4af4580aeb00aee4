"""Hypothesis strategies over every ``GenerateRequest`` field, aimed at the edges.

Owns: generating requests a careless or hostile client could send — odd unicode (controls, NUL,
RTL marks, emoji, combining marks; never lone surrogates, which protobuf cannot encode), empty and
huge text, out-of-vocabulary and negative token ids, NaN/inf/subnormal/negative floats, uint
extremes, many and empty stop strings, unknown roles and modes, conflicting prompt fields, broken
and deeply nested JSON schemas, regexes and grammars (issue 64's families among them: huge
repetition counts, nested quantifiers, empty languages, unicode classes, in regexes, schema
patterns and Lark lexemes) — plus which credentials the call carries.
Ignores: what the answer must be (the fuzz test).
"""
from __future__ import annotations

import json

from hypothesis import strategies as st

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1

ODD_CHARS = "\x00\x01\x7f\u200b\u200e\u202e\ufeff\ufffd\U0001f600\u0301\u0d15\u4e2d\n\t\r"
text = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=40),
    st.text(st.sampled_from(ODD_CHARS), max_size=40),
    st.sampled_from(["", " ", "hello", "<|im_start|>", "<|endoftext|>", "\\u0000", "%s%n{}"]),
)


@st.composite
def huge_text(draw) -> str:
    """Text far past the limits: bytes, tokens, or both."""
    unit = draw(st.sampled_from(["a", "ab ", "\U0001f600", "中文", "\u0301"]))
    return unit * draw(st.sampled_from([300, 2_000, 20_000, 200_000]))


any_text = st.one_of(text, text, text, huge_text())

floats32 = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-44, 1e-38, 1e-30, 1e-7, 0.5, 1.0, 1.5, -1.0, 1e38,
                     float("nan"), float("inf"), float("-inf")]),
)

roles = st.one_of(st.sampled_from(["system", "user", "assistant", "", "tool", "USER", " user",
                                   "function", "ユーザー"]), text)


def _nested_schema(depth: int) -> str:
    """A valid schema nested ``depth`` objects deep (built as text: json.dumps would recurse)."""
    head = '{"type": "object", "required": ["a"], "properties": {"a": '
    return head * depth + '{"type": "string"}' + "}}" * depth


# issue 64's families: a huge count forces a run of text the grammar engine walks one lexer state
# per byte (a{1000000} once broke a step), alone, after a choice, nested, in sequence; nested
# quantifiers; empty languages; unicode classes
HUGE_COUNTS = (1_000, 8_192, 8_193, 60_000, 1_000_000)
huge_repetitions = st.tuples(
    st.sampled_from(["a{N}", "[bc]a{N}", "(ab){N}", "x(yz){N}", "(a{1000}){K}", "(a|b){N}", "[ab]a{N}b{N}",
                     "a{0,N}", "\\p{L}{N}", "(a{5}|b){N}"]),
    st.sampled_from(HUGE_COUNTS)).map(lambda t: t[0].replace("N", str(t[1])).replace("K", str(t[1] // 1000)))
regex_families = st.one_of(
    huge_repetitions,
    st.sampled_from(["((a{2,}){3})*", "((a|b)+)+c", "(a?){30}a{30}", "((x*)*y)*", "(a{2}){3}{4}"]),  # nested
    st.sampled_from(["[a&&b]", "[^\\s\\S]", "[\\d&&\\p{Greek}]", "a{0}", "(?:)"]),  # empty languages
    st.sampled_from(["\\p{L}+", "\\p{Greek}{2,4}", "\\P{L}*", "[\\p{Han}\\p{Hiragana}]{1,3}", "[ä-ü]+",
                     "[\\x{1F600}-\\x{1F64F}]{1,5}", "\\w+\\s\\d", "é|e\\x{301}"]),  # unicode classes
)

schemas = st.one_of(
    st.just(""),
    st.tuples(st.sampled_from(["minItems", "minLength"]), st.sampled_from(HUGE_COUNTS)).map(
        lambda t: json.dumps({"type": "array" if t[0] == "minItems" else "string", t[0]: t[1]})),
    regex_families.map(lambda rx: json.dumps({"type": "string", "pattern": rx})),
    st.sampled_from([json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}}),
                     json.dumps({"type": 12}), "{", "null", "[]", "{\"$ref\": \"#\"}",
                     json.dumps({"type": "string", "pattern": "("}),
                     json.dumps({"enum": ["a", "b"]})]),
    st.sampled_from([10, 200, 2_000]).map(_nested_schema),
    st.sampled_from([100, 1_000, 10_000]).map(lambda d: "[" * d + "]" * d),
    text,
)

regexes = st.one_of(
    st.just(""),
    st.sampled_from(["[a-z]+", "(a|b)*c", "a(b", "(?P<x>a)(?P=x)", "\\", "a{99999999}", "(a*)*b",
                     "[", "(?=a)", "\\d{3}-\\d{4}"]),
    st.sampled_from([100, 1_000, 10_000]).map(lambda d: "(" * d + "a" + ")" * d),
    regex_families,
    text,
)

grammars = st.one_of(  # Lark grammars (llguidance's dialect): fine, malformed, heavy, deep
    st.just(""),
    regex_families.map(lambda rx: f"start: A\nA: /{rx}/"),
    st.sampled_from(HUGE_COUNTS).map(lambda n: f'start: "a" ~ {n}'),
    st.sampled_from(['start: "a"+', "start: foo", "start: /[a-z/", 'start: %json {"not": {}}', "start: ",
                     'start: X\nX: /(?s:.+)/ & ~/<(?s:.*)/', 'start: s\ns: "(" s ")" | ""',
                     'start: A\nA: /(a|aa)*/ & ~/(?s:.*)aaa(?s:.*)/']),
    st.sampled_from([100, 1_000, 10_000]).map(lambda d: "start: " + "(" * d + '"a"' + ")" * d),
    text,
)

token_ids = st.lists(st.one_of(st.integers(0, 49_151), st.integers(-2**31, 2**31 - 1),
                               st.sampled_from([-1, 0, 1, 2, 49_151, 49_152, 2**31 - 1, -2**31])),
                     max_size=40)


WILD = {
    "max_tokens": st.one_of(st.integers(0, 12), st.sampled_from([0, 1, 64, 65, 10_000, UINT32_MAX])),
    "temperature": floats32,
    "top_p": floats32,
    "top_k": st.one_of(st.integers(0, 50), st.sampled_from([1, 49_152, 49_153, UINT32_MAX])),
    "seed": st.one_of(st.integers(0, 1000), st.sampled_from([0, 2**63, UINT64_MAX])),
    "stop": st.one_of(st.lists(text, max_size=8),
                      st.sampled_from([100, 1_000, 10_000]).map(lambda n: [f"s{i}" for i in range(n)]),
                      st.lists(huge_text(), max_size=2)),
    "mode": st.one_of(st.sampled_from([0, 1, 2]), st.integers(-5, 9)),
    "segment": st.one_of(text, huge_text()),
    "draft_scope": st.one_of(text, huge_text(), st.sampled_from(["t\x1f1", "a b", "x" * 65])),
    "prediction": st.one_of(text, huge_text()),
    "logprobs": st.one_of(st.integers(0, 25), st.sampled_from([20, 21, UINT32_MAX])),
    "presence_penalty": floats32,
    "frequency_penalty": floats32,
    "logit_bias": st.dictionaries(st.one_of(st.integers(-5, 49_160), st.sampled_from([-2**31, 2**31 - 1])),
                                  floats32, max_size=310),
    "stop_token_ids": st.lists(st.one_of(st.integers(-3, 49_160), st.sampled_from([-2**31, 2**31 - 1])), max_size=70),
    "min_tokens": st.one_of(st.integers(0, 40), st.sampled_from([UINT32_MAX])),
    "prompt_logprobs": st.one_of(st.integers(0, 25), st.sampled_from([20, 21, UINT32_MAX])),
    "json_schema": schemas,
    "regex": regexes,
    "grammar": grammars,
    "ignore_eos": st.booleans(),
}

# values a well-meaning client sends (odd unicode included): the service must answer these OK
SANE = {
    "max_tokens": st.integers(1, 8),
    "temperature": st.one_of(st.just(0.0), st.floats(0.0625, 2.0, width=32)),
    "top_p": st.floats(0.0625, 1.0, width=32),
    "top_k": st.integers(0, 50),
    "seed": st.integers(0, UINT64_MAX),
    "stop": st.lists(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6),
                     max_size=4),
    "mode": st.sampled_from([0, 1, 2]),
    "segment": st.sampled_from(["", "code", "chat", "ünïcödé", "x" * 40]),
    "draft_scope": st.sampled_from(["", "tenant-7", "bench-1/routed/grpc/c0", "x" * 64]),
    "json_schema": st.just(""),
    "regex": st.just(""),
    "grammar": st.just(""),
    "ignore_eos": st.booleans(),
    "logprobs": st.integers(0, 20),
    "presence_penalty": st.floats(-2.0, 2.0, width=32),
    "frequency_penalty": st.floats(-2.0, 2.0, width=32),
    "logit_bias": st.dictionaries(st.integers(0, 258), st.floats(-100.0, 100.0, width=32), max_size=4),
    "stop_token_ids": st.lists(st.integers(0, 258), max_size=3),
    "min_tokens": st.integers(0, 1),
    "prompt_logprobs": st.integers(0, 20),
}
sane_prompt = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=60)


@st.composite
def wild_request(draw) -> dict:
    """Any mix of the three prompt forms (none and conflicts too), any field at its edges."""
    fields: dict = {}
    forms = draw(st.sets(st.sampled_from(["prompt", "messages", "prompt_token_ids"]), max_size=3))
    if "prompt" in forms:
        fields["prompt"] = draw(any_text)
    if "messages" in forms:
        fields["messages"] = draw(st.lists(st.fixed_dictionaries({"role": roles, "content": any_text}),
                                           max_size=6))
    if "prompt_token_ids" in forms:
        ids = draw(st.one_of(token_ids, st.sampled_from([5_000, 100_000]).map(lambda n: [1] * n)))
        fields["prompt_token_ids"] = {"ids": ids}
    for name, strategy in WILD.items():
        if draw(st.booleans()):
            fields[name] = draw(strategy)
    return fields


@st.composite
def nearly_sane_request(draw) -> dict:
    """One prompt form with sane options, then up to two fields replaced by edge values."""
    form = draw(st.sampled_from(["prompt", "messages", "prompt_token_ids"]))
    if form == "prompt":
        fields: dict = {"prompt": draw(sane_prompt)}
    elif form == "messages":
        fields = {"messages": draw(st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant"]), "content": sane_prompt}),
            min_size=1, max_size=3))}
    else:
        fields = {"prompt_token_ids": {"ids": draw(st.lists(st.integers(0, 255), min_size=1, max_size=30))}}
    for name, strategy in SANE.items():
        if draw(st.booleans()):
            fields[name] = draw(strategy)
    if fields.get("mode", 0) != 2 and draw(st.booleans()):  # a prediction: the answer, or any text
        fields["prediction"] = draw(sane_prompt)
    for name in draw(st.lists(st.sampled_from(sorted(WILD)), max_size=2, unique=True)):
        fields[name] = draw(WILD[name])
    return fields


def generate_requests() -> st.SearchStrategy[dict]:
    """Keyword fields for ``GenerateRequest``: a third wild, two thirds nearly sane (so OK answers,
    and the engines behind them, are exercised as much as the validation)."""
    return st.one_of(wild_request(), nearly_sane_request(), nearly_sane_request())


# which credentials the call carries: (label, authorization value or None)
credentials = st.sampled_from([("good", True)] * 7 + [("missing", None), ("wrong", "Bearer nope"),
                                                     ("malformed", "Basic Zm9v")])
