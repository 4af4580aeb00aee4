"""The target's rows as each request's sampling sees them, before a token is chosen from them.

Owns: ``process_rows``, a step's target logits [sum(K_i + 1), V] with each sequence's rows shaped
by its request — repetition penalty, logit bias, presence / frequency penalties and
``min_tokens``' masking of the tokens that end the output (``cluster.sampling.penalties``, row j
counting the first j draft tokens) and then, for a constrained sequence, row j masked by
its grammar state after its first j draft tokens (the draft walk's masks; a sequence without
drafts gets its committed state's mask). The plain step is the case without drafts (one row per
sequence). Rows of a sequence that asks for neither are left as they are, and the input is
returned untouched when no sequence asks (no copy). Ignores: choosing tokens (the sampler, the
rejection sampler), the raw rows log-probabilities are reported from (``cluster.sampling.logprobs``).
"""
from __future__ import annotations

import torch

from cluster.engine.drafts import StepDrafts
from cluster.engine.grammar import apply_masks
from cluster.engine.scheduler import ScheduledSeq
from cluster.sampling.penalties import SeenTokens, penalize


def process_rows(logits: torch.Tensor, seqs: list[ScheduledSeq], drafts: StepDrafts) -> torch.Tensor:
    """logits [sum(K_i + 1), V] of ``seqs`` (in order) -> the same shape, each sequence's rows
    shaped as above."""
    out = logits
    start = 0
    for s in seqs:
        seq = s.seq
        draft = drafts.get(seq.seq_id)
        k = 0 if draft is None else draft.k
        params = seq.request.params
        shape = params.shapes_logits or params.holds_ends(seq.num_output)  # min_tokens: only while it holds
        if shape or seq.grammar is not None:
            if out is logits:
                out = logits.clone()
            rows = out[start : start + k + 1]  # [K_i + 1, V]
            if shape:
                seen = None
                if params.repetition_penalty != 1.0:  # its prompt gathered once, then what each step adds
                    if seq.seen_tokens is None:
                        seq.seen_tokens = SeenTokens()
                    seen = seq.seen_tokens.follow(seq.token_ids)
                rows = penalize(rows, params, seq.output_token_ids, [] if draft is None else draft.token_ids,
                                seq.eos_token_ids, seen)
            if seq.grammar is not None:
                allowed = None if draft is None else draft.allowed  # [K_i + 1, V]
                if allowed is None:
                    allowed = seq.grammar.allowed()[None, :]  # no drafts: [1, V]
                if allowed.shape[0] != k + 1:
                    raise RuntimeError(f"{allowed.shape[0]} grammar masks for {k + 1} verified positions")
                rows = apply_masks(rows, allowed)
            out[start : start + k + 1] = rows
        start += k + 1
    return out
