"""Structured output: a request's constraint (JSON Schema, regex or Lark grammar) compiled to a
grammar, and the per-sequence matcher that turns it into a token mask at every step.

Owns: ``check_grammar`` (the model-free check: syntax
and unsupported features, refused with a message naming them), ``GrammarCompiler`` (one per
engine: the tokenizer's token trie built once, a bounded LRU cache of checked grammars, a compile
time limit), ``GrammarMatcher`` (one per sequence, single owner: the grammar state after the
sequence's committed output tokens, masks, draft walks with rollback), ``DraftCursor`` (the
grammar state along a draft while a model drafter drafts it under the mask) and ``apply_masks`` (allowed
[N, V] -> -inf on the logits). Ignores: sampling (``cluster.sampling.sampler`` sees masked logits)
and verification (``cluster.speculative``).

Engine: llguidance (chosen over xgrammar because it refuses unimplemented JSON Schema keywords and
unknown formats instead of silently ignoring them, has parser resource limits that turn
blow-ups into errors instead of hangs, and needs no per-grammar compile; see
docs/structured-output.md). Three llguidance facts shape this file: consuming an illegal token
poisons a matcher for good (so every token is checked against the mask first); consuming EOS
records nothing (so EOS is never fed: the engine ends the sequence on a mask-allowed EOS itself);
and a mask of one forced token is returned without checking the parser's error state. When the
grammar forces a long run of text (``a{1000000}``), llguidance pushes the forced bytes through its
lexer one DFA state per byte until the lexer's fuel or the parser's item limit runs out; the
lexer is then in its (sticky) error state, yet the mask still allows the first forced token and
only ``consume_token`` reports the error. So ``allowed()`` proves a one-token mask by consuming
the token and rolling it back: the mask never allows a token the matcher refuses — a matcher
past its limits is a ``GrammarError`` (that request's fault), at compile time ``INVALID_ARGUMENT``.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict

import numpy as np
import torch

from cluster.common.errors import InvalidRequestError
from cluster.common.request import Constraint, ConstraintKind

MAX_CACHED_GRAMMARS = 256
COMPILE_TIME_LIMIT_S = 2.0  # checking + first mask of one constraint; over it -> INVALID_ARGUMENT
_JSON_DEFAULTS = {"whitespace_flexible": False}  # compact JSON: no unbounded whitespace loops


def _grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (raises on malformed input)."""
    from llguidance import LLMatcher

    if constraint.kind is ConstraintKind.JSON_SCHEMA:
        return LLMatcher.grammar_from_json_schema(json.loads(constraint.text), defaults=_JSON_DEFAULTS)
    if constraint.kind is ConstraintKind.GRAMMAR:
        return LLMatcher.grammar_from_lark(constraint.text)
    return LLMatcher.grammar_from_regex(constraint.text)


def check_grammar(constraint: Constraint, tokenizer=None) -> str:
    """The grammar text of ``constraint``, or InvalidRequestError saying what is wrong (syntax,
    unimplemented keywords such as ``not``, unknown formats) — never silently ignored."""
    from llguidance import LLMatcher

    name = constraint.kind.value
    try:
        grammar = _grammar_text(constraint)
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    except RecursionError:
        raise InvalidRequestError(f"{name} is nested too deeply") from None
    except Exception as exc:  # noqa: BLE001 (the grammar builder rejects this input)
        raise InvalidRequestError(f"{name} is not supported: {_first_line(exc)}") from None
    if failed or messages:  # warnings are features the grammar would ignore: refuse them
        detail = "; ".join(_first_line(m) for m in messages) or "invalid grammar"
        raise InvalidRequestError(f"{name} is not supported: {detail}"[:500])
    return grammar


def _first_line(x) -> str:
    lines = [ln.strip() for ln in str(x).strip().splitlines() if ln.strip()]
    return " ".join(lines[:2]) if lines else type(x).__name__


