"""The paged-attention kernel: equal to torch's scaled_dot_product_attention over the gathered,
causally masked keys (float32 rounding), grouped-query heads, rows independent of the batch (decode
and verification agree bit for bit), slots scattered anywhere in the cache, clear errors on indices
that would read outside it."""
import pytest
import torch
import torch.nn.functional as F

from cluster.kernels import native, paged_attention

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler for the kernels here")


def _reference(q, kc, vc, slots, rows, seq, keys):
    H, D = q.shape[1], q.shape[2]
    out = []
    for r, s, n in zip(rows.tolist(), seq.tolist(), keys.tolist()):
        k = kc[slots[s, :n]].transpose(0, 1).unsqueeze(0).double()  # [1, Hkv, n, D]
        v = vc[slots[s, :n]].transpose(0, 1).unsqueeze(0).double()
        o = F.scaled_dot_product_attention(q[r].unsqueeze(0).unsqueeze(2).double(), k, v, enable_gqa=True)
        out.append(o.reshape(H * D))
    return torch.stack(out)


def _case(seed, H=9, Hkv=3, D=64, S=4096, ctx=(300, 17, 1), q_lens=(1, 3, 1)):
    g = torch.Generator().manual_seed(seed)
    kc, vc = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    slots = torch.zeros(len(ctx), max(ctx), dtype=torch.int64)
    rows, seq, keys = [], [], []
    for s, (L, q) in enumerate(zip(ctx, q_lens)):
        slots[s, :L] = torch.randperm(S, generator=g)[:L]  # blocks anywhere in the cache
        rows += range(len(rows), len(rows) + q)
        seq += [s] * q
        keys += range(L - q + 1, L + 1)  # the new queries are the last q positions
    q = torch.randn(len(rows), H, D, generator=g) * 2
    return q, kc, vc, slots, torch.tensor(rows), torch.tensor(seq), torch.tensor(keys)


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 1, 16)])
def test_matches_torch_sdpa(heads):
    H, Hkv, D = heads
    q, kc, vc, slots, rows, seq, keys = _case(H * D, H, Hkv, D)
    assert paged_attention.applies(q, kc)
    out = paged_attention.paged_attention(q, kc, vc, slots, rows, seq, keys, D ** -0.5)
    assert out.shape == (len(rows), H * D)
    assert torch.allclose(out.double(), _reference(q, kc, vc, slots, rows, seq, keys), atol=2e-5, rtol=1e-5)


def test_rows_do_not_depend_on_the_batch():
    q, kc, vc, slots, rows, seq, keys = _case(1)
    full = paged_attention.paged_attention(q, kc, vc, slots, rows, seq, keys, 0.125)
    for n in range(len(rows)):
        alone = paged_attention.paged_attention(q, kc, vc, slots, rows[n : n + 1], seq[n : n + 1], keys[n : n + 1], 0.125)
        assert torch.equal(alone[0], full[n])


def test_indices_outside_the_cache_are_refused():
    q, kc, vc, slots, rows, seq, keys = _case(2)
    bad_slots = slots.clone()
    bad_slots[0, 5] = kc.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged_attention.paged_attention(q, kc, vc, bad_slots, rows, seq, keys, 0.125)
    with pytest.raises(RuntimeError, match="out of range"):
        paged_attention.paged_attention(q, kc, vc, slots, rows, seq, keys + slots.shape[1], 0.125)
    with pytest.raises(RuntimeError, match="out of range"):
        paged_attention.paged_attention(q, kc, vc, slots, rows + q.shape[0], seq, keys, 0.125)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        paged_attention.paged_attention(q[..., :60].contiguous(), kc[..., :60].contiguous(), vc[..., :60].contiguous(),
                                        slots, rows, seq, keys, 0.125)
