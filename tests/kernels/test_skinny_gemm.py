"""The skinny-GEMM kernel: equal to torch's matmul within float32 rounding, independent of the
number of rows (bit for bit), bias/residual add, partial tiles, clear errors on bad shapes."""
import pytest
import torch

from cluster.kernels import skinny_gemm

pytestmark = pytest.mark.skipif(not skinny_gemm.available(), reason="no C++ compiler for the kernel here")


@pytest.mark.parametrize("k,n", [(576, 960), (64, 64), (100, 130), (64, 100), (1536, 576), (7, 1)])
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 40])
def test_matches_torch(m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = torch.randn(k, n, generator=g)  # [in, out]
    x = torch.randn(m, k, generator=g)
    add = torch.randn(m, n, generator=g)
    packed = skinny_gemm.pack(w)
    assert packed.shape == ((n + 63) // 64, k, 64)
    ref = x.double() @ w.double()
    tol = 1e-5 * k ** 0.5 * ref.abs().max().item() + 1e-5
    assert torch.allclose(skinny_gemm.linear(x, packed, n).double(), ref, atol=tol, rtol=0)
    assert torch.allclose(skinny_gemm.linear(x, packed, n, add).double(), ref + add.double(), atol=tol, rtol=0)
    bias = torch.randn(n, generator=g)
    out = skinny_gemm.linear(x, packed, n, bias.expand(m, n))
    assert torch.allclose(out.double(), ref + bias.double(), atol=tol, rtol=0)


def test_rows_do_not_depend_on_the_batch():
    """Row i of a 13-row call equals the same row computed alone: decode and verification agree;
    so do calls of 2-8 rows (one register block of up to 6 rows, then the rest)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, 49152 // 8, generator=g)
    x = torch.randn(13, 576, generator=g)
    add = torch.randn(13, w.shape[1], generator=g)
    packed = skinny_gemm.pack(w)
    full = skinny_gemm.linear(x, packed, w.shape[1], add)
    for i in range(13):
        alone = skinny_gemm.linear(x[i : i + 1], packed, w.shape[1], add[i : i + 1])
        assert torch.equal(alone[0], full[i]), f"row {i} differs when computed alone"
    for m in (2, 3, 4, 5, 6, 7, 8):
        assert torch.equal(skinny_gemm.linear(x[:m], packed, w.shape[1], add[:m]), full[:m])


def test_strided_rows_and_zero_rows():
    w = torch.randn(32, 70)
    packed = skinny_gemm.pack(w)
    big = torch.randn(5, 50)
    x = big[:, 3:35]  # row stride 50, unit column stride
    assert torch.allclose(skinny_gemm.linear(x, packed, 70), x @ w, atol=1e-4)
    assert skinny_gemm.linear(torch.empty(0, 32), packed, 70).shape == (0, 70)


def test_bad_inputs_raise_clear_errors():
    packed = skinny_gemm.pack(torch.randn(16, 64))
    with pytest.raises(RuntimeError, match="columns"):
        skinny_gemm.linear(torch.randn(2, 17), packed, 64)
    with pytest.raises(RuntimeError, match="float32"):
        skinny_gemm.linear(torch.randn(2, 16, dtype=torch.float64), packed, 64)
    with pytest.raises(RuntimeError, match="n_out"):
        skinny_gemm.linear(torch.randn(2, 16), packed, 65)
    with pytest.raises(RuntimeError, match="add"):
        skinny_gemm.linear(torch.randn(2, 16), packed, 64, torch.randn(3, 64))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        skinny_gemm.pack(torch.randn(4, 4, dtype=torch.float64))


@pytest.mark.parametrize("k,n", [(576, 960), (100, 130), (7, 1)])
def test_bfloat16_tiles_give_the_float32_result_bit_for_bit(k, n):
    """Weights that are bfloat16 values packed as bfloat16: half the bytes, each widened exactly
    and summed in the same order — equal to the float32 packing's result, with adds and biases,
    at every row count."""
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(k, n, generator=g).to(torch.bfloat16)
    wide, narrow = skinny_gemm.pack(w.float()), skinny_gemm.pack(w)
    assert narrow.dtype == torch.bfloat16 and narrow.shape == wide.shape
    for m in (1, 2, 3, 6, 7, 13):
        x, add, bias = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g), torch.randn(n, generator=g)
        assert torch.equal(skinny_gemm.linear(x, narrow, n), skinny_gemm.linear(x, wide, n))
        assert torch.equal(skinny_gemm.linear(x, narrow, n, add), skinny_gemm.linear(x, wide, n, add))
        assert torch.equal(skinny_gemm.linear(x, narrow, n, bias.expand(m, n)),
                           skinny_gemm.linear(x, wide, n, bias.expand(m, n)))


def test_the_vectors_fit_this_cpus_registers():
    """16-float vectors only where the CPU has AVX-512: on AVX2 they spill every accumulator
    (verification cost 5.9 decode steps instead of 1.6; docs/measurements.md, "Decode on a
    machine without AVX-512")."""
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), None)
    if flags is None:
        pytest.skip("no /proc/cpuinfo flags here")
    assert skinny_gemm.vector_width() == (16 if "avx512f" in flags else 8)
