"""A sequence's committed tokens as a growing numpy buffer, for the model-free drafters (n-gram,
suffix) that search them every step.

Owns: ``TokenHistory`` — the buffer (spare capacity doubled when outgrown) and ``follow``, which
takes the engine's token list for the same sequence and appends only what is new. Committed
tokens only grow; a shorter list or changed endpoints (a preempted sequence, a reused id) is
refused (the caller starts a new history). A wrong guess can only cost a poor draft: the target
verifies every token.
Ignores: what is searched (``cluster.speculative.ngram``, ``cluster.speculative.suffix``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class TokenHistory:
    buf: np.ndarray  # [capacity] the committed tokens in [0, length)
    length: int

    @classmethod
    def of(cls, token_ids: list[int], dtype=np.int64) -> "TokenHistory":
        buf = np.empty(max(64, 2 * len(token_ids)), dtype=dtype)
        buf[: len(token_ids)] = token_ids
        return cls(buf, len(token_ids))

    @property
    def tokens(self) -> np.ndarray:  # [length] a view
        return self.buf[: self.length]

    def follow(self, token_ids: list[int]) -> bool | None:
        """Take ``token_ids`` if they extend (or equal) the history: True when tokens were
        appended, False when nothing is new, None when they do not extend it (start afresh)."""
        n = len(token_ids)
        if not (0 < self.length <= n and self.buf[0] == token_ids[0]
                and self.buf[self.length - 1] == token_ids[self.length - 1]):
            return None
        if n == self.length:
            return False
        if n > self.buf.shape[0]:
            grown = np.empty(2 * n, dtype=self.buf.dtype)
            grown[: self.length] = self.buf[: self.length]
            self.buf = grown
        self.buf[self.length : n] = token_ids[self.length : n]
        self.length = n
        return True
