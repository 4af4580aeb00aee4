"""Draft-model proposer: an independent model sharing the target's vocabulary, with its own
runner and its own block KV cache (the piece a DraftServer hosts when placement is separate).

Owns: keeping the draft KV in step with the committed tokens it is given (roll back to the
longest common prefix, append the rest), refusing speculation for a sequence when the draft pool
is full, and the optional vocabulary-trimmed LM head (top-N token ids; logits mapped back to full
ids, so greedy and sampling q stay exact distributions over the full vocabulary).
Ignores: verification and K (controller), transport (``cluster.kvsync.client``).
"""
from __future__ import annotations

import torch

from cluster.models.runner import ModelRunner, SeqChunk
from cluster.speculative.drafting import draft_rounds
from cluster.speculative.proposer import DrafterKind
from cluster.speculative.types import DraftProposal, ProposeInput


class TrimmedHead:
    """Restricts a Llama model's LM head to ``keep_ids`` (BPE ids are merge-ranked, so the lowest
    ids are the most frequent; any id list works). Logits of dropped ids are -inf."""

    def __init__(self, runner: ModelRunner, keep_ids: torch.Tensor) -> None:
        model = runner.model
        vocab = runner.vocab_size
        keep = torch.unique(keep_ids.to(torch.int64))
        if keep.numel() == 0 or int(keep.max()) >= vocab or int(keep.min()) < 0:
            raise ValueError(f"trimmed vocabulary ids must lie in [0, {vocab})")
        self.keep = keep  # [Vk]
        self.vocab = vocab
        model.lm_head = model.lm_head.select_outputs(keep)  # [hidden, Vk]

    def expand(self, logits: torch.Tensor) -> torch.Tensor:  # [N, Vk] -> [N, V]
        full = logits.new_full((logits.shape[0], self.vocab), float("-inf"))
        full[:, self.keep] = logits
        return full


def frequent_ids(tokenizer, n: int) -> torch.Tensor:
    """The n lowest BPE ids (most frequent merges) plus every special / added token."""
    special = [int(i) for i in getattr(tokenizer, "all_special_ids", [])]
    ids = torch.arange(min(n, len(tokenizer)))
    return torch.cat([ids, torch.tensor(special, dtype=torch.int64)]) if special else ids


class DraftModelProposer:
    kind = DrafterKind.DRAFT_MODEL

    def __init__(self, runner: ModelRunner, trimmed: TrimmedHead | None = None) -> None:
        self.runner = runner
        self.trimmed = trimmed
        self.vocab_size = runner.vocab_size
        self._held: dict[str, list[int]] = {}  # tokens whose K/V the draft holds, per sequence

    def propose(self, inputs: list[ProposeInput]) -> DraftProposal:
        starts, feeds, ok = [], [], []
        kv = self.runner.kv
        for inp in inputs:
            held = self._held.get(inp.seq_id, [])
            common = _common_prefix(held, inp.token_ids)
            common = min(common, len(inp.token_ids) - 1)  # always feed >= 1 token to get logits
            kv.truncate(inp.seq_id, common)
            need = len(inp.token_ids) + inp.num_draft_tokens
            fits = kv.can_reserve(inp.seq_id, need)
            if not fits:  # draft pool full: this sequence goes without speculation this step
                self.release(inp.seq_id)
                common = 0
            ok.append(fits)
            starts.append(common)
            feeds.append(inp.token_ids[common:] if fits else [])
            self._held[inp.seq_id] = list(inp.token_ids[:common])
        proposal = draft_rounds(inputs, starts, feeds, self._forward)
        for inp, fits, drafted in zip(inputs, ok, proposal.draft_token_ids):
            if fits and drafted:  # the draft fed every known token and all but the last draft
                self._held[inp.seq_id] = list(inp.token_ids) + drafted[:-1]
        return proposal

    def _forward(self, chunks: list[SeqChunk]) -> torch.Tensor:  # [N, V]
        logits = self.runner.forward(chunks)
        return self.trimmed.expand(logits) if self.trimmed is not None else logits

    def release(self, seq_id: str) -> None:
        self._held.pop(seq_id, None)
        self.runner.free(seq_id)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
