"""The skinny-GEMM CPU kernel (``skinny_gemm.cpp``): y = x @ W (+ add) for few rows, W packed once.

Owns: packing a weight into the kernel's column tiles and applying it; the kernel's vector width.
Ignores: building and loading the library (``cluster.kernels.native``: ``available`` is its) and
which weights use it (``cluster.models.linear``).
"""
from __future__ import annotations

import torch

from cluster.kernels.native import available, unavailable_reason  # noqa: F401  (the kernels' switch)


def vector_width() -> int:
    """Floats per vector of the loaded build: 16 where the compiler targeted AVX-512, else 8."""
    return int(torch.ops.specserve.skinny_vector_width())


def pack(w_in_out: torch.Tensor) -> torch.Tensor:  # [K, N] -> [ceil(N/64), K, 64]
    return torch.ops.specserve.skinny_pack(w_in_out)


def linear(x: torch.Tensor, packed: torch.Tensor, n_out: int, add: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W [K, N] (+ add [M, N], a broadcast bias allowed) -> [M, N]."""
    return torch.ops.specserve.skinny_linear(x, packed, n_out, add)
