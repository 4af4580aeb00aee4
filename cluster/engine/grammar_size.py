"""How much text a constraint forces: the repetition bound, checked before any grammar is built.

Owns: ``repeat_bound`` (the largest product of nested *minimum* repetition counts in a
constraint: a regex's ``{n}`` / ``{n,}`` / ``{n,m}`` count ``n``; a JSON Schema's ``minLength`` /
``minItems`` / ``minProperties`` and the regexes of its ``pattern`` / ``patternProperties``; a Lark
grammar's ``/regex/`` lexemes, ``"text"{n}`` and ``item ~ n`` / ``item ~ n..m``) and
``check_repeat_bound`` (InvalidRequestError naming ``limits.max_constraint_repeat``). Model-free and
linear in the text, so the Router runs it with the size checks.

Why the minimum: text a grammar must produce is forced text, and llguidance walks forced text
through its lexer one DFA state per byte at the next mask; near 50,000 forced bytes it runs out of
lexer fuel or Earley items (``cluster.engine.grammar``), and well before that each step re-tokenizes
the forced run (``a{40000}``: ~30 ms per step). Maxima are free (``a{0,1000000}``, ``maxLength``: the
output may stop at any point), so they are not counted. Ignores: whether the constraint is valid
(``check_grammar``); runs in sequence (``a{4000}b{4000}`` counts 4000, not 8000) and a Lark grammar
whose rules multiply (``x: y y``, ``y: z z`` …) are not summed here — the engine's compile probe
and its run-time check (``GrammarMatcher.allowed``) fail those that go past llguidance's limits.
"""
from __future__ import annotations

import json
import re

from cluster.common.errors import InvalidRequestError
from cluster.common.request import Constraint, ConstraintKind

_COUNT = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}")  # {n}, {n,}, {n,m} (Rust regex and Lark)
_TILDE = re.compile(r"~\s*(\d+)")  # Lark: item ~ n, item ~ n..m
_ESCAPE_WITH_BRACES = "pPxu"  # \p{Greek}, \x{10FFFF}, \u{...}: braces that are not a count
_MIN_KEYS = ("minLength", "minItems", "minProperties")
_LARK_LITERAL = re.compile(r'"(?:[^"\\\n]|\\.)*"|/(?:[^/\\\n]|\\.)+/')  # "string" or /regex/
_JSON_MIN = re.compile(r'"(minLength|minItems|minProperties)"\s*:\s*(\d+)')  # inside %json {...}
_JSON_PATTERN = re.compile(r'"pattern"\s*:\s*("(?:[^"\\]|\\.)*")')


def regex_repeat_bound(rx: str) -> int:
    """The largest product of nested minimum repetition counts in a (Rust syntax) regex: 1 for
    text without counts; ``(a{10}b){20}`` -> 200."""
    frames = [[1, 0]]  # per open group: [largest bound inside, bound of the last atom]
    i, n = 0, len(rx)
    while i < n:
        c = rx[i]
        top = frames[-1]
        if c == "\\":
            i = _skip_escape(rx, i)
            top[1] = 1
            continue
        if c == "[":
            i = _skip_class(rx, i)
            top[1] = 1
            continue
        if c == "(":
            frames.append([1, 0])
        elif c == ")" and len(frames) > 1:
            inner = frames.pop()[0]
            frames[-1][1] = inner
            frames[-1][0] = max(frames[-1][0], inner)
        elif c == "|":
            top[1] = 0
        elif c == "{" and (m := _COUNT.match(rx, i)):
            top[1] = max(top[1], 1) * int(m.group(1))
            top[0] = max(top[0], top[1])
            i = m.end()
            continue
        else:
            top[1] = 1
        i += 1
    return max(f[0] for f in frames)


def _skip_escape(rx: str, i: int) -> int:
    """Index after the escape at rx[i] == '\\' (``\\p{L}`` and ``\\x{41}`` included)."""
    if i + 2 < len(rx) and rx[i + 1] in _ESCAPE_WITH_BRACES and rx[i + 2] == "{":
        end = rx.find("}", i + 3)
        return len(rx) if end < 0 else end + 1
    return i + 2


def _skip_class(rx: str, i: int) -> int:
    """Index after the character class opening at rx[i] == '[' (nested classes, escapes and a
    leading ']' included)."""
    depth, j, n = 0, i, len(rx)
    while j < n:
        c = rx[j]
        if c == "\\":
            j = _skip_escape(rx, j)
            continue
        if c == "[":
            depth += 1
            j += 1
            if j < n and rx[j] == "^":
                j += 1
            if j < n and rx[j] == "]":  # a leading ']' is a literal
                j += 1
            continue
        if c == "]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return n


def schema_repeat_bound(schema: object) -> int:
    """The largest minimum count (``minLength``, ``minItems``, ``minProperties``) or pattern
    bound anywhere in a JSON Schema document (counts in nested schemas are not multiplied)."""
    best, stack = 1, [schema]
    while stack:  # iterative: a deeply nested schema must not recurse
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key in _MIN_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool):
                best = max(best, int(value) if value == value and abs(value) != float("inf") else 1)
            elif key == "pattern" and isinstance(value, str):
                best = max(best, regex_repeat_bound(value))
            elif key == "patternProperties" and isinstance(value, dict):
                best = max([best] + [regex_repeat_bound(k) for k in value])
            if isinstance(value, (dict, list)):
                stack.append(value)
    return best


def lark_repeat_bound(text: str) -> int:
    """The largest count in a Lark grammar: its ``/regex/`` lexemes' bounds, ``{n}`` after a
    string or group, ``~ n``, and the minimum counts and patterns of ``%json`` schemas."""
    best, outside, last = 1, [], 0
    for m in _LARK_LITERAL.finditer(text):  # one pass: a '/' inside a string is not a regex
        outside.append(text[last : m.start()])
        last = m.end()
        if m.group(0).startswith("/"):
            best = max(best, regex_repeat_bound(m.group(0)[1:-1]))
    outside.append(text[last:])
    rest = " ".join(outside)  # the grammar's own operators, literals taken out
    counts = [int(m.group(1)) for pattern in (_COUNT, _TILDE) for m in pattern.finditer(rest)]
    counts += [int(m.group(2)) for m in _JSON_MIN.finditer(text)]
    for m in _JSON_PATTERN.finditer(text):
        try:
            counts.append(regex_repeat_bound(json.loads(m.group(1))))
        except ValueError:
            continue
    return max([best] + counts)


def repeat_bound(constraint: Constraint) -> int:
    """The constraint's repetition bound (see the module docstring); malformed text counts what
    it can (its syntax is ``check_grammar``'s to refuse)."""
    if constraint.kind is ConstraintKind.REGEX:
        return regex_repeat_bound(constraint.text)
    if constraint.kind is ConstraintKind.GRAMMAR:
        return lark_repeat_bound(constraint.text)
    try:
        schema = json.loads(constraint.text)
    except (ValueError, RecursionError):
        return 1
    return schema_repeat_bound(schema)


def check_repeat_bound(constraint: Constraint, max_repeat: int) -> None:
    """InvalidRequestError when the constraint forces more repetitions than ``max_repeat``."""
    bound = repeat_bound(constraint)
    if bound > max_repeat:
        raise InvalidRequestError(
            f"{constraint.kind.value} repeats {bound} times, over the limits.max_constraint_repeat "
            f"limit of {max_repeat} (a minimum repetition count, nested counts multiplied)")
