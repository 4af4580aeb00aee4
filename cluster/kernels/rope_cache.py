"""Rotary embedding of a fused QKV projection's query and key heads, with the rotated keys and the
values written into the paged KV cache, in one native call (``rope_cache.cpp``).

Owns: the call and the test of whether a layer can take it (float32 CPU, no per-head q/k norm).
Ignores: the rotary tables (``cluster.models.llama`` builds cos and the signed sin once) and the
slots (``cluster.models.runner``).
"""
from __future__ import annotations

import torch

from cluster.kernels.native import row_ops


def applies(qkv: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``rope_qk_cache`` takes these tensors: contiguous float32 on CPU, kernels built and on."""
    return (qkv.dtype == torch.float32 and k_cache.dtype == torch.float32 and qkv.device.type == "cpu"
            and qkv.is_contiguous() and k_cache.is_contiguous() and row_ops())


def rope_qk_cache(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int) -> torch.Tensor:
    """qkv [T, (H + 2 Hkv) D]; cos, sin_signed [T, D]; caches [S, Hkv, D] (written at ``slots`` [T])
    -> the rotated queries [T, H, D]."""
    return torch.ops.specserve.rope_qk_cache(qkv, cos, sin_signed, k_cache, v_cache, slots, num_heads)
