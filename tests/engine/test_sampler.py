"""Sampler: greedy, temperature, top-k, top-p masks, seeded reproducibility."""
import pytest
import torch

from cluster.engine.request import InvalidRequestError, SamplingParams
from cluster.engine.sampler import logits_to_probs, make_generator, sample


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    probs = logits_to_probs(logits, SamplingParams())
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert sample(logits, [SamplingParams()], [None]).tolist() == [1]


def test_top_k_and_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    pk = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(pk, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # top_p=0.8: 0.5 (<0.8) and 0.3 (crosses 0.8) stay
    pp = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(pp, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    pp2 = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert (pp2[0, :3] > 0).all() and pp2[0, 3] == 0


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0]])
    hot = logits_to_probs(logits, SamplingParams(temperature=2.0))[0, 0]
    cold = logits_to_probs(logits, SamplingParams(temperature=0.5))[0, 0]
    assert cold > hot > 0.5


def test_seed_reproducible_and_distinct():
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0, seed=7)
    a = [int(sample(logits, [p], [g])[0]) for g in [make_generator(p)] for _ in range(20)]
    g2 = make_generator(p)
    b = [int(sample(logits, [p], [g2])[0]) for _ in range(20)]
    assert a == b and len(set(a)) > 10
    q = SamplingParams(temperature=1.0, seed=8)
    g3 = make_generator(q)
    assert [int(sample(logits, [q], [g3])[0]) for _ in range(20)] != a


@pytest.mark.parametrize("kw,msg", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"stop": ("",)}, "stop"),
])
def test_bad_params_raise_clear_errors(kw, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        SamplingParams(**kw)
