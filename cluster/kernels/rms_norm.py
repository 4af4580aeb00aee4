"""RMSNorm over the last dimension of float32 CPU rows (``rms_norm.cpp``), one call per norm.

Owns: y = x / sqrt(mean(x^2) + eps) * weight for contiguous float32 rows, and the test of whether
a tensor can take this path. Ignores: other dtypes and layouts (the caller falls back to torch).
"""
from __future__ import annotations

import torch

from cluster.kernels.native import row_ops


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``rms_norm`` takes (x, weight): float32 contiguous CPU rows, a float32 weight, kernels built and on."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and x.is_contiguous() and weight.is_contiguous() and row_ops())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n], weight [n] -> [..., n] float32."""
    return torch.ops.specserve.rms_norm(x, weight, eps)
