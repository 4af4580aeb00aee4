"""Log-probabilities of output tokens: what a request with ``SamplingParams.logprobs`` gets back
(and, from its prefill's rows, a prompt's with ``SamplingParams.prompt_logprobs``).

Owns: turning the target rows that chose a sequence's committed tokens into each token's
log-probability and the n most likely tokens at its position. The distribution is the target's raw
one — log-softmax of its logits at temperature 1, before logit bias, penalties, temperature,
top-k, top-p or a grammar's mask — the same whichever path (plain, speculative at any K, any drafter) committed the token:
a speculative step's row j is the target's row after the committed tokens and drafts 0..j-1,
which are exactly the tokens before committed token j. Ignores: choosing tokens
(``cluster.sampling.sampler``), token bytes (the service, next to the tokenizer).
"""
from __future__ import annotations

import math

import torch

from cluster.common.request import Logprob, TokenLogprobs

_BLOCK_ROWS = 256  # rows log-softmaxed at once ([256, V] float32: 50 MB at V = 49152)


def token_logprobs(
    logits: torch.Tensor,  # [N, V] the target rows that chose tokens[0..N-1]
    tokens: list[int],  # [N] the committed tokens
    num_top: int,  # alternatives per token, 0..MAX_LOGPROBS
) -> list[TokenLogprobs]:  # [N]
    """Each committed token's log-probability under its row's raw distribution, and the row's
    ``num_top`` most likely tokens, most likely first. Raises ValueError on a non-finite row
    (there is no sound log-probability to report; the engine fails that sequence alone)."""
    assert logits.dim() == 2 and logits.shape[0] == len(tokens), (
        f"logits {tuple(logits.shape)} for {len(tokens)} tokens")
    if not tokens:
        return []
    if len(tokens) > _BLOCK_ROWS:  # a prompt's rows: a block at a time, so the log-softmax copy stays small
        return [entry for i in range(0, len(tokens), _BLOCK_ROWS)
                for entry in token_logprobs(logits[i : i + _BLOCK_ROWS], tokens[i : i + _BLOCK_ROWS], num_top)]
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    chosen = logp.gather(1, torch.tensor(tokens, dtype=torch.int64, device=logp.device)[:, None])[:, 0]  # [N]
    top_vals = top_ids = None
    if num_top > 0:
        top_vals, top_ids = torch.topk(logp, min(num_top, logp.shape[1]), dim=-1)  # [N, n]
        top_vals, top_ids = top_vals.cpu().tolist(), top_ids.cpu().tolist()
    chosen = chosen.cpu().tolist()
    out = []
    for i, t in enumerate(tokens):
        if not math.isfinite(chosen[i]):
            raise ValueError(f"the target's log-probability of token {t} is not finite ({chosen[i]})")
        top = () if top_ids is None else tuple(Logprob(int(j), float(v)) for j, v in zip(top_ids[i], top_vals[i]))
        out.append(TokenLogprobs(Logprob(int(t), float(chosen[i])), top))
    return out
