"""The step's drafts: one SeqDraft per drafting sequence, views in batch order for verification."""
from __future__ import annotations

import pytest
import torch

from cluster.engine.drafts import SeqDraft, StepDrafts


def test_views_in_batch_order_with_non_drafting_sequences():
    q = torch.full((2, 5), 0.2)  # [K=2, V=5]
    drafts = StepDrafts({"a": SeqDraft([3, 4], q), "c": SeqDraft([1], num_forced=1)})
    order = ["a", "b", "c"]  # b decodes plainly this step
    assert drafts and not StepDrafts()
    assert drafts.num_draft_tokens(order) == [2, 0, 1]
    assert drafts.flat_token_ids(order).tolist() == [3, 4, 1]
    assert drafts.flat_token_ids(order).dtype == torch.int64
    probs = drafts.probs(order)
    assert probs[0] is q and probs[1] is None and probs[2] is None
    assert drafts.token_ids("b") == [] and drafts.get("b") is None
    assert drafts.get("a").k == 2 and drafts.get("c").num_forced == 1


def test_a_draft_is_refused_when_its_shapes_disagree():
    with pytest.raises(ValueError):
        SeqDraft([])  # no draft: the sequence is left out instead
    with pytest.raises(ValueError):
        SeqDraft([1, 2], torch.zeros(3, 5))  # q rows != K
    with pytest.raises(ValueError):
        SeqDraft([1], num_forced=2)
