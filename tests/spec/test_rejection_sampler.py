"""Rejection sampler: literal acceptance tables, ragged batches, validation, determinism, and
statistical proof that sampling keeps the target distribution (arXiv 2211.17192, Theorem 1)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from cluster.engine.request import SamplingParams
from cluster.engine.sampler import logits_to_probs
from cluster.spec.rejection_sampler import rejection_sample
from cluster.spec.types import PLACEHOLDER_TOKEN_ID as PH
from cluster.spec.types import SpecBatchMetadata

torch.set_num_threads(1)

V = 6
GREEDY = SamplingParams(temperature=0.0)
SAMPLE = SamplingParams(temperature=1.0)
ALPHA = 1e-3  # chi-square significance: a correct sampler fails ~1 run in 1000 (seeds are fixed)


def peaked_logits(token_ids: list[int], vocab: int = V) -> torch.Tensor:
    """[len, V] logits whose softmax puts all float32 mass on the given tokens (exp(-1e4) == 0)."""
    logits = torch.full((len(token_ids), vocab), -1e4)
    logits[torch.arange(len(token_ids)), torch.tensor(token_ids)] = 0.0
    return logits


def run(seqs, params=None, generators=None, draft_probs=None, vocab: int = V):
    """seqs: list of (target argmax per position [K+1], drafts [K]) -> (output list, accepted list)."""
    meta = SpecBatchMetadata.from_counts([len(d) for _, d in seqs])
    logits = torch.cat([peaked_logits(t, vocab) for t, _ in seqs])
    drafts = torch.tensor([x for _, d in seqs for x in d], dtype=torch.int64)
    b = len(seqs)
    res = rejection_sample(logits, drafts, draft_probs or [None] * b, meta,
                           params or [GREEDY] * b, generators or [None] * b)
    return res.output_token_ids.tolist(), res.num_accepted.tolist()


# ---------------------------------------------------------------- literal acceptance tables

@pytest.mark.parametrize("params", [GREEDY, SAMPLE], ids=["greedy", "sampling"])
@pytest.mark.parametrize("drafts, expected_out, expected_acc", [
    ([1, 2, 3], [1, 2, 3, 4], 3),      # all accepted -> bonus token 4
    ([5, 2, 3], [1, PH, PH, PH], 0),   # first rejected -> recovered 1
    ([1, 0, 3], [1, 2, PH, PH], 1),    # middle rejected -> recovered 2, later drafts dropped
    ([1, 2, 0], [1, 2, 3, PH], 2),     # last rejected
])
def test_acceptance_table(params, drafts, expected_out, expected_acc):
    # Target wants 1, 2, 3 then 4 at the bonus position. With peaked p, sampling is deterministic.
    out, acc = run([([1, 2, 3, 4], drafts)], params=[params])
    assert out == [expected_out]
    assert acc == [expected_acc]


def test_ragged_batch_mixed_k_including_zero():
    seqs = [
        ([3, 1, 5], [3, 1]),         # K=2 all accepted -> bonus 5
        ([2], []),                   # K=0: just the target token
        ([0, 4, 4, 1], [0, 4, 2]),   # K=3 last rejected -> recovered 4
        ([5, 0], [1]),               # K=1 first rejected -> recovered 5
    ]
    for params in ([GREEDY] * 4, [GREEDY, SAMPLE, SAMPLE, GREEDY], [SAMPLE] * 4):
        out, acc = run(seqs, params=params)
        assert out == [
            [3, 1, 5, PH],
            [2, PH, PH, PH],
            [0, 4, 4, PH],
            [5, PH, PH, PH],
        ]
        assert acc == [2, 0, 2, 0]


def test_ragged_batch_ending_with_k_zero():
    # Regression: a K=0 sequence after all draft rows must not index past the draft tensor.
    seqs = [([1, 2, 3], [1, 0]), ([4], []), ([0], [])]
    for params in ([GREEDY] * 3, [SAMPLE] * 3):
        out, acc = run(seqs, params=params)
        assert out == [[1, 2, PH], [4, PH, PH], [0, PH, PH]]
        assert acc == [1, 0, 0]


def test_all_k_zero_batch():
    out, acc = run([([4], []), ([2], [])], params=[GREEDY, SAMPLE])
    assert out == [[4], [2]] and acc == [0, 0]


def test_draft_equal_to_target_greedy_accepts_everything():
    torch.manual_seed(0)
    ks = [5, 1, 3, 7]
    meta = SpecBatchMetadata.from_counts(ks)
    logits = torch.randn(sum(ks) + len(ks), 50)
    argmax = logits.argmax(-1)
    drafts = torch.cat([argmax[meta.target_slice(i)][:-1] for i in range(len(ks))])
    res = rejection_sample(logits, drafts, [None] * 4, meta, [GREEDY] * 4, [None] * 4)
    assert res.num_accepted.tolist() == ks
    for i, k in enumerate(ks):
        committed = res.committed(i)
        assert len(committed) == k + 1
        assert committed == argmax[meta.target_slice(i)].tolist()


def test_greedy_ignores_draft_probs():
    q = torch.full((2, V), 1.0 / V)
    out, acc = run([([1, 2, 3], [1, 4])], draft_probs=[q])
    assert out == [[1, 2, PH]] and acc == [1]


# ---------------------------------------------------------------- validation

def _valid_inputs():
    meta = SpecBatchMetadata.from_counts([2, 1])
    return torch.zeros(5, V), torch.tensor([1, 2, 3]), [None, None], meta, [GREEDY] * 2, [None] * 2


@pytest.mark.parametrize("bad_id", [V, -1, 10**6])
def test_out_of_vocab_draft_id_raises(bad_id):
    logits, drafts, probs, meta, params, gens = _valid_inputs()
    drafts[1] = bad_id
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        rejection_sample(logits, drafts, probs, meta, params, gens)


def test_shape_mismatches_raise():
    logits, drafts, probs, meta, params, gens = _valid_inputs()
    rejection_sample(logits, drafts, probs, meta, params, gens)  # the valid baseline works
    with pytest.raises(ValueError, match="target_logits"):
        rejection_sample(torch.zeros(4, V), drafts, probs, meta, params, gens)
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(logits, drafts[:2], probs, meta, params, gens)
    with pytest.raises(ValueError, match="draft_token_ids must be an integer"):
        rejection_sample(logits, drafts.float(), probs, meta, params, gens)
    with pytest.raises(ValueError, match=r"draft_probs\[0\]"):
        rejection_sample(logits, drafts, [torch.ones(2, V + 1), None], meta, params, gens)
    with pytest.raises(ValueError, match="params"):
        rejection_sample(logits, drafts, probs, meta, params[:1], gens)
    bad_meta = SpecBatchMetadata([2, 1], torch.tensor([0, 1, 3]), 2)
    with pytest.raises(ValueError, match="cu_num_draft_tokens"):
        rejection_sample(logits, drafts, probs, bad_meta, params, gens)


# ---------------------------------------------------------------- determinism

def _random_batch(seed: int, ks: list[int], vocab: int = 32):
    g = torch.Generator().manual_seed(seed)
    meta = SpecBatchMetadata.from_counts(ks)
    logits = torch.randn(sum(ks) + len(ks), vocab, generator=g) * 2
    q = [torch.softmax(torch.randn(k, vocab, generator=g), -1) for k in ks]
    drafts = torch.cat([torch.multinomial(qi, 1, generator=g).squeeze(-1) for qi in q])
    return meta, logits, drafts, q


def test_seeded_rows_reproduce_regardless_of_neighbours():
    meta, logits, drafts, q = _random_batch(1, [4, 3, 5])
    params = [SamplingParams(temperature=0.9, seed=7)] * 3

    def once():
        gens = [torch.Generator().manual_seed(100 + i) for i in range(3)]
        torch.manual_seed(12345)  # the global RNG must not matter for seeded rows
        r = rejection_sample(logits, drafts, q, meta, params, gens)
        return r.output_token_ids.tolist(), r.num_accepted.tolist()

    first = once()
    assert once() == first
    # Same row 1 alone in a batch of one, with the same generator seed: same result.
    meta1 = SpecBatchMetadata.from_counts([3])
    r1 = rejection_sample(logits[meta.target_slice(1)], drafts[meta.draft_slice(1)], [q[1]], meta1,
                          params[:1], [torch.Generator().manual_seed(101)])
    assert r1.num_accepted.tolist()[0] == first[1][1]
    assert r1.output_token_ids.tolist()[0] == first[0][1][:4]
    # Different seeds explore different outcomes (over 20 seeds the results are not all equal).
    outcomes = set()
    for s in range(20):
        gens = [torch.Generator().manual_seed(s * 3 + i) for i in range(3)]
        outcomes.add(str(rejection_sample(logits, drafts, q, meta, params, gens).output_token_ids.tolist()))
    assert len(outcomes) > 1


# ---------------------------------------------------------------- statistics: lossless sampling

def _tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


def _assert_distribution(samples: np.ndarray, p: np.ndarray, refs: list[np.ndarray]) -> None:
    """samples ~ p: chi-square at ALPHA on p's support, nothing outside it, and the empirical
    distribution is >= 20x closer to p (total variation) than to each reference distribution."""
    p = p / p.sum()  # float32 -> float64 rounding
    vocab = p.shape[0]
    counts = np.bincount(samples, minlength=vocab).astype(np.float64)
    support = p > 0
    assert counts[~support].sum() == 0, f"tokens outside the target support: {counts}"
    expected = p[support] * counts.sum()
    assert expected.min() >= 5, "test design: chi-square needs >= 5 expected per cell"
    stat = chisquare(counts[support], expected)
    assert stat.pvalue > ALPHA, f"chi-square p={stat.pvalue:.2e}: counts {counts} vs expected {p * counts.sum()}"
    emp = counts / counts.sum()
    d_target = _tv(emp, p)
    for ref in refs:
        assert 20 * d_target < _tv(emp, ref), (d_target, _tv(emp, ref), ref)


def _statistical_run(k: int, params: SamplingParams, one_hot: bool, n: int, seed: int, scale: float = 1.5):
    """n independent rows, all sharing the same target logits per position (a context-free target)
    and the same draft distribution q. Returns (output [n, K+1], num_accepted [n], p [K+1, V], q)."""
    vocab = 8
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(k + 1, vocab, generator=g) * scale  # [K+1, V]
    p = logits_to_probs(target_logits, params)  # [K+1, V]
    if one_hot:
        # A deterministic drafter whose choice depends on the row's "context" (its index): even
        # rows draft the target argmax (often accepted), odd rows a rotating token.
        rows = torch.arange(n)[:, None]
        rotating = (rows * 3 + torch.arange(k)[None, :]) % vocab  # [n, K]
        drafts = torch.where(rows % 2 == 0, p[:k].argmax(-1)[None, :], rotating)  # [n, K]
        q = None
    else:
        q = logits_to_probs(torch.randn(k, vocab, generator=g) * scale, params)  # [K, V], q != p
        drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g)
                              for j in range(k)], dim=1)  # [n, K]
    meta = SpecBatchMetadata.from_counts([k] * n)
    logits = target_logits.repeat(n, 1)  # [n * (K+1), V]
    torch.manual_seed(seed + 1)
    res = rejection_sample(logits, drafts.reshape(-1), [q] * n, meta, [params] * n, [None] * n)
    return res.output_token_ids.numpy(), res.num_accepted.numpy(), p.numpy().astype(np.float64), q


def _references(p: np.ndarray, q: torch.Tensor | None, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    refs = [rng.dirichlet(np.ones_like(p)) for _ in range(3)]
    if q is not None:
        refs.append(q[0].numpy().astype(np.float64))  # what a sampler that forgot to reject would give
    return refs


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sampling_keeps_target_distribution(k):
    n = 50_000
    out, acc, p, q = _statistical_run(k, SAMPLE, one_hot=False, n=n, seed=10 + k)
    # Tokens are never placeholders where committed.
    assert (out[np.arange(n), acc] != PH).all()
    # First committed token ~ p_0.
    _assert_distribution(out[:, 0], p[0], _references(p[0], q, k))
    # Second committed token, given the first draft was accepted, ~ p_1 (accepted draft,
    # recovered token, or for K=1 the bonus token).
    second = out[acc >= 1, 1]
    _assert_distribution(second, p[1], _references(p[1], q[1:] if k > 1 else None, 100 + k))
    # Acceptance at the first position happens with probability sum_x min(p(x), q(x)).
    rate = float(np.minimum(p[0], q[0].numpy()).sum())
    sigma = (rate * (1 - rate) / n) ** 0.5
    assert abs((acc >= 1).mean() - rate) < 4.5 * sigma


def test_sampling_with_one_hot_drafts_keeps_target_distribution():
    n = 80_000
    out, acc, p, _ = _statistical_run(3, SAMPLE, one_hot=True, n=n, seed=3)
    _assert_distribution(out[:, 0], p[0], _references(p[0], None, 5))
    _assert_distribution(out[acc >= 1, 1], p[1], _references(p[1], None, 6))


def test_sampling_with_temperature_top_k_top_p_keeps_target_distribution():
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.9)
    n = 50_000
    out, acc, p, q = _statistical_run(2, params, one_hot=False, n=n, seed=21, scale=0.6)
    for j in range(2):  # test design: the cut removes tokens but leaves several
        assert 2 <= (p[j] == 0).sum() <= 5, p[j]
    _assert_distribution(out[:, 0], p[0], _references(p[0], q, 7))
    _assert_distribution(out[acc >= 1, 1], p[1], _references(p[1], q[1:], 8))


def test_seeded_per_row_generators_keep_target_distribution():
    # The per-row generator path (seeded requests) draws differently from the batched global
    # path; it must be just as lossless.
    n, k, vocab = 8_000, 2, 8
    g = torch.Generator().manual_seed(77)
    target_logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    p = logits_to_probs(target_logits, SAMPLE)
    q = logits_to_probs(torch.randn(k, vocab, generator=g) * 1.5, SAMPLE)
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], 1)
    gens = [torch.Generator().manual_seed(1000 + i) for i in range(n)]
    res = rejection_sample(target_logits.repeat(n, 1), drafts.reshape(-1), [q] * n,
                           SpecBatchMetadata.from_counts([k] * n), [SAMPLE] * n, gens)
    p64 = p.numpy().astype(np.float64)
    _assert_distribution(res.output_token_ids[:, 0].numpy(), p64[0], [q[0].numpy().astype(np.float64)])


def _reference_greedy(target_ids: list[int], drafts: list[int]) -> list[int]:
    """Plain loop: keep drafts while they equal the target argmax, then one target token."""
    out = []
    for j, d in enumerate(drafts):
        if d != target_ids[j]:
            break
        out.append(d)
    out.append(target_ids[len(out)])
    return out


def test_vectorized_greedy_matches_reference_loop():
    g = torch.Generator().manual_seed(5)
    for trial in range(30):
        ks = torch.randint(0, 6, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        meta = SpecBatchMetadata.from_counts(ks)
        vocab = 4  # small vocabulary: random drafts often agree with the target
        logits = torch.randn(sum(ks) + len(ks), vocab, generator=g)
        drafts = torch.randint(0, vocab, (sum(ks),), generator=g)
        res = rejection_sample(logits, drafts, [None] * len(ks), meta, [GREEDY] * len(ks), [None] * len(ks))
        argmax = logits.argmax(-1)
        for i in range(len(ks)):
            expected = _reference_greedy(argmax[meta.target_slice(i)].tolist(), drafts[meta.draft_slice(i)].tolist())
            assert res.committed(i) == expected
            assert res.output_token_ids[i, len(expected):].tolist() == [PH] * (meta.max_spec_len + 1 - len(expected))
