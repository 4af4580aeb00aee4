"""Model drafting rounds (``cluster.speculative.drafting``) with a scripted forward: a sequence
with a ``DraftGrammar`` drafts under its mask (greedy picks the best legal token, a sampled q is
the masked distribution), reports every drafted token to it, and stops masking once it is dead;
a sequence without one drafts as before."""
from __future__ import annotations

import torch

from cluster.common.request import SamplingParams
from cluster.speculative.drafting import draft_rounds, masked
from cluster.speculative.types import ProposeInput

V = 6


class Parity:
    """A toy grammar: only tokens of the parity of the step (even first); token 5 kills it."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.alive = True

    def allowed(self) -> torch.Tensor:  # [V] bool
        parity = len(self.seen) % 2
        return torch.tensor([t % 2 == parity for t in range(V)])

    def advance(self, token: int) -> None:
        self.seen.append(token)
        if token == 5:
            self.alive = False


def forward_preferring(token: int):
    """Every row's logits favour ``token``, then lower ids."""
    def forward(chunks):
        logits = torch.arange(V, 0, -1, dtype=torch.float32).repeat(len(chunks), 1)  # [N, V]
        logits[:, token] = 100.0
        return logits
    return forward


def inp(seq_id: str, k: int, params: SamplingParams, grammar=None) -> ProposeInput:
    return ProposeInput(seq_id, [1, 2, 3], k, params, grammar=grammar)


def test_greedy_drafts_the_best_legal_token_and_reports_each_one():
    g = Parity()
    out = draft_rounds([inp("a", 3, SamplingParams(max_tokens=8), g), inp("b", 3, SamplingParams(max_tokens=8))],
                       [0, 0], [[1, 2, 3], [1, 2, 3]], forward_preferring(3))
    assert out.draft_token_ids[0] == [0, 3, 0]  # even: 0 (3 is odd), then odd: 3, then even: 0
    assert g.seen == [0, 3, 0]
    assert out.draft_token_ids[1] == [3, 3, 3]  # unconstrained: the argmax every round
    assert out.draft_probs == [None, None]


def test_sampled_q_is_the_masked_distribution():
    g = Parity()
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=8, temperature=1.0)
    i = ProposeInput("a", [1, 2, 3], 2, params, generator=gen, grammar=g)
    out = draft_rounds([i], [0], [[1, 2, 3]], forward_preferring(3))
    q = out.draft_probs[0]  # [2, V]
    assert q.shape == (2, V)
    assert torch.all(q[0][1::2] == 0) and torch.all(q[1][0::2] == 0)  # odd ids, then even ids masked
    assert torch.allclose(q.sum(1), torch.ones(2))
    assert out.draft_token_ids[0][0] % 2 == 0 and out.draft_token_ids[0][1] % 2 == 1


def test_a_dead_grammar_masks_nothing_more():
    g = Parity()
    out = draft_rounds([inp("a", 3, SamplingParams(max_tokens=8), g)], [0], [[1, 2, 3]], forward_preferring(5))
    # even first: 0; odd: 5 (legal, kills the toy grammar); then unmasked: 5 again
    assert out.draft_token_ids[0] == [0, 5, 5] and not g.alive and g.seen == [0, 5, 5]


def test_masked_pads_or_cuts_the_mask_to_the_draft_vocabulary():
    allowed = torch.tensor([True, False, True])
    wide = masked(torch.zeros(1, 4), allowed)
    assert torch.isinf(wide[0, 1]) and torch.isinf(wide[0, 3]) and wide[0, 0] == 0 and wide[0, 2] == 0
    narrow = masked(torch.zeros(1, 2), allowed)
    assert narrow.shape == (1, 2) and torch.isinf(narrow[0, 1]) and narrow[0, 0] == 0


def forward_with_confidence(probs_by_round: list[float]):
    """Round r's logits give token 2 probability probs_by_round[r] (the rest share what is left)."""
    calls = []

    def forward(chunks):
        p = probs_by_round[len(calls)]
        calls.append(len(chunks))
        rest = (1.0 - p) / (V - 1)
        row = torch.full((V,), rest).log()
        row[2] = torch.tensor(p).log()
        return row.repeat(len(chunks), 1)  # [N, V]
    return forward, calls


def test_a_sequence_stops_once_its_draft_confidence_falls_below_stop_confidence():
    greedy = SamplingParams(max_tokens=8)
    # confidences 0.9, 0.5, 0.9, 0.9: the product 0.9, 0.45, 0.405, 0.36
    for stop, drafted in ((0.0, 4), (0.36, 4), (0.4, 4), (0.42, 3), (0.5, 2), (0.95, 1)):
        forward, calls = forward_with_confidence([0.9, 0.5, 0.9, 0.9])
        i = ProposeInput("a", [1, 2, 3], 4, greedy, stop_confidence=stop)
        out = draft_rounds([i], [0], [[1, 2, 3]], forward)
        assert out.draft_token_ids[0] == [2] * drafted, stop  # the token that crosses it is still proposed
        assert len(calls) == drafted  # and no round runs after it
    # sampled: the sampled token's q counts; a sequence without a floor in the same batch drafts K
    forward, calls = forward_with_confidence([0.9, 0.5, 0.9, 0.9])
    sampled = SamplingParams(max_tokens=8, temperature=1.0, top_k=1)  # top_k 1: q puts all on token 2
    a = ProposeInput("a", [1, 2, 3], 4, greedy, stop_confidence=0.5)
    b = ProposeInput("b", [1, 2, 3], 4, sampled, generator=torch.Generator().manual_seed(0), stop_confidence=0.5)
    c = ProposeInput("c", [1, 2, 3], 4, greedy)
    out = draft_rounds([a, b, c], [0, 0, 0], [[1, 2, 3]] * 3, forward)
    assert [len(t) for t in out.draft_token_ids] == [2, 4, 4]  # b's q(2) = 1 under top_k 1
    assert calls == [3, 3, 2, 2]
    assert out.draft_probs[0] is None and out.draft_probs[1].shape == (4, V)
