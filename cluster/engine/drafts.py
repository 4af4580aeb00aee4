"""The drafts of one engine step, carried as one typed object from propose to verify and commit.

Owns: ``SeqDraft`` (one sequence's checked draft: K_i draft token ids, the drafter's q or None,
the tokens its grammar forced, the grammar masks along it) and ``StepDrafts`` (every drafting
sequence of the step, in a dict keyed by sequence id; empty = a plain step), with the views the
verifier needs in batch order. ``Verdict``: what verification (or plain sampling) decides for
one sequence. Ignores: how drafts are asked for and checked (``cluster.engine.speculation``
turns a proposer's ``DraftProposal`` into this) and the ragged-batch metadata of the rejection
sampler (``cluster.speculative.types``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

Verdict = tuple[list[int], int]  # (committed tokens, number of accepted draft tokens)


@dataclass(slots=True, frozen=True)
class SeqDraft:
    """One sequence's draft for this step, already checked against the target (ids inside its
    vocabulary, q finite and non-negative, cut under its grammar)."""

    token_ids: list[int]  # [K_i], K_i >= 1
    probs: torch.Tensor | None = None  # q [K_i, V]; None: deterministic (one-hot q)
    num_forced: int = 0  # leading draft tokens the grammar forced (jump-forward), counted in K_i
    # bool [K_i + 1, V]: a constrained sequence's masks along its draft (checked where they are
    # applied, so that a mismatch fails that sequence's verification alone)
    allowed: torch.Tensor | None = None

    def __post_init__(self) -> None:
        k = len(self.token_ids)
        if k < 1:
            raise ValueError("a draft carries at least one token (no draft: leave the sequence out)")
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != k):
            raise ValueError(f"q has shape {tuple(self.probs.shape)}, expected [{k}, V]")
        if not 0 <= self.num_forced <= k:
            raise ValueError(f"num_forced {self.num_forced} outside [0, {k}]")

    @property
    def k(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class StepDrafts:
    """seq_id -> its ``SeqDraft``, for the sequences that draft this step (K_i >= 1); a sequence
    absent here decodes plainly (K_i = 0). Falsy when nobody drafts: a plain step."""

    by_seq: dict[str, SeqDraft] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.by_seq)

    def get(self, seq_id: str) -> SeqDraft | None:
        return self.by_seq.get(seq_id)

    def token_ids(self, seq_id: str) -> list[int]:
        """Its draft tokens, [] when it does not draft."""
        d = self.by_seq.get(seq_id)
        return [] if d is None else d.token_ids

    def num_draft_tokens(self, seq_ids: list[str]) -> list[int]:
        """[B] K_i of the given sequences (0 for those that do not draft)."""
        return [len(self.token_ids(s)) for s in seq_ids]

    def flat_token_ids(self, seq_ids: list[str]) -> torch.Tensor:
        """[sum K_i] int64: the given sequences' draft tokens, concatenated in order."""
        return torch.tensor([t for s in seq_ids for t in self.token_ids(s)], dtype=torch.int64)

    def probs(self, seq_ids: list[str]) -> list[torch.Tensor | None]:
        """[B] q [K_i, V] or None (deterministic draft, or no draft)."""
        return [d.probs if (d := self.by_seq.get(s)) is not None else None for s in seq_ids]
