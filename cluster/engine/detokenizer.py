"""Incremental detokenization and stop-string matching for one sequence.

Owns: turning a growing list of output token ids into text deltas without re-decoding the whole
output each step (a window of already-emitted tokens is re-decoded as left context; a trailing
U+FFFD means an incomplete UTF-8 character and is held back), stop strings (text ends just before
the first one), and holding back a tail that could still become a stop string so that streamed
text never has to be retracted. Ignores: token-level stop conditions (scheduler).
"""
from __future__ import annotations

from dataclasses import dataclass, field

_CONTEXT_TOKENS = 6  # emitted tokens re-decoded as left context (BPE merges across tokens)


@dataclass(slots=True)
class Detokenizer:
    tokenizer: object
    stop: tuple[str, ...] = ()
    text: str = ""  # all decoded text so far (stop string excluded after a hit)
    _emitted: int = 0  # len(text) already handed out as deltas
    _ids: list[int] = field(default_factory=list)
    _read_offset: int = 0

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append one output token; returns (text delta safe to emit, stop_string_hit)."""
        self._ids.append(token_id)
        left = max(0, self._read_offset - _CONTEXT_TOKENS)
        prefix = self.tokenizer.decode(self._ids[left : self._read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self._ids[left:], skip_special_tokens=True)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return "", False
        self._read_offset = len(self._ids)
        old_len = len(self.text)
        self.text += full[len(prefix) :]
        if self.stop:
            start = max(0, old_len - max(map(len, self.stop)) + 1)
            hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return self.flush(), True
            hold = max(map(len, self.stop)) - 1
            safe = len(self.text) - hold
            if safe > self._emitted:
                # do not cut a held-back tail in the middle of a possible stop-string match
                delta = self.text[self._emitted : safe]
                self._emitted = safe
                return delta, False
            return "", False
        return self.flush(), False

    def flush(self) -> str:
        """Everything not yet emitted (call when the sequence finishes)."""
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return delta
