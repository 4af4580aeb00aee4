"""How much text a constraint demands in one run: the repetition bound, checked before any
grammar is built.

Owns: ``repeat_bound`` — for a regex, the longest run of characters one of its choices demands
(minimum counts ``{n}`` / ``{n,}`` / ``{n,m}`` multiply when nested and add up in sequence, the
longest alternative counts: ``regex_repeat_bound``); for a JSON Schema, the largest
``minLength`` / ``minItems`` / ``minProperties`` or ``pattern`` / ``patternProperties`` bound
anywhere in it; for a Lark grammar, the largest bound of its ``/regex/`` lexemes, ``"text"{n}``,
``item ~ n`` / ``~ n..m`` and embedded ``%json`` schemas — and ``check_repeat_bound``
(InvalidRequestError naming ``limits.max_constraint_repeat``). Model-free and linear in the text,
so the Router runs it with the size checks.

Why: text a grammar demands becomes forced text once the output commits to it, and llguidance
walks forced text through its lexer one DFA state per byte at the next mask; near 50,000 forced
bytes it runs out of lexer fuel or Earley items (``cluster.engine.grammar``), and well before that
each step re-tokenizes the forced run (``a{40000}``: ~30 ms per step). Maxima are free
(``a{0,1000000}``, ``maxLength``: the output may stop at any point), so only minima count.
Ignores: whether the constraint is valid (``check_grammar``); what a JSON Schema's or a Lark
grammar's structure multiplies (``minItems`` times the items' size, rules that double each other) —
the engine's compile probe and its run-time check (``GrammarMatcher.allowed``) fail those that go
past llguidance's limits.
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
    """The longest run of characters a choice in a (Rust syntax) regex demands, counting atoms
    (a character, a class, an escape) as 1: minimum counts multiply the count's operand (at least
    once: ``(a{5000}){0,3}`` may still take the 5000), sequences add, alternatives take the
    longest, ``*`` / ``+`` / ``?`` take their operand once. ``[a-z]{2,6}-[0-9]{2,3}`` -> 5,
    ``(a{10}b){20}`` -> 220, ``a{0,1000000}`` -> 1."""
    frames = [[0, 0, 0]]  # per open group: [longest finished alternative, this alternative, last operand]
    i, n = 0, len(rx)
    while i < n:
        c = rx[i]
        top = frames[-1]
        atom = 1
        if c == "\\":
            i = _skip_escape(rx, i)
        elif c == "[":
            i = _skip_class(rx, i)
        elif c == "(":
            i += 1
            if rx.startswith("?", i):  # (?:, (?i:, (?P<name>, (?<name>: a prefix, not text; (?i): flags
                while i < n and rx[i] not in ":)>":
                    i += 1
                if i < n and rx[i] == ")":
                    i += 1
                    continue
                i += 1
            frames.append([0, 0, 0])
            continue
        elif c == ")" and len(frames) > 1:
            done, run, _ = frames.pop()
            atom = max(done, run)
            i += 1
        elif c == "|":
            top[0], top[1], top[2] = max(top[0], top[1]), 0, 0
            i += 1
            continue
        elif c == "{" and (m := _COUNT.match(rx, i)):
            times = max(int(m.group(1)), 1)
            top[1] += top[2] * (times - 1)
            top[2] *= times
            i = m.end()
            continue
        elif c in "*+?^$":
            i += 1
            continue
        else:
            i += 1
        top = frames[-1]
        top[1] += atom
        top[2] = atom
    while len(frames) > 1:  # unclosed groups (malformed): count what they hold
        done, run, _ = frames.pop()
        frames[-1][1] += max(done, run)
    return max(frames[0][0], frames[0][1], 1)


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
            f"{constraint.kind.value} demands a run of {bound} characters, over the "
            f"limits.max_constraint_repeat limit of {max_repeat} (minimum repetition counts, "
            "multiplied when nested and added in sequence)")
