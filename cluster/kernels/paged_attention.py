"""Attention of a few query rows per sequence over the paged KV cache (``paged_attention.cpp``).

Owns: calling the kernel for decode / verification queries — each query row names the row of the
flat query it is, its sequence's row of the slot table and how many of those keys it sees (causal:
up to its own position) — and the test of whether a batch can take this path.
Ignores: how slots and rows are laid out for a batch (``cluster.models.runner``), prefills (many
queries: torch's scaled_dot_product_attention is the better kernel there).
"""
from __future__ import annotations

import torch

from cluster.kernels.native import row_ops


def applies(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``paged_attention`` takes these tensors: float32 contiguous CPU, head size a multiple of 8."""
    return (q.dtype == torch.float32 and k_cache.dtype == torch.float32 and q.device.type == "cpu"
            and q.shape[-1] % 8 == 0 and k_cache.is_contiguous() and row_ops())


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                    rows: torch.Tensor, seq: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D]; k_cache, v_cache [S, Hkv, D]; slots [G, L] int64; rows, seq, keys [N] int64 ->
    [N, H * D]: query ``rows[n]`` attends to the keys and values at ``slots[seq[n], :keys[n]]``."""
    return torch.ops.specserve.paged_attention(q.contiguous(), k_cache, v_cache, slots, rows, seq, keys, scale)
