"""Rejection sampler: literal acceptance tables, ragged batches, validation, determinism, and
statistical proof that sampling keeps the target distribution (arXiv 2211.17192, Theorem 1)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from cluster.common.request import SamplingParams
from cluster.sampling.sampler import coupled_tokens, filtered_logits, logits_to_probs
from cluster.speculative.rejection_sampler import rejection_sample
from cluster.speculative.types import PLACEHOLDER_TOKEN_ID as PH, SpecBatchMetadata

V = 6
GREEDY = SamplingParams(temperature=0.0)
SAMPLE = SamplingParams(temperature=1.0)
ALPHA = 1e-3  # chi-square significance: a correct sampler fails ~1 run in 1000 (seeds are fixed)


def peaked_logits(token_ids: list[int], vocab: int = V) -> torch.Tensor:
    """[len, V] logits whose softmax puts all float32 mass on the given tokens (exp(-1e4) == 0)."""
    logits = torch.full((len(token_ids), vocab), -1e4)
    logits[torch.arange(len(token_ids)), torch.tensor(token_ids)] = 0.0
    return logits


def run(seqs, params=None, positions=None, draft_probs=None, vocab: int = V):
    """seqs: list of (target argmax per position [K+1], drafts [K]) -> (output list, accepted list)."""
    meta = SpecBatchMetadata.from_num_draft_tokens([len(d) for _, d in seqs])
    logits = torch.cat([peaked_logits(t, vocab) for t, _ in seqs])
    drafts = torch.tensor([x for _, d in seqs for x in d], dtype=torch.int64)
    b = len(seqs)
    res = rejection_sample(logits, drafts, draft_probs or [None] * b, meta,
                           params or [GREEDY] * b, positions or [0] * b)
    return res.output_token_ids.tolist(), res.num_accepted.tolist()


# ---------------------------------------------------------------- literal acceptance tables

SEEDED = SamplingParams(temperature=1.0, seed=3)


@pytest.mark.parametrize("params", [GREEDY, SAMPLE, SEEDED], ids=["greedy", "sampling", "seeded"])
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
    for params in ([GREEDY] * 4, [GREEDY, SAMPLE, SEEDED, GREEDY], [SAMPLE] * 4, [SEEDED] * 4):
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
    for params in ([GREEDY] * 3, [SAMPLE] * 3, [SEEDED, SAMPLE, SEEDED]):
        out, acc = run(seqs, params=params)
        assert out == [[1, 2, PH], [4, PH, PH], [0, PH, PH]]
        assert acc == [1, 0, 0]


def test_all_k_zero_batch():
    out, acc = run([([4], []), ([2], []), ([1], [])], params=[GREEDY, SAMPLE, SEEDED])
    assert out == [[4], [2], [1]] and acc == [0, 0, 0]


def test_draft_equal_to_target_greedy_accepts_everything():
    torch.manual_seed(0)
    num_draft_tokens = [5, 1, 3, 7]
    meta = SpecBatchMetadata.from_num_draft_tokens(num_draft_tokens)
    logits = torch.randn(sum(num_draft_tokens) + len(num_draft_tokens), 50)
    argmax = logits.argmax(-1)
    drafts = torch.cat([argmax[meta.target_slice(i)][:-1] for i in range(len(num_draft_tokens))])
    res = rejection_sample(logits, drafts, [None] * 4, meta, [GREEDY] * 4, [0] * 4)
    assert res.num_accepted.tolist() == num_draft_tokens
    for i, k in enumerate(num_draft_tokens):
        committed = res.committed(i)
        assert len(committed) == k + 1
        assert committed == argmax[meta.target_slice(i)].tolist()


def test_greedy_ignores_draft_probs():
    q = torch.full((2, V), 1.0 / V)
    out, acc = run([([1, 2, 3], [1, 4])], draft_probs=[q])
    assert out == [[1, 2, PH]] and acc == [1]


# ---------------------------------------------------------------- validation

def _valid_inputs():
    meta = SpecBatchMetadata.from_num_draft_tokens([2, 1])
    return torch.zeros(5, V), torch.tensor([1, 2, 3]), [None, None], meta, [GREEDY] * 2, [0] * 2


@pytest.mark.parametrize("bad_id", [V, -1, 10**6])
def test_out_of_vocab_draft_id_raises(bad_id):
    logits, drafts, probs, meta, params, positions = _valid_inputs()
    drafts[1] = bad_id
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        rejection_sample(logits, drafts, probs, meta, params, positions)


def test_shape_mismatches_raise():
    logits, drafts, probs, meta, params, positions = _valid_inputs()
    rejection_sample(logits, drafts, probs, meta, params, positions)  # the valid baseline works
    with pytest.raises(ValueError, match="target_logits"):
        rejection_sample(torch.zeros(4, V), drafts, probs, meta, params, positions)
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(logits, drafts[:2], probs, meta, params, positions)
    with pytest.raises(ValueError, match="draft_token_ids must be an integer"):
        rejection_sample(logits, drafts.float(), probs, meta, params, positions)
    with pytest.raises(ValueError, match=r"draft_probs\[0\]"):
        rejection_sample(logits, drafts, [torch.ones(2, V + 1), None], meta, params, positions)
    with pytest.raises(ValueError, match="params"):
        rejection_sample(logits, drafts, probs, meta, params[:1], positions)
    bad_meta = SpecBatchMetadata([2, 1], torch.tensor([0, 1, 3]), 2)
    with pytest.raises(ValueError, match="cu_num_draft_tokens"):
        rejection_sample(logits, drafts, probs, bad_meta, params, positions)


# ---------------------------------------------------------------- determinism

def _random_batch(seed: int, num_draft_tokens: list[int], vocab: int = 32):
    g = torch.Generator().manual_seed(seed)
    meta = SpecBatchMetadata.from_num_draft_tokens(num_draft_tokens)
    logits = torch.randn(sum(num_draft_tokens) + len(num_draft_tokens), vocab, generator=g) * 2
    q = [torch.softmax(torch.randn(k, vocab, generator=g), -1) for k in num_draft_tokens]
    drafts = torch.cat([torch.multinomial(qi, 1, generator=g).squeeze(-1) for qi in q])
    return meta, logits, drafts, q


def test_seeded_rows_are_the_coupled_target_tokens_regardless_of_neighbours_and_global_rng():
    meta, logits, drafts, q = _random_batch(1, [4, 3, 5])
    params = [SamplingParams(temperature=0.9, seed=7), SamplingParams(temperature=0.9, seed=8), SAMPLE]
    positions = [10, 20, 30]

    def once(global_seed: int):
        torch.manual_seed(global_seed)  # only the unseeded row may depend on it
        r = rejection_sample(logits, drafts, q, meta, params, positions)
        return r.output_token_ids.tolist(), r.num_accepted.tolist()

    first = once(1)
    for global_seed in (2, 3):
        out, acc = once(global_seed)
        assert out[:2] == first[0][:2] and acc[:2] == first[1][:2]
    # Row 1 alone: same result. And what it commits is plain seeded sampling at those positions:
    # the accepted prefix equals the drafts, then the coupled token.
    r1 = rejection_sample(logits[meta.target_slice(1)], drafts[meta.draft_slice(1)], [q[1]],
                          SpecBatchMetadata.from_num_draft_tokens([3]), params[1:2], positions[1:2])
    assert r1.committed(0) == first[0][1][: first[1][1] + 1]
    plain = coupled_tokens(filtered_logits(logits[meta.target_slice(1)], params[1]), 8, 20).tolist()
    a = first[1][1]
    assert r1.committed(0) == plain[: a + 1]
    assert drafts[meta.draft_slice(1)].tolist()[:a] == plain[:a]
    assert a == 3 or drafts[meta.draft_slice(1)].tolist()[a] != plain[a]


def test_seeded_drafts_equal_to_the_coupled_tokens_are_all_accepted():
    meta, logits, _, _ = _random_batch(2, [4, 2])
    params = [SamplingParams(temperature=1.3, top_k=20, seed=s) for s in (5, 6)]
    plain = [coupled_tokens(filtered_logits(logits[meta.target_slice(i)], params[i]), params[i].seed, 100)
             for i in range(2)]  # [K_i + 1] each
    drafts = torch.cat([plain[0][:4], plain[1][:2]])
    res = rejection_sample(logits, drafts, [None, None], meta, params, [100, 100])
    assert res.num_accepted.tolist() == [4, 2]
    assert [res.committed(i) for i in range(2)] == [t.tolist() for t in plain]
    # Different seeds explore different outcomes.
    outcomes = {str(coupled_tokens(filtered_logits(logits[:5], SamplingParams(temperature=1.0, seed=s)), s, 0).tolist())
                for s in range(20)}
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
    meta = SpecBatchMetadata.from_num_draft_tokens([k] * n)
    logits = target_logits.repeat(n, 1)  # [n * (K+1), V]
    torch.manual_seed(seed + 1)
    res = rejection_sample(logits, drafts.reshape(-1), [q] * n, meta, [params] * n, [0] * n)
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


def test_sampling_with_min_p_keeps_target_distribution():
    """min_p's cut is part of p (and of q, drafted under the same params): the committed tokens
    follow the cut distribution, nothing outside it."""
    params = SamplingParams(temperature=0.9, min_p=0.1)
    n = 50_000
    out, acc, p, q = _statistical_run(2, params, one_hot=False, n=n, seed=23)
    for j in range(2):  # test design: the cut removes tokens but leaves several
        assert 2 <= (p[j] == 0).sum() <= 5, p[j]
    _assert_distribution(out[:, 0], p[0], _references(p[0], q, 9))
    _assert_distribution(out[acc >= 1, 1], p[1], _references(p[1], q[1:], 10))


@pytest.mark.parametrize("drafts_from", ["q", "coupled", "one_hot"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6, top_p=0.9)],
                         ids=["t1", "t0.7-k6-p0.9"])
def test_seeded_coupled_verification_keeps_target_distribution(drafts_from, params):
    """Over many seeds, Gumbel-max verification commits tokens distributed exactly as p —
    through speculative verification with independent drafts from q, drafts made with the same
    per-position noise (what model drafters do for seeded requests), or fixed one-hot drafts."""
    n, k, vocab = 10_000, 2, 8
    g = torch.Generator().manual_seed(77)
    target_logits = torch.randn(k + 1, vocab, generator=g) * (1.5 if params.top_k == 0 else 0.6)
    p = logits_to_probs(target_logits, params)  # [K+1, V]
    q = logits_to_probs(torch.randn(k, vocab, generator=g) * 1.5, SAMPLE)  # [K, V], q != p
    draft_scores = filtered_logits(torch.log(q), SAMPLE)
    seeded = [dataclasses.replace(params, seed=1000 + i) for i in range(n)]
    if drafts_from == "q":
        drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], 1)
    elif drafts_from == "coupled":
        drafts = torch.stack([coupled_tokens(draft_scores, sp.seed, 50) for sp in seeded])  # [n, K]
    else:
        drafts = p[:k].argmax(-1).repeat(n, 1)
    res = rejection_sample(target_logits.repeat(n, 1), drafts.reshape(-1), [q] * n,
                           SpecBatchMetadata.from_num_draft_tokens([k] * n), seeded, [50] * n)
    out, acc = res.output_token_ids.numpy(), res.num_accepted.numpy()
    p64 = p.numpy().astype(np.float64)
    # (the 20x-closer-than-a-reference check needs more samples than the conditional second token has)
    _assert_distribution(out[:, 0], p64[0], [q[0].numpy().astype(np.float64)])
    _assert_distribution(out[acc >= 1, 1], p64[1], [])
    # Path independence: each row commits exactly its plain seeded tokens.
    for i in range(0, n, 500):
        plain = coupled_tokens(filtered_logits(target_logits, seeded[i]), seeded[i].seed, 50).tolist()
        assert res.committed(i) == plain[: acc[i] + 1]
    if drafts_from == "coupled":  # the shared noise makes drafts agree far more than independent draws
        independent = float((p64[0] * q[0].numpy()).sum())
        assert (acc >= 1).mean() > independent + 0.1


def _reference_greedy(target_ids: list[int], drafts: list[int]) -> list[int]:
    """Plain loop: keep drafts while they equal the target argmax, then one target token."""
    out = []
    for j, d in enumerate(drafts):
        if d != target_ids[j]:
            break
        out.append(d)
    out.append(target_ids[len(out)])
    return out


@pytest.mark.parametrize("mixed", [False, True])
def test_deterministic_rows_match_the_reference_loop(mixed):
    """The deterministic rows' walk (``_match_target``) agrees with the reference loop in an
    all-greedy batch and in one with a seeded row among them (``mixed``)."""
    g = torch.Generator().manual_seed(5)
    for trial in range(30):
        num_draft_tokens = torch.randint(0, 6, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        meta = SpecBatchMetadata.from_num_draft_tokens(num_draft_tokens)
        vocab = 4  # small vocabulary: random drafts often agree with the target
        logits = torch.randn(sum(num_draft_tokens) + len(num_draft_tokens), vocab, generator=g)
        drafts = torch.randint(0, vocab, (sum(num_draft_tokens),), generator=g)
        params = [GREEDY] * len(num_draft_tokens)
        if mixed:
            params[0] = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
        res = rejection_sample(logits, drafts, [None] * len(num_draft_tokens), meta, params,
                               [0] * len(num_draft_tokens))
        argmax = logits.argmax(-1)
        for i in range(1 if mixed else 0, len(num_draft_tokens)):
            expected = _reference_greedy(argmax[meta.target_slice(i)].tolist(), drafts[meta.draft_slice(i)].tolist())
            assert res.committed(i) == expected
            assert res.output_token_ids[i, len(expected):].tolist() == [PH] * (meta.max_draft_tokens + 1 - len(expected))
        assert res.verdicts() == [(res.committed(i), int(res.num_accepted[i])) for i in range(len(num_draft_tokens))]
