"""Sampler: greedy, temperature, top-k, top-p masks, tiny temperatures, seeded (Gumbel-max)
sampling that is reproducible per (seed, position) and keeps the target distribution, and
request validation."""
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from cluster.common.errors import InvalidRequestError
from cluster.common.request import GREEDY_TEMPERATURE_EPS, SamplingParams
from cluster.sampling.sampler import NonFiniteScoresError, argmax_rows, filtered_logits, gumbel_noise, logits_to_probs, sample


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    probs = logits_to_probs(logits, SamplingParams())
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert sample(logits, [SamplingParams()], [0]).tolist() == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_argmax_rows_is_torch_argmax_ties_masks_and_nan_included(dtype):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(7, 49152, generator=g).to(dtype)
    scores[1, 100] = scores[1, 200] = scores[1].max() + 1  # a tie: the first index wins
    scores[2] = float("-inf")  # a fully masked row
    scores[2, 4097] = 0.0
    scores[3, 5] = float("nan")  # NaN counts as maximal, as in torch
    for x in (scores, scores[:, ::2], scores.t().contiguous().t(), scores[2:5]):  # strided and sliced views
        got = argmax_rows(x)
        assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
        assert got.tolist() == x.argmax(dim=-1).tolist()
    assert argmax_rows(scores)[1:4].tolist() == [100, 4097, 5]
    with torch.inference_mode():
        assert argmax_rows(scores.clone()).tolist() == scores.argmax(dim=-1).tolist()


def test_top_k_and_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    pk = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(pk, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # top_p=0.8: 0.5 (<0.8) and 0.3 (crosses 0.8) stay
    pp = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(pp, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    pp2 = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert (pp2[0, :3] > 0).all() and pp2[0, 3] == 0


def test_min_p_cuts_what_hf_min_p_cuts():
    """min-p after temperature, top-k and top-p, against HF's own ``MinPLogitsWarper`` (HF's
    order: temperature, top-k, top-p, min-p)."""
    from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper, TopPLogitsWarper

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    pm = logits_to_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))  # 0.05 < 0.2 * 0.5: cut
    torch.testing.assert_close(pm, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    assert torch.equal(logits_to_probs(logits, SamplingParams(temperature=1.0, min_p=1.0)), torch.tensor([[1.0, 0, 0, 0]]))
    g = torch.Generator().manual_seed(5)
    for min_p, temperature, top_p in ((0.05, 1.0, 1.0), (0.1, 0.7, 1.0), (0.3, 1.3, 0.9), (0.02, 0.5, 0.95)):
        scores = torch.randn(6, 300, generator=g) * 3
        ours = filtered_logits(scores, SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p))
        hf = TemperatureLogitsWarper(temperature)(None, scores.clone())
        if top_p < 1.0:
            hf = TopPLogitsWarper(top_p)(None, hf)
        hf = MinPLogitsWarper(min_p)(None, hf)
        assert torch.equal(torch.isinf(ours), torch.isinf(hf)), (min_p, temperature, top_p)
        assert 0 < int(torch.isinf(ours).sum()) < ours.numel()  # it cuts, and leaves tokens


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]])
    hot = logits_to_probs(logits, SamplingParams(temperature=2.0))[0, 0]
    cold = logits_to_probs(logits, SamplingParams(temperature=0.5))[0, 0]
    assert cold > hot > 0.5


def test_seed_reproducible_per_position_and_distinct():
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0, seed=7)
    a = [int(sample(logits, [p], [n])[0]) for n in range(20)]
    torch.manual_seed(123)  # the global RNG plays no part
    b = [int(sample(logits, [p], [n])[0]) for n in range(20)]
    assert a == b and len(set(a)) > 10
    # The token at a position does not depend on what was sampled before it (no stream).
    assert [int(sample(logits, [p], [n])[0]) for n in reversed(range(20))] == a[::-1]
    q = SamplingParams(temperature=1.0, seed=8)
    assert [int(sample(logits, [q], [n])[0]) for n in range(20)] != a
    assert torch.equal(gumbel_noise(7, 3, 50), gumbel_noise(7, 3, 50))
    assert not torch.equal(gumbel_noise(7, 3, 50), gumbel_noise(7, 4, 50))


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=5, top_p=0.85),
                                    SamplingParams(temperature=0.8, min_p=0.2)])
