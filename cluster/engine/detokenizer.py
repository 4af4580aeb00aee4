"""Incremental detokenization and stop-string matching for one sequence.

Owns: turning a growing list of output token ids into text deltas without re-decoding the whole
output each step (a window of already-emitted tokens is re-decoded as left context; a trailing
U+FFFD means an incomplete UTF-8 character and is held back), stop strings (text ends just before
the first one; a request's ``min_tokens`` disarms them until the output is that long: a stop
string ending before then is text like any other), and holding back a tail that could still become
a stop string so that streamed text never has to be retracted. Ignores: token-level stop conditions (scheduler).
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
    _stop_from: int = 0  # a stop string must end past this many characters (min_tokens' text)

    def add(self, token_id: int, check_stop: bool = True) -> tuple[str, bool]:
        """Append one output token; returns (text delta safe to emit, stop_string_hit).
        ``check_stop=False``: the output is still under ``min_tokens``; its text so far cannot hold
        the end of a stop string."""
        self._ids.append(token_id)
        left = max(0, self._read_offset - _CONTEXT_TOKENS)
        prefix = self.tokenizer.decode(self._ids[left : self._read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self._ids[left:], skip_special_tokens=True)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return "", False
        self._read_offset = len(self._ids)
        old_len = len(self.text)
        self.text += full[len(prefix) :]
        if not check_stop:
            self._stop_from = len(self.text)
        if self.stop:
            start = max(0, old_len - max(map(len, self.stop)) + 1)
            hits = [i for s in self.stop
                    if (i := self.text.find(s, max(start, self._stop_from - len(s) + 1))) >= 0]
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
