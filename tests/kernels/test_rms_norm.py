"""The native RMSNorm: torch's rms_norm within float32 rounding, rows independent of each other,
any leading shape, clear errors on what it does not take."""
import pytest
import torch
import torch.nn.functional as F

from cluster.kernels import native, rms_norm

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler for the kernels here")


@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (300, 576), (3, 9, 64), (2, 20), (1, 13)])
def test_matches_torch(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    assert rms_norm.applies(x, w)
    out = rms_norm.rms_norm(x, w, 1e-5)
    ref = F.rms_norm(x.double(), (shape[-1],), w.double(), 1e-5)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_rows_do_not_depend_on_the_batch():
    x, w = torch.randn(40, 576), torch.randn(576)
    full = rms_norm.rms_norm(x, w, 1e-6)
    for i in (0, 17, 39):
        assert torch.equal(rms_norm.rms_norm(x[i : i + 1], w, 1e-6)[0], full[i])


def test_what_it_does_not_take():
    w = torch.randn(8)
    assert not rms_norm.applies(torch.randn(4, 16)[:, ::2], w)  # not contiguous: torch's path
    assert not rms_norm.applies(torch.randn(4, 8, dtype=torch.bfloat16), w)
    with pytest.raises(RuntimeError, match="weight must be float32 \\[8\\]"):
        rms_norm.rms_norm(torch.randn(4, 8), torch.randn(9), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        rms_norm.rms_norm(torch.randn(4, 8, dtype=torch.float64), w, 1e-6)
