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


def test_a_weight_of_bfloat16_values_streams_a_bfloat16_copy_for_few_rows():
    """narrow_copy: kept only where every weight is a bfloat16 value (then the result is the
    same bit for bit, whatever the row count); a float32 weight that is not gets none."""
    w = torch.randn(64, 130).to(torch.bfloat16).float()
    lin, wide = Linear(w, narrow_copy=True), Linear(w)
    assert lin.narrow == skinny_gemm.available() and not wide.narrow
    for m in (1, 3, 8, 9, 40):  # the bfloat16 copy up to NARROW_ROWS, float32 tiles beyond
        x = torch.randn(m, 64)
        assert torch.equal(lin(x), wide(x)) and torch.equal(lin(x, torch.ones(130)), wide(x, torch.ones(130)))
    assert not Linear(torch.randn(64, 130), narrow_copy=True).narrow  # not bfloat16 values: no copy
    assert torch.equal(lin.weight(), w)
