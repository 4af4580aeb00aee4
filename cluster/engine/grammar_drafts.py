"""Drafts under a grammar: what a constrained sequence verifies in one step, with the masks
along it.

Owns: ``forced_prefix`` (jump-forward: the tokens the grammar forces next, proposed as free
drafts), ``ForcedText`` (the target's tokenization of forced text the grammar engine holds back,
learnt and drafted after the forced tokens), ``grammar_draft`` (the forced tokens followed by the drafter's draft for the context
*after* them, cut where the grammar rejects it, with the masks along it and q extended by one-hot
rows for the forced tokens). Ignores: applying the masks to a step's rows
(``cluster.engine.target_rows``), which sequences draft and how many tokens (``cluster.engine.speculation`` plans the
forced tokens plus the drafter's K), the grammar engine itself (``cluster.engine.grammar``).

Why forced tokens and a draft in one step: a JSON object alternates text the grammar fixes
(``{"name":"``, ``","age":``) with values the model chooses, often copied from the prompt. The
forced run is verified with the draft behind it, so one target pass can commit the key, the
value and the token after it. Forced tokens are verified like any draft (the target may prefer
another tokenization of the same text: the masked target then rejects the forced token there),
so output is lossless whatever the grammar engine returns.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from cluster.engine.drafts import SeqDraft
from cluster.engine.sequence import Sequence

log = logging.getLogger(__name__)

MAX_FORCED_TOKENS = 32  # jump-forward tokens verified in one step at most (a long literal waits a step)


def forced_prefix(seq: Sequence) -> list[int]:
    """The tokens ``seq``'s grammar forces next ([] when the grammar leaves a choice, or when
    asking it fails: jump-forward is an optimisation, verification masks every row anyway)."""
    try:
        return [int(t) for t in seq.grammar.forced_tokens()][:MAX_FORCED_TOKENS]
    except Exception:  # noqa: BLE001 (a matcher fault surfaces where the mask is needed)
        log.exception("request %s: computing forced tokens failed", seq.seq_id)
        return []


class ForcedText:
    """How the target tokenizes forced text the grammar engine holds back, learnt per engine.

    llguidance's forced tokens stop where the tokenization of the forced text is not settled:
    after ``{"name`` the text ``":"`` is forced but may be ``":"``, ``":`` + ``"`` or ``"`` + ``:"``
    (the SmolLM2 target writes ``":`` + ``"``). ``draft`` proposes, after the forced tokens, the
    tokens the target committed for the same held-back text before (nothing the first time), and
    learns from the sequence's committed tokens once they spell a held-back text exactly. A wrong
    guess is a rejected draft (verification masks every row): this changes only how many tokens
    a step commits, never which."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._tokens: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        # seq_id -> (held-back text, where its tokens start in token_ids, the forced tokens before it)
        self._pending: dict[str, tuple[bytes, int, tuple[int, ...]]] = {}

    def draft(self, seq: Sequence, forced: list[int]) -> list[int]:
        """The learnt tokens of the text forced after ``forced`` ([] when none is held back or
        that text was never seen)."""
        self._learn(seq)
        text = seq.grammar.forced_text()
        done = seq.grammar.token_bytes(forced) if forced else b""
        if len(text) <= len(done) or not text.startswith(done):
            return []
        rest = text[len(done):]
        if seq.seq_id not in self._pending:  # (an unresolved one is the longer text: it stays)
            self._pending[seq.seq_id] = (rest, len(seq.token_ids) + len(forced), tuple(forced))
        got = self._tokens.get(rest)
        if got is None:
            return []
        self._tokens.move_to_end(rest)
        return list(got)

    def _learn(self, seq: Sequence) -> None:
        """Resolve the sequence's pending text: learnt when its committed tokens spell it
        exactly, dropped when they do not (or its forced tokens were not committed)."""
        pending = self._pending.get(seq.seq_id)
        if pending is None:
            return
        rest, start, forced = pending
        ids = seq.token_ids
        if len(ids) < start + 1:
            return  # not committed yet
        if tuple(ids[start - len(forced) : start]) != forced:
            del self._pending[seq.seq_id]
            return
        got = b""
        for j, t in enumerate(ids[start:]):
            got += seq.grammar.token_bytes([t])
            if got == rest:
                self._tokens[rest] = tuple(ids[start : start + j + 1])
                self._tokens.move_to_end(rest)
                while len(self._tokens) > self.max_entries:
                    self._tokens.popitem(last=False)
                break
            if not rest.startswith(got):
                break
        else:
            return  # a prefix of the text so far: wait for more tokens
        del self._pending[seq.seq_id]

    def release(self, seq_id: str) -> None:
        self._pending.pop(seq_id, None)


def one_hot(tokens: list[int], vocab: int) -> torch.Tensor:  # [F, V] float32
    out = torch.zeros(len(tokens), vocab, dtype=torch.float32)
    if tokens:
        out[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.int64)] = 1.0
    return out


def grammar_draft(seq: Sequence, forced: list[int], ids: list[int],
                  probs: torch.Tensor | None) -> tuple[SeqDraft | None, int]:
    """forced tokens + the drafter's draft ``ids`` (q [K_d, V] | None, drafted after the forced
    tokens) under ``seq``'s grammar -> (the draft to verify or None when nothing is left, draft
    tokens the grammar cut). A deterministic draft (q None, or a greedy / seeded request, whose
    verification ignores q) is cut before its first illegal token; a sampled draft keeps that
    token (p' = 0 there rejects it and the residual is drawn under the mask: cutting it would
    bias rejection sampling). Raises when the grammar walk fails (the caller drops the drafts)."""
    tokens = list(forced) + list(ids)
    if not tokens:
        return None, 0
    q = probs
    if q is not None and forced:  # the forced rows of q: one-hot, like any deterministic draft
        q = torch.cat([one_hot(forced, q.shape[1]), q])  # [F + K_d, V]
    sp = seq.request.params
    keep_illegal = q is not None and not (sp.greedy or sp.coupled)
    k, allowed = seq.grammar.walk(tokens, keep_illegal)  # allowed [k + 1, V]
    cut = len(tokens) - k
    if k == 0:
        return None, cut
    return SeqDraft(tokens[:k], None if q is None else q[:k], min(len(forced), k), allowed), cut
