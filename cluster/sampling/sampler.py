"""Token sampling: greedy, temperature, top-k, top-p, min-p, and seeded (coupled) sampling.

Owns: turning target logits into the filtered scores and probabilities of a request's sampling
parameters (``filtered_logits`` / ``logits_to_probs``, shared with the rejection sampler and the
drafters so that p and q are processed the same way), the per-position Gumbel noise of seeded
requests, and drawing one token per row. Ignores: stop conditions (``Sequence``) and
speculative acceptance (``cluster.speculative.rejection_sampler``).

Seeded requests (``SamplingParams.coupled``) are sampled by Gumbel-max: the token at absolute
position n (its index in prompt + output) is argmax_x(s_n(x) + g_n(x)), where s_n are the
filtered scores (temperature-scaled logits, -inf outside top-k / top-p / min-p) and g_n is i.i.d.
Gumbel(0, 1) noise that depends only on (seed, n). Since argmax(s + g) ~ softmax(s), each token
is exactly distributed as the target's; since g_n does not depend on how the tokens before n
were produced, the output of a seed is the same whichever path (plain, any K, any drafter)
produced it. Unseeded requests draw from the global RNG (``torch.multinomial``).
"""
from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from cluster.common.request import SamplingParams


class NonFiniteScoresError(ValueError):
    """A row's scores or probabilities are NaN / inf: there is nothing sound to sample."""


# dtypes numpy reads in place (bfloat16 is not one of them)
_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


def _numpy_of(t: torch.Tensor) -> np.ndarray | None:
    """The tensor's data as a numpy array, not copied, where numpy can read it (a CPU float tensor
    without autograd, not bfloat16); else None."""
    return t.numpy() if t.device.type == "cpu" and t.dtype in _NUMPY_FLOATS and not t.requires_grad else None


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] int64: each row's first maximal index (NaN counts as maximal), as
    ``torch.argmax(dim=-1)``. A CPU tensor numpy can read goes through numpy's vectorized argmax:
    torch's CPU reduction took ~55 µs per 49k-score row (a verification's 4-7 rows: 0.23-0.27 ms
    of a ~30 ms step), numpy's ~5 µs (2-core VM)."""
    a = _numpy_of(scores)
    return scores.argmax(dim=-1) if a is None else torch.from_numpy(a.argmax(axis=-1).astype(np.int64, copy=False))


def checked_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``argmax_rows`` of logits [N, V] -> [N] int64, raising NonFiniteScoresError as
    ``check_finite`` does. Where numpy reads the scores this is one pass over them: a row is sound
    iff the score at its argmax is finite (NaN and +inf are maximal, and a row of -inf alone has
    -inf there). Right after a forward the scores are no longer in cache, and each pass over a
    verification's K + 1 rows of 49k scores cost ~0.1-0.2 ms (2-core VM)."""
    choice = argmax_rows(logits)
    a = _numpy_of(logits)
    if a is not None and bool(np.isfinite(a[np.arange(a.shape[0]), choice.numpy()]).all()):
        return choice
    check_finite(logits)  # raises with the rows at fault (or passes: a GPU's scores)
    return choice


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Scores of a sampling request. logits: [N, V] (any float dtype) -> [N, V] float32.

    Order: temperature, then top-k, then top-p (nucleus over the temperature-scaled
    distribution), then min-p (a token less likely than ``min_p`` times the most likely one is
    cut; HF's order); filtered tokens get -inf, so softmax of the result is the request's p.
    """
    assert logits.dim() == 2, f"expected [N, V], got {tuple(logits.shape)}"
    scaled = logits.float() / params.temperature
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        sorted_probs, sorted_idx = torch.sort(probs, dim=-1, descending=True)
        cum = sorted_probs.cumsum(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it stays).
        drop_sorted = (cum - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(1, sorted_idx, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        # p_t < min_p · p_max  <=>  s_t < s_max + log(min_p): a ratio, so top-k / top-p's cuts change nothing in it
        top = scaled.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(scaled < top + math.log(params.min_p), float("-inf"))
    return scaled


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities of a request. logits: [N, V] -> [N, V] float32; greedy requests get a
    one-hot distribution on the argmax."""
    assert logits.dim() == 2, f"expected [N, V], got {tuple(logits.shape)}"
    if params.greedy:
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        probs.scatter_(1, argmax_rows(logits).unsqueeze(-1), 1.0)
        return probs
    return torch.softmax(filtered_logits(logits, params), dim=-1)


def check_finite(logits: torch.Tensor) -> None:
    """Raise NonFiniteScoresError unless every row of logits [N, V] has no NaN / +inf and at
    least one finite entry (-inf alone is a mask, not an error)."""
    # the usual case in one reduction: any NaN or ±inf makes the sum non-finite (the checks below
    # took ~0.35 ms over a verification's K + 1 rows of 49k scores); an overflowing sum falls through
    if math.isfinite(float(logits.sum(dtype=torch.float32))):
        return
    bad = torch.isnan(logits).any(dim=-1) | torch.isposinf(logits).any(dim=-1) | torch.isneginf(logits).all(dim=-1)
    if bool(bad.any()):
        raise NonFiniteScoresError(
            f"the model produced non-finite scores (NaN/inf) for {int(bad.sum())} of {logits.shape[0]} rows")


def gumbel_noise(seed: int, position: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[V] float64 i.i.d. Gumbel(0, 1) noise of a seeded request at one absolute position: a pure
    function of (seed, position), so nothing is consumed and any caller (plain sampling,
    verification, a drafter) that asks for the same position gets the same noise. float64
    uniforms keep the Gumbel tail exact far beyond what float32 (max ~16.6) would allow."""
    key = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    g = torch.Generator(device="cpu").manual_seed(int.from_bytes(key, "little") & (2**63 - 1))
    u = torch.rand(vocab, generator=g, dtype=torch.float64)
    return (-torch.log(-torch.log(u))).to(device)


def coupled_tokens(scores: torch.Tensor, seed: int, first_position: int) -> torch.Tensor:
    """Gumbel-max tokens of one seeded sequence at consecutive positions. scores: [N, V]
    (``filtered_logits``) for positions first_position .. first_position + N - 1 -> [N] int64."""
    noise = torch.stack([gumbel_noise(seed, first_position + i, scores.shape[1], scores.device)
                         for i in range(scores.shape[0])])  # [N, V]
    return (scores.double() + noise).argmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row. probs: [N, V] -> [N] int64."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample(
    logits: torch.Tensor,  # [B, V]
    params: list[SamplingParams],
    positions: list[int],  # [B] absolute position of the token each row samples
) -> torch.Tensor:  # [B] int64
    """One token per row: argmax for greedy rows, Gumbel-max with (seed, position) noise for
    seeded rows, a multinomial draw from the global RNG otherwise. Raises
    NonFiniteScoresError when a row has nothing sound to sample (the caller isolates the row)."""
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(positions), (
        f"logits {tuple(logits.shape)} vs {len(params)} params / {len(positions)} positions")
    out = checked_argmax(logits)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        scores = filtered_logits(logits[i : i + 1], p)  # [1, V]
        if p.coupled:
            out[i] = coupled_tokens(scores, p.seed, positions[i])[0]
        else:
            out[i] = sample_from_probs(torch.softmax(scores, dim=-1))[0]
    return out