class GrammarCompiler:
    """Per engine: the llguidance tokenizer (built once, ~1 s) and a bounded LRU of grammars."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, max_cached: int = MAX_CACHED_GRAMMARS,
                 time_limit_s: float = COMPILE_TIME_LIMIT_S) -> None:  # EngineConfig.grammar_compile_s
        if max_cached < 1 or time_limit_s <= 0:
            raise ValueError("max_cached must be >= 1 and time_limit_s > 0")
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_cached = max_cached
        self.time_limit_s = time_limit_s
        self._lock = threading.Lock()
        self._tokenizer = None
        self._cache: OrderedDict[Constraint, str] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=max(self.vocab_size, len(self._hf_tokenizer)),
                    eos_token=self.eos_token_ids)
            return self._tokenizer

    def compile(self, constraint: Constraint) -> str:
        """The checked grammar of ``constraint`` (cached); InvalidRequestError when it is not
        supported, when the grammar engine hits its limits building it or computing a first mask
        (naming the limit), or when that takes longer than the time limit."""
        with self._lock:
            if constraint in self._cache:
                self._cache.move_to_end(constraint)
                self.hits += 1
                return self._cache[constraint]
        tokenizer = self.tokenizer  # built once per engine (~1 s): not this constraint's cost
        # CPU time of this thread, not wall time: a busy machine must not turn a simple schema
        # into INVALID_ARGUMENT (llguidance computes on the calling thread)
        t0 = time.thread_time()
        grammar = check_grammar(constraint, tokenizer)
        try:
            probe = GrammarMatcher(self, grammar)  # the first mask builds the lexer: the costly part
            probe.allowed()
        except GrammarError as exc:
            raise InvalidRequestError(f"{constraint.kind.value} cannot be enforced: {exc}"[:500]) from None
        elapsed = time.thread_time() - t0
        if elapsed > self.time_limit_s:
            raise InvalidRequestError(f"{constraint.kind.value} is too complex: compiling it took "
                                      f"{elapsed:.1f} s, over the {self.time_limit_s:g} s limit")
        with self._lock:
            self.misses += 1
            self._cache[constraint] = grammar
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, constraint: Constraint) -> "GrammarMatcher":
        return GrammarMatcher(self, self.compile(constraint))


class GrammarError(RuntimeError):
    """The matcher cannot follow the committed tokens (a per-sequence fault, never batch-wide)."""


class GrammarMatcher:
    """The grammar state after one sequence's committed output tokens.

    ``allowed()`` -> [V] bool of the tokens legal next (EOS only where the grammar can end);
    ``accept(t)`` advances by a committed non-EOS token; ``walk(drafts)`` computes the masks along
    a draft and leaves the state unchanged."""

    def __init__(self, compiler: GrammarCompiler, grammar: str) -> None:
        from llguidance import LLMatcher

        self.vocab_size = compiler.vocab_size
        self.eos_token_ids = frozenset(compiler.eos_token_ids)
        self._tokenizer = compiler.tokenizer
        self._m = LLMatcher(self._tokenizer, grammar)
        self._raise_if_error()

    def _raise_if_error(self) -> None:
        if self._m.is_error():
            first = (self._m.get_error().strip().splitlines() or ["unknown error"])[0]  # then a state dump
            raise GrammarError(f"the grammar engine hit its limits: {first.strip()}")

    @property
    def complete(self) -> bool:
        """No token but EOS can follow: the structured output is finished."""
        return self._m.is_stopped()

    def allowed(self) -> torch.Tensor:  # [V] bool
        raw = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)  # [4 * ceil(V'/32)] LE words
        self._raise_if_error()
        # bit t of the little-endian int32 words is bit t % 8 of byte t // 8
        bits = np.unpackbits(raw, bitorder="little")[: self.vocab_size].astype(bool)
        if not bits.any():  # numpy: torch's any() on a small CPU tensor costs milliseconds here
            raise GrammarError("the grammar allows no token")
        if bits.shape[0] < self.vocab_size:
            bits = np.concatenate([bits, np.zeros(self.vocab_size - bits.shape[0], dtype=bool)])
        if np.count_nonzero(bits) == 1:
            self._prove_forced(int(bits.argmax()))
        return torch.from_numpy(bits)

    def _prove_forced(self, token: int) -> None:
        """A one-token mask may be llguidance's forced-token shortcut, which skips the parser's
        error check (module docstring): consume the token and roll it back, so a matcher past
        its limits raises GrammarError here instead of refusing the masked token later."""
        if token in self.eos_token_ids:  # never fed: the engine ends the sequence itself
            return
        if not self._m.consume_token(token):
            self._raise_if_error()
            raise GrammarError(f"the grammar matcher refuses token {token}, the only one its mask allows")
        self._m.rollback(1)
        self._raise_if_error()

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next (canonically tokenized; may be fewer than the
        forced text: llguidance holds back tokens that could merge with what follows)."""
        if self._m.is_stopped():
            return []
        out = list(self._m.compute_ff_tokens())
        self._raise_if_error()
        return out

    def forced_text(self) -> bytes:
        """The text the grammar forces next; it may run past ``forced_tokens()`` (the tail whose
        tokenization is not settled yet, e.g. '":"' before a string value)."""
        if self._m.is_stopped():
            return b""
        out = bytes(self._m.compute_ff_bytes())
        self._raise_if_error()
        return out

    def token_bytes(self, tokens: list[int]) -> bytes:
        return bytes(self._tokenizer.decode_bytes(list(tokens)))

    def accept(self, token: int) -> None:
        """Advance by one committed token (not EOS); GrammarError if the grammar forbids it (or
        the matcher is past its limits: the error says which)."""
        if not self._try_consume(token):
            self._raise_if_error()
            raise GrammarError(f"token {token} is not allowed by the grammar here")

    def walk(self, drafts: list[int], keep_illegal: bool) -> tuple[int, torch.Tensor]:
        """Masks along a draft: (k, allowed [k + 1, V]) where row j is the mask after
        drafts[:j]. The draft is cut before its first illegal token (after it when
        ``keep_illegal``: a sampled draft keeps the position so verification rejects it there,
        which keeps rejection sampling lossless) and after an EOS (nothing follows an end).
        Rows past the grammar's reach are all-True (their tokens are never committed). The
        matcher state is unchanged on return."""
        rows = [self.allowed()]
        consumed = 0
        k = len(drafts)
        try:
            for j, t in enumerate(drafts):
                legal = 0 <= t < self.vocab_size and bool(rows[j][t])
                if t in self.eos_token_ids or not legal:
                    k = j + 1 if (legal or keep_illegal) else j
                    break
                if not self._m.consume_token(t):
                    raise GrammarError(f"draft token {t} rejected by the grammar matcher")
                consumed += 1
                rows.append(self.allowed())
        finally:
            if consumed:
                self._m.rollback(consumed)
            self._raise_if_error()
        while len(rows) < k + 1:
            rows.append(torch.ones(self.vocab_size, dtype=torch.bool))
        return k, torch.stack(rows[: k + 1])


    def draft_cursor(self, prefix: list[int]) -> "DraftCursor":
        """A cursor that follows a draft while a model drafter drafts it, after ``prefix`` (the
        step's forced tokens); ``close()`` rolls the matcher back to the committed state."""
        cursor = DraftCursor(self)
        try:
            for t in prefix:
                cursor.advance(t)
        except BaseException:
            cursor.close()
            raise
        return cursor

    def _try_consume(self, token: int) -> bool:
        """Consume ``token`` if the grammar allows it here (never EOS) -> whether it did."""
        if token in self.eos_token_ids or not 0 <= token < self.vocab_size:
            return False
        if self._m.validate_tokens([token]) != 1 or not self._m.consume_token(token):
            return False
        self._raise_if_error()
        return True


class DraftCursor:
    """The grammar state along a draft being drafted (``cluster.speculative.types.DraftGrammar``):
    ``allowed()`` [V] bool after the tokens so far, ``advance(t)`` follows the drafted token
    (an illegal or EOS token ends the cursor: ``alive`` False, nothing after it is masked — the
    walk cuts the draft there), ``close()`` rolls the matcher back. Single owner, one step."""

    def __init__(self, matcher: GrammarMatcher) -> None:
        self._matcher = matcher
        self._consumed = 0
        self.alive = True

    def allowed(self) -> torch.Tensor:  # [V] bool
        return self._matcher.allowed()

    def advance(self, token: int) -> None:
        if self.alive and self._matcher._try_consume(int(token)):
            self._consumed += 1
        else:
            self.alive = False

    def close(self) -> None:
        if self._consumed:
            self._matcher._m.rollback(self._consumed)
            self._consumed = 0
        self.alive = False
        self._matcher._raise_if_error()


def apply_masks(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with -inf where allowed [N, V] is False (a new tensor)."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
