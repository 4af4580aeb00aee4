"""Predicted outputs: where the output stands in the prediction, the drafts, K, the overlap — no model."""
import numpy as np
import pytest

from cluster.speculative.adaptive_k import StepCostModel
from cluster.speculative.prediction import PREDICTION, PredictedOutputs, prediction_overlap, realign

PROMPT = [900, 901, 902]


def arr(xs):
    return np.asarray(xs, dtype=np.int64)


def test_realign_takes_the_longest_suffix_and_the_occurrence_after_where_it_was():
    pred = arr([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3, 8])
    # "2 3" occurs three times; "1 2 3" twice: the longer match wins, the first at/after `after`
    assert realign(pred, arr([4, 1, 2, 3]), after=0) == 3
    assert realign(pred, arr([4, 1, 2, 3]), after=5) == 7
    assert realign(pred, arr([4, 1, 2, 3]), after=9) == 7  # none after: the last one before
    assert realign(pred, arr([5, 2, 3]), after=0) == 11  # "5 2 3" only once
    assert realign(pred, arr([6, 6]), after=0) is None  # nothing matches
    assert realign(pred, arr([4, 3]), after=0) is None  # a 1-token match is not enough past one token
    assert realign(pred, arr([7]), after=0) == 8  # ... but is where the output has one token
    assert realign(pred, arr([1, 8]), after=0) is None  # "8" ends the prediction: nothing to draft after it
    assert realign(arr([5]), arr([5]), after=0) is None


def test_drafts_follow_the_output_lose_it_and_find_it_again():
    p = PredictedOutputs()
    pred = (10, 11, 12, 13, 14, 15, 16, 17)
    seq = list(PROMPT)
    assert p.draft("s", pred, len(PROMPT), seq, 3, None) == [10, 11, 12]  # aligned at the start
    seq += [10, 11]  # two of three kept, then the target's own token
    seq += [99]
    assert p.draft("s", pred, len(PROMPT), seq, 3, None) == []  # lost: "11 99" is nowhere in it
    seq += [13, 14]  # the output rejoins the prediction
    assert p.draft("s", pred, len(PROMPT), seq, 3, None) == [15, 16, 17]
    seq += [15, 16, 17]
    assert p.draft("s", pred, len(PROMPT), seq, 3, None) == []  # used up
    p.release("s")
    assert len(p) == 0


def test_an_insertion_in_the_output_resumes_after_it():
    """An edit that adds a line: the draft resumes where the output rejoins the original."""
    p = PredictedOutputs()
    pred = tuple(range(20, 40))
    seq = list(PROMPT) + list(range(20, 25)) + [7, 8, 9] + [25, 26]
    assert p.draft("s", pred, len(PROMPT), seq, 4, None) == [27, 28, 29, 30]


def test_k_follows_the_predictions_acceptance_at_the_engines_costs():
    costs = StepCostModel(target_a_prior=0.02, slope_prior_ratio=1 / 8, draft_cost_ratio_priors={PREDICTION: 0.0})
    p = PredictedOutputs()
    pred = tuple(range(100, 200))
    seq = list(PROMPT)
    first = p.draft("s", pred, len(PROMPT), seq, 16, costs)
    assert 2 <= len(first) <= 16 and first == list(range(100, 100 + len(first)))  # the prior: the client is right
    for _ in range(20):  # every draft rejected at its first token
        p.observe("s", 4, 0)
    assert p.alpha("s") < 0.2
    assert p.draft("s", pred, len(PROMPT), seq, 16, costs) == []  # not worth a verification slot
    q = PredictedOutputs()
    q.draft("t", pred, len(PROMPT), seq, 16, costs)
    for _ in range(20):
        q.observe("t", 4, 4)
    assert len(q.draft("t", pred, len(PROMPT), seq, 16, costs)) >= len(first)  # a right one drafts long
    assert q.alpha("t") > 0.95 and p.alpha("unknown") is None


@pytest.mark.parametrize("pred,out,kept", [
    ([1, 2, 3, 4], [1, 2, 3, 4], 4),
    ([1, 2, 3, 4], [1, 2, 9, 3, 4], 4),  # an insertion keeps every predicted token
    ([1, 2, 3, 4], [1, 3], 2),
    ([1, 2, 3, 4], [], 0),
    ([], [1], 0),
    ([5, 5, 5], [5, 5, 5, 5, 5], 3),
])
def test_prediction_overlap_counts_the_predicted_tokens_the_output_kept_in_order(pred, out, kept):
    assert prediction_overlap(pred, out) == kept
