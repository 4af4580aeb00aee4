"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

Owns: turning target logits into probabilities under a request's sampling parameters
(``logits_to_probs``, shared with the rejection sampler and draft proposers so that p and q are
processed the same way) and drawing one token per row. Ignores: stop conditions (scheduler) and
speculative acceptance (``cluster.spec.rejection_sampler``).
"""
from __future__ import annotations

import torch

from cluster.engine.request import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A per-request CPU generator when the request is seeded; None uses the global RNG."""
    if params.seed is None:
        return None
    g = torch.Generator(device="cpu")
    g.manual_seed(int(params.seed))
    return g


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities of a sampling request. logits: [N, V] (any float dtype) -> [N, V] float32.

    Order: temperature, then top-k, then top-p (nucleus over the temperature-scaled
    distribution). Greedy requests get a one-hot distribution on the argmax.
    """
    assert logits.dim() == 2, f"expected [N, V], got {tuple(logits.shape)}"
    logits = logits.float()
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return probs
    scaled = logits / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, sorted_idx = torch.sort(probs, dim=-1, descending=True)
        cum = sorted_probs.cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it stays).
        drop_sorted = (cum - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(1, sorted_idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row. probs: [N, V] -> [N] int64."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample(
    logits: torch.Tensor,  # [B, V]
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:  # [B] int64
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators), (
        f"logits {tuple(logits.shape)} vs {len(params)} params / {len(generators)} generators")
    out = logits.argmax(dim=-1)
    for i, p in enumerate(params):
        if not p.greedy:
            probs = logits_to_probs(logits[i : i + 1], p)
            out[i] = sample_from_probs(probs, generators[i])[0]
    return out
