"""Shared mechanics of model-based drafters (draft model and layer skip): K autoregressive
rounds batched over all speculating sequences, drawing each draft token from q.

Owns: the round loop (round 0 feeds each sequence's not-yet-drafted tokens, round i feeds draft
token i), per-sequence drop-out when its K is reached or when its draft confidence falls below
``ProposeInput.stop_confidence`` (the product of its draft tokens' probabilities under the draft's
own distribution: a trained head's is calibrated — on chat, a first draft token the head gives
0.1-0.2 is accepted ~29% of the time, one it gives > 0.9 ~100% — so drafting stops where the next
token would cost more than it is expected to commit), and how each draft token is chosen:
- greedy requests: the draft argmax (draft_probs None);
- seeded requests: Gumbel-max over the draft's filtered scores with the request's own
  (seed, position) noise (draft_probs None). Verification of a seeded request accepts a draft
  token iff it equals the target's Gumbel-max token at that position, so drafting with the same
  noise makes draft and target agree whenever their argmax under the noise does (far more often
  than an independent draw, which agrees with probability sum_x p(x) q(x)). The noise is a pure
  function of (seed, position): drafting consumes nothing the verification draws from, and the
  output does not depend on the drafts at all (``cluster.sampling.sampler``);
- other sampling requests: a draw from q = ``logits_to_probs`` under the request's sampling
  params (so p and q are processed the same way) with the input's generator (None: global RNG).
A constrained sequence (``ProposeInput.grammar``) drafts under its grammar's mask: the draft's
logits are masked before choosing, so q is the masked distribution and the draft stays legal
(rejection sampling is exact for any q; a legal draft is simply accepted more often).
Ignores: where K/V live (the caller's ``forward`` closure).
"""
from __future__ import annotations

from typing import Callable

import torch

from cluster.models.runner import SeqChunk
from cluster.sampling.sampler import argmax_rows, coupled_tokens, filtered_logits, logits_to_probs, sample_from_probs
from cluster.speculative.types import DraftProposal, ProposeInput

# forward(chunks) -> logits [len(chunks), V] for the last position of each chunk
ForwardFn = Callable[[list[SeqChunk]], torch.Tensor]


def masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [1, W] with -inf where the grammar's allowed [V] bool is False (a draft vocabulary
    wider than the target's: the extra ids are masked; a narrower one: the mask is cut)."""
    w = logits.shape[-1]
    if allowed.shape[0] < w:
        allowed = torch.cat([allowed, allowed.new_zeros(w - allowed.shape[0])])
    return logits.masked_fill(~allowed[:w].to(logits.device), float("-inf"))


def draft_rounds(inputs: list[ProposeInput], starts: list[int], feeds: list[list[int]],
                 forward: ForwardFn) -> DraftProposal:
    """starts[i]: position of feeds[i][0]; feeds[i]: tokens the drafter has not processed yet."""
    n = len(inputs)
    tokens: list[list[int]] = [[] for _ in range(n)]
    probs: list[list[torch.Tensor]] = [[] for _ in range(n)]
    pos = list(starts)
    feed = [list(f) for f in feeds]
    confidence = [1.0] * n  # product of each sequence's draft tokens' probabilities so far
    active = [i for i in range(n) if inputs[i].num_draft_tokens > 0 and feed[i]]
    while active:
        chunks = [SeqChunk(inputs[i].seq_id, feed[i], pos[i], 1) for i in active]
        logits = forward(chunks)  # [len(active), V]
        still = []
        for row, i in enumerate(active):
            p = inputs[i].params
            grammar = inputs[i].grammar
            row_logits = logits[row : row + 1]  # [1, V]
            if grammar is not None and grammar.alive:
                under = masked(row_logits, grammar.allowed())
                if float(under.max()) > float("-inf"):  # else (a trimmed head misses every legal id): unmasked
                    row_logits = under
            q = None  # [1, V] the draft's distribution, where the choice needed it
            if p.greedy:
                t = int(argmax_rows(row_logits)[0])
            elif p.coupled:  # draft token for absolute position len(token_ids) + drafted so far
                position = len(inputs[i].token_ids) + len(tokens[i])
                t = int(coupled_tokens(filtered_logits(row_logits, p), p.seed, position)[0])
            else:
                q = logits_to_probs(row_logits, p)  # [1, V]
                t = int(sample_from_probs(q, inputs[i].generator)[0])
                probs[i].append(q[0])
            if grammar is not None:
                grammar.advance(t)
            tokens[i].append(t)
            pos[i] += len(feed[i])
            feed[i] = [t]
            stop = inputs[i].stop_confidence
            if stop > 0:
                q = torch.softmax(row_logits.float(), dim=-1) if q is None else q  # greedy, seeded: at temperature 1
                confidence[i] *= float(q[0, t])
            if len(tokens[i]) < inputs[i].num_draft_tokens and not (stop > 0 and confidence[i] < stop):
                still.append(i)
        active = still
    return DraftProposal(
        draft_token_ids=tokens,
        draft_probs=[torch.stack(pr) if pr else None for pr in probs],  # [K_i, V] or None
    )
