"""Data that travels between proposer, verifier and rejection sampler.

Owns: the ragged-batch metadata and the typed proposal/result records. A ragged batch of B
sequences with K_i draft tokens each travels flattened: sequence i owns draft rows
``cu_num_draft_tokens[i]:cu_num_draft_tokens[i+1]`` and target rows
``cu_num_draft_tokens[i] + i : cu_num_draft_tokens[i+1] + i + 1`` (K_i + 1 verification positions).
Outputs are padded to [B, max_K + 1] with PLACEHOLDER_TOKEN_ID.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cluster.common.request import SamplingParams

PLACEHOLDER_TOKEN_ID = -1


@dataclass(slots=True)
class SpecBatchMetadata:
    num_draft_tokens: list[int]  # [B] K_i, 0 allowed
    cu_num_draft_tokens: torch.Tensor  # [B + 1] int64, cu[0] = 0
    max_draft_tokens: int

    @classmethod
    def from_num_draft_tokens(cls, num_draft_tokens: list[int]) -> "SpecBatchMetadata":
        if any(k < 0 for k in num_draft_tokens):
            raise ValueError(f"negative draft count in {num_draft_tokens}")
        cu, total = [0], 0
        for k in num_draft_tokens:
            total += k
            cu.append(total)
        return cls(list(num_draft_tokens), torch.tensor(cu, dtype=torch.int64), max(num_draft_tokens, default=0))

    @property
    def batch_size(self) -> int:
        return len(self.num_draft_tokens)

    @property
    def total_draft_tokens(self) -> int:
        return int(self.cu_num_draft_tokens[-1])

    def target_slice(self, i: int) -> slice:
        """Rows of sequence i in the flattened [sum(K_i + 1), V] target logits."""
        start = int(self.cu_num_draft_tokens[i]) + i
        return slice(start, start + self.num_draft_tokens[i] + 1)

    def draft_slice(self, i: int) -> slice:
        return slice(int(self.cu_num_draft_tokens[i]), int(self.cu_num_draft_tokens[i + 1]))


class DraftGrammar(Protocol):
    """A constrained sequence's grammar state along the draft being drafted: a model drafter
    masks its logits with ``allowed()`` [V] bool (so q is the masked distribution) and reports
    each drafted token with ``advance``; once ``alive`` is False (an EOS or illegal token was
    drafted) nothing more is masked. The engine opens it after the step's forced tokens and
    rolls it back after ``propose``."""

    alive: bool

    def allowed(self) -> torch.Tensor: ...

    def advance(self, token: int) -> None: ...


@dataclass(slots=True)
class ProposeInput:
    """One sequence asking its drafter for up to ``num_draft_tokens`` draft tokens.

    token_ids: every committed token (prompt + output) — the proposer may assume its own state
    for this seq_id holds a prefix of it and must roll back or extend to match exactly.
    segment: the request's traffic segment (a drafter that learns from traffic keeps what it
    learns per segment; the others ignore it).
    draft_scope: the request's draft scope (such a drafter drafts it only from what sequences of
    the same segment and scope taught it; "": the shared scope).
    grammar: see ``DraftGrammar`` (model-free drafters ignore it: their drafts are cut by the walk).
    stop_confidence: see the field (model-free drafters ignore it: they size their drafts by their
    matches).
    """

    seq_id: str
    token_ids: list[int]
    num_draft_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None
    segment: str = ""
    draft_scope: str = ""
    # a constrained sequence's grammar along the draft, for drafters that run a model in this
    # process (they draft under its mask); None: unconstrained, or a drafter that cannot use it
    grammar: DraftGrammar | None = None
    # a model drafter stops drafting for this sequence once the product of its draft tokens'
    # probabilities (under the draft's own distribution) falls below this: the token that crosses
    # it is still proposed, the ones after it are not drafted (0: up to num_draft_tokens, always).
    # Lossless either way: a draft only decides how many target positions get verified.
    stop_confidence: float = 0.0


@dataclass(slots=True)
class DraftProposal:
    """Per sequence: the draft tokens (may be fewer than asked, even zero — e.g. n-gram miss)
    and, for sampling drafters, their probabilities q [K_i, V] float32; None means the draft is
    deterministic (one-hot q), as for n-gram or greedy drafting."""

    draft_token_ids: list[list[int]]
    draft_probs: list[torch.Tensor | None]


@dataclass(slots=True)
class RejectionResult:
    output_token_ids: torch.Tensor  # [B, max_K + 1] int64, PLACEHOLDER_TOKEN_ID beyond each row's length
    num_accepted: torch.Tensor  # [B] int64: accepted draft tokens; committed tokens = num_accepted + 1

    def committed(self, i: int) -> list[int]:
        n = int(self.num_accepted[i]) + 1
        return self.output_token_ids[i, :n].tolist()

    def verdicts(self) -> list[tuple[list[int], int]]:
        """Per row (its committed tokens, num_accepted), read back in two transfers."""
        return [(row[: n + 1], n) for row, n in zip(self.output_token_ids.tolist(), self.num_accepted.tolist())]


class DraftUnavailableError(RuntimeError):
    """The drafter cannot answer now (a remote draft server is down or too slow). The engine
    finishes the affected sequences without speculation and retries the drafter later."""
