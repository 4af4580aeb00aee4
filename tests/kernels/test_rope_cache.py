"""The rotary-embedding kernel: the same rotated queries, and the same keys and values written at
the same slots, as the torch path (float32 rounding); nothing else in the cache touched; clear errors."""
import pytest
import torch

from cluster.kernels import native, rope_cache

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler for the kernels here")


def _torch_path(qkv, cos, sin, kc, vc, slots, H, Hkv, D):
    T = qkv.shape[0]
    x = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
    swapped = x.view(T, H + Hkv, 2, D // 2).flip(2).view(T, H + Hkv, D)
    qk = x * cos.unsqueeze(1) + swapped * sin.unsqueeze(1)
    kc.index_copy_(0, slots, qk[:, H:])
    vc.index_copy_(0, slots, qkv[:, (H + Hkv) * D :].view(T, Hkv, D))
    return qk[:, :H]


@pytest.mark.parametrize("T,H,Hkv,D", [(1, 9, 3, 64), (5, 9, 3, 64), (300, 4, 2, 16), (2, 8, 8, 128)])
def test_matches_the_torch_path(T, H, Hkv, D):
    g = torch.Generator().manual_seed(T * H + D)
    S = 512
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g)
    ang = torch.rand(T, D // 2, generator=g) * 50
    cos = torch.cat([ang.cos(), ang.cos()], dim=-1)
    sin = torch.cat([-ang.sin(), ang.sin()], dim=-1)
    slots = torch.randperm(S, generator=g)[:T]
    kc, vc = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    assert rope_cache.applies(qkv, kc)
    q = rope_cache.rope_qk_cache(qkv, cos, sin, kc, vc, slots, H)
    q_ref = _torch_path(qkv, cos, sin, kc_ref, vc_ref, slots, H, Hkv, D)
    assert q.shape == (T, H, D)
    assert torch.allclose(q, q_ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(kc, kc_ref, atol=1e-5, rtol=1e-5) and torch.equal(vc, vc_ref)
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(kc[untouched], kc_ref[untouched])


def test_bad_inputs_raise_clear_errors():
    kc, vc = torch.zeros(8, 2, 16), torch.zeros(8, 2, 16)
    qkv, cos = torch.randn(2, (4 + 4) * 16), torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        rope_cache.rope_qk_cache(qkv, cos, cos, kc, vc, torch.tensor([0, 8]), 4)
    with pytest.raises(RuntimeError, match="qkv must be"):
        rope_cache.rope_qk_cache(qkv, cos, cos, kc, vc, torch.tensor([0, 1]), 5)
    with pytest.raises(RuntimeError, match="cos and sin_signed"):
        rope_cache.rope_qk_cache(qkv, cos[:1], cos[:1], kc, vc, torch.tensor([0, 1]), 4)
    assert not rope_cache.applies(qkv.to(torch.bfloat16), kc)