def test_seeded_sampling_over_many_seeds_keeps_the_distribution(params):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 8, generator=g) * 0.8
    p = logits_to_probs(logits, params)[0].double().numpy()
    p = p / p.sum()
    n = 6000
    tokens = np.array([int(sample(logits, [SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                                          top_p=params.top_p, min_p=params.min_p, seed=s)], [5])[0])
                       for s in range(n)])
    counts = np.bincount(tokens, minlength=8).astype(float)
    support = p > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support], p[support] * n).pvalue > 1e-3


@pytest.mark.parametrize("temperature", [1e-44, 1e-30, 1e-6, GREEDY_TEMPERATURE_EPS / 2])
def test_tiny_temperatures_act_as_greedy_in_a_mixed_batch(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=g) * 30  # large logits: logits / 1e-44 overflows float32
    params = [SamplingParams(temperature=temperature), SamplingParams(temperature=temperature, seed=3),
              SamplingParams(temperature=1.0, seed=4), SamplingParams()]
    assert all(p.greedy for p in params[:2])
    out = sample(logits, params, [0] * 4)
    assert out[[0, 1, 3]].tolist() == logits[[0, 1, 3]].argmax(-1).tolist()
    assert int(out[2]) == int(sample(logits[2:3], params[2:3], [0])[0])  # the neighbour is unaffected
    assert logits_to_probs(logits[:1], params[0]).isfinite().all()


def test_non_finite_logits_raise_a_clear_error():
    logits = torch.zeros(3, 10)
    logits[1, 4] = float("nan")
    with pytest.raises(NonFiniteScoresError, match="non-finite"):
        sample(logits, [SamplingParams()] * 3, [0] * 3)
    logits[1] = float("-inf")  # a fully masked row has nothing to sample either
    with pytest.raises(NonFiniteScoresError):
        sample(logits, [SamplingParams(temperature=1.0)] * 3, [0] * 3)


def test_the_finite_check_passes_masks_and_huge_finite_scores_and_catches_each_bad_row():
    """check_finite's one-reduction fast path (the sum) falls back to the row checks whenever the
    sum is not finite: a -inf mask, or finite scores whose sum overflows, pass; +inf, NaN or a
    fully masked row anywhere raise."""
    from cluster.sampling.sampler import check_finite

    check_finite(torch.randn(7, 49152))
    masked = torch.randn(4, 10)
    masked[:, :5] = float("-inf")  # a grammar's mask
    check_finite(masked)
    check_finite(torch.full((3, 10), 3e38))  # every score finite; their sum overflows
    for bad in (float("nan"), float("inf")):
        x = torch.randn(5, 10)
        x[3, 7] = bad
        with pytest.raises(NonFiniteScoresError, match="1 of 5 rows"):
            check_finite(x)
    x = torch.randn(5, 10)
    x[2] = float("-inf")
    with pytest.raises(NonFiniteScoresError, match="1 of 5 rows"):
        check_finite(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # numpy's one pass; torch's sum
def test_checked_argmax_is_the_argmax_and_refuses_exactly_what_the_finite_check_refuses(dtype):
    from cluster.sampling.sampler import check_finite, checked_argmax

    masked = torch.randn(4, 10)
    masked[:, :5] = float("-inf")
    for ok in (torch.randn(7, 49152), masked, torch.full((3, 10), 3e38)):
        ok = ok.to(dtype)
        check_finite(ok)
        assert checked_argmax(ok).tolist() == ok.argmax(dim=-1).tolist()
    for row, col, bad in ((3, 7, float("nan")), (3, 0, float("inf")), (0, 9, float("nan")), (2, None, float("-inf"))):
        x = torch.randn(5, 10)
        if col is None:
            x[row] = bad  # a fully masked row
        else:
            x[row, col] = bad
        x = x.to(dtype)
        with pytest.raises(NonFiniteScoresError, match="1 of 5 rows"):
            check_finite(x)
        with pytest.raises(NonFiniteScoresError, match="1 of 5 rows"):
            checked_argmax(x)


@pytest.mark.parametrize("kw,msg", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"), ({"temperature": -math.inf}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": math.nan}, "top_p"), ({"top_p": math.inf}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"stop": ("",)}, "stop"),
    ({"seed": 1.5}, "seed"), ({"stop_token_ids": ("x",)}, "stop_token_ids"),
    ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"), ({"min_p": 1.01}, "min_p"), ({"min_p": math.nan}, "min_p"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \(0, 10\]"), ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"repetition_penalty": 10.5}, "repetition_penalty"), ({"repetition_penalty": math.inf}, "repetition_penalty"),
])
def test_bad_params_raise_clear_errors(kw, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        SamplingParams(**kw)
