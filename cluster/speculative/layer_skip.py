"""Self-speculation by layer skip: the first L layers of the target plus its final norm and LM
head draft the tokens. No extra weights and no extra KV cache.

Why no extra KV: for committed positions, layers < L of the draft compute exactly what the
target's layers < L computed, so the draft reads the target's own cached K/V. Draft passes write
K/V for positions past the committed length without committing them; the verification forward
(all layers, the same K+1 positions) overwrites those slots, so nothing stale survives.
Owns: the round inputs for that scheme. Ignores: acceptance (rejection sampler), K (controller).
"""
from __future__ import annotations

from cluster.models.runner import ModelRunner
from cluster.speculative.drafting import draft_rounds
from cluster.speculative.proposer import DrafterKind
from cluster.speculative.types import DraftProposal, ProposeInput


def default_self_layers(num_layers: int) -> int:
    return max(1, num_layers // 2)


class LayerSkipProposer:
    kind = DrafterKind.SELF

    def __init__(self, runner: ModelRunner, num_layers: int) -> None:
        total = runner.model.arch.num_layers
        if not 1 <= num_layers < total:
            raise ValueError(f"self:L needs 1 <= L < {total} (the target's layers), got {num_layers}")
        self.runner = runner
        self.num_layers = num_layers
        self.vocab_size = runner.vocab_size

    def propose(self, inputs: list[ProposeInput]) -> DraftProposal:
        starts, feeds = [], []
        for inp in inputs:
            cached = self.runner.kv.num_tokens(inp.seq_id)  # target's committed length in KV
            starts.append(cached)
            feeds.append(inp.token_ids[cached:])
        return draft_rounds(
            inputs, starts, feeds,
            lambda chunks: self.runner.forward(chunks, num_layers=self.num_layers, commit=False))

    def release(self, seq_id: str) -> None:
        """Nothing to free: the draft state is the target's own KV."""
