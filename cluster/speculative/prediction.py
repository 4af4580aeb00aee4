"""Predicted outputs: drafting from the answer the client expects (OpenAI's ``prediction``,
gRPC's ``GenerateRequest.prediction``) — e.g. the file being edited, of which the answer rewrites
a few lines.

Owns: ``PredictedOutputs`` (per sequence: the prediction's tokens, where the output stands in
it, its acceptance, and the next draft), ``realign`` and ``prediction_overlap``.

Where the output stands. A sequence starts aligned at the prediction's first token. While the
output keeps to the prediction the position moves on with it, and the next draft is the
prediction's next K tokens. Once the output leaves it (a rejected draft, or tokens committed
without drafts) the sequence is lost until the output's last n tokens (``MIN_MATCH`` <= n <=
``MAX_MATCH``, longest first) occur in the prediction again: it realigns after that occurrence —
the first one at or after where it was last aligned, else the last one before (an edit resumes
where it left the original, not at an earlier repeat of the same line).

How many. α per sequence, accepted tokens over (accepted + rejections) with a prior of
``PRIOR_ALPHA`` worth ``PRIOR_WEIGHT`` trials (the client says this is the answer); K is the
engine's ``choose_k`` at that α with the engine's measured step costs and no draft cost (nothing
runs to draft): a right prediction drafts long, a wrong one short or not at all. Without a cost
model (a fixed-K segment) K is the segment's K.

``prediction_overlap``: the prediction's tokens that appear in the output in order (the matching
blocks of a longest-common-subsequence alignment) — what OpenAI reports as
``accepted_prediction_tokens``; the rest are ``rejected_prediction_tokens``.

Ignores: verification — a prediction's draft is deterministic (one-hot q) and verified like any
other, so greedy output is the target's own and sampling keeps its distribution whatever the
prediction says.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import numpy as np

from cluster.speculative.acceptance import Alpha
from cluster.speculative.adaptive_k import CostModel, choose_k
from cluster.speculative.ngram import longest_suffix_match

PREDICTION = "prediction"  # its name where drafters are named (step costs, stats)
PRIOR_ALPHA = 0.8
PRIOR_WEIGHT = 4.0
MIN_MATCH = 2  # a 1-token match realigns only where the output has one token so far
MAX_MATCH = 8


def realign(prediction: np.ndarray, output: np.ndarray, after: int) -> int | None:
    """prediction [P], output [O] (int64) -> the prediction index right after the occurrence of
    the output's longest suffix (``MIN_MATCH`` .. ``MAX_MATCH`` tokens; 1 when the output has one)
    that has a continuation: the first such occurrence ending at or after ``after``, else the last
    one before it; None when none matches."""
    length, size = output.shape[0], prediction.shape[0]
    if length == 0 or size < 2:
        return None
    n, ends = longest_suffix_match(prediction, size - 1, output, min(MAX_MATCH, length))
    if not ends.size or n < min(MIN_MATCH, length):
        return None
    later = ends[ends + 1 >= after]
    return int(later[0] if later.size else ends[-1]) + 1


@dataclass(slots=True)
class _Prediction:
    tokens: np.ndarray  # [P] int64
    prompt_len: int
    seen: int = 0  # output tokens already followed
    pos: int | None = 0  # index of the next token the output is expected to be; None: lost
    last_pos: int = 0  # where it was last aligned
    accepted: int = 0
    rejections: int = 0

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_ALPHA * PRIOR_WEIGHT) / (self.accepted + self.rejections + PRIOR_WEIGHT)

    def follow(self, output: list[int]) -> None:
        """Move along with the output committed since the last call."""
        if len(output) < self.seen:  # cannot happen to committed tokens: start over
            self.seen, self.pos, self.last_pos = 0, 0, 0
        new = output[self.seen:]
        self.seen = len(output)
        if not new:
            return
        if self.pos is not None:
            end = self.pos + len(new)
            if end <= self.tokens.shape[0] and self.tokens[self.pos:end].tolist() == new:
                self.pos = self.last_pos = end
                return
        self.pos = realign(self.tokens, np.asarray(output, dtype=np.int64), self.last_pos)
        if self.pos is not None:
            self.last_pos = self.pos


@dataclass(slots=True)
class PredictedOutputs:
    """The engine's predictions, by sequence id (created on a sequence's first ``draft``)."""

    _seqs: dict[str, _Prediction] = field(default_factory=dict)

    def draft(self, seq_id: str, prediction: tuple[int, ...], prompt_len: int, token_ids: list[int],
              max_k: int, costs: CostModel | None) -> list[int]:
        """The next draft for a sequence with committed ``token_ids`` (prompt + output): up to K
        tokens of the prediction after where the output stands, [] when it is lost there, the
        prediction is used up, or its α does not pay at these costs."""
        p = self._seqs.get(seq_id)
        if p is None:
            p = self._seqs[seq_id] = _Prediction(np.asarray(prediction, dtype=np.int64), prompt_len)
        p.follow(token_ids[p.prompt_len:])
        if p.pos is None or max_k <= 0:
            return []
        left = p.tokens.shape[0] - p.pos
        k = min(max_k, left) if costs is None else choose_k(p.alpha, min(max_k, left), costs, drafter=PREDICTION)
        return p.tokens[p.pos : p.pos + k].tolist() if k > 0 else []

    def observe(self, seq_id: str, num_draft_tokens: int, accepted: int) -> None:
        """A verified draft of this sequence's prediction: ``accepted`` of its tokens kept."""
        p = self._seqs.get(seq_id)
        if p is None or num_draft_tokens <= 0:
            return
        p.accepted += accepted
        p.rejections += accepted < num_draft_tokens

    def alpha(self, seq_id: str) -> Alpha | None:
        p = self._seqs.get(seq_id)
        return None if p is None else p.alpha

    def release(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._seqs)


def prediction_overlap(prediction: list[int] | tuple[int, ...], output: list[int]) -> int:
    """The prediction's tokens that appear in the output, in order (sum of the matching blocks of
    ``difflib``'s alignment, junk heuristics off): ``accepted_prediction_tokens``."""
    if not prediction or not output:
        return 0
    matcher = difflib.SequenceMatcher(None, list(prediction), list(output), autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks())
