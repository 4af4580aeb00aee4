"""``Linear``: packed float32 weights and plain reduced-precision weights give x @ W (+ add)."""
import torch

from cluster.kernels import skinny_gemm
from cluster.models.linear import Linear


def test_float32_is_packed_when_the_kernel_is_there_and_matches_matmul():
    w = torch.randn(96, 200)
    lin = Linear(w)
    assert lin.packed == skinny_gemm.available()
    assert lin.shape == (96, 200)
    x, add, bias = torch.randn(3, 96), torch.randn(3, 200), torch.randn(200)
    assert torch.allclose(lin(x), x @ w, atol=1e-4)
    assert torch.allclose(lin(x, add), add + x @ w, atol=1e-4)
    assert torch.allclose(lin(x, bias), bias + x @ w, atol=1e-4)
    assert torch.equal(lin.weight(), w)


def test_reduced_precision_stays_plain():
    w = torch.randn(32, 48, dtype=torch.bfloat16)
    lin = Linear(w)
    assert not lin.packed and lin.nbytes == w.numel() * 2
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    assert torch.equal(lin(x), x @ w)


def test_select_outputs_keeps_the_chosen_columns():
    w = torch.randn(16, 130)
    keep = torch.tensor([0, 5, 64, 129])
    sub = Linear(w).select_outputs(keep)
    assert sub.shape == (16, 4)
    x = torch.randn(2, 16)
    assert torch.allclose(sub(x), x @ w[:, keep], atol=1e-5)
