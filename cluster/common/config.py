"""Internal engine configuration (dataclasses validated on construction).

Owns: every knob of one engine instance (model, dtype, KV pool, batching budgets, speculation).
Ignores: how the service or CLI parse them (pydantic / argparse live at the user boundary).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class DType(enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"

    @property
    def torch(self):
        import torch

        return {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16}[self]


AUTO_K = "auto"


@dataclass(slots=True)
class SpecConfig:
    """Speculative decoding. drafter: "ngram", "suffix", "portfolio", "self" / "self:L" (first L target layers), "eagle:DIR" (a trained head), or a model
    spec sharing the target vocabulary. num_spec_tokens: fixed K, or "auto" (adaptive K in [0, k_max])."""

    drafter: str = "ngram"
    num_spec_tokens: int | str = AUTO_K
    k_max: int = 6
    ngram_min: int = 1
    ngram_max: int = 4
    draft_vocab_trim: int | None = None  # keep the N most frequent tokens in the draft LM head
    force_vocab_mismatch: bool = False
    moe_validated: bool = False  # MoE targets speculate only after an acceptance measurement
    # live MoE gate per segment (cluster.speculative.moe): probe draft tokens per measurement window, and
    # the α a window must reach to open its segment ("auto": adaptive K's break-even, else 0.5)
    moe_min_draft_tokens: int = 256
    moe_alpha_threshold: float | str = AUTO_K

    def __post_init__(self) -> None:
        if not self.drafter:
            raise ValueError("spec.drafter must be set (ngram, suffix, portfolio, self[:L] or a draft model)")
        if isinstance(self.num_spec_tokens, str):
            if self.num_spec_tokens != AUTO_K:
                try:
                    self.num_spec_tokens = int(self.num_spec_tokens)
                except ValueError:
                    raise ValueError(f"num_spec_tokens must be an integer or 'auto', got {self.num_spec_tokens!r}")
        if isinstance(self.num_spec_tokens, int):
            if not 0 <= self.num_spec_tokens <= 16:
                raise ValueError(f"num_spec_tokens must be in [0, 16], got {self.num_spec_tokens}")
            self.k_max = max(self.k_max, self.num_spec_tokens)
        if not 1 <= self.k_max <= 16:
            raise ValueError(f"k_max must be in [1, 16], got {self.k_max}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.moe_min_draft_tokens < 1:
            raise ValueError(f"moe_min_draft_tokens must be >= 1, got {self.moe_min_draft_tokens}")
        if self.moe_alpha_threshold != AUTO_K and (isinstance(self.moe_alpha_threshold, (str, bool))
                                                   or not 0.0 <= self.moe_alpha_threshold <= 1.0):
            raise ValueError(f"moe_alpha_threshold must be 'auto' or in [0, 1], got {self.moe_alpha_threshold!r}")

    @property
    def adaptive(self) -> bool:
        return self.num_spec_tokens == AUTO_K


@dataclass(slots=True)
class EngineConfig:
    model: str = "default"
    dtype: DType | str = DType.FLOAT32
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_mb
    kv_cache_memory_mb: int = 512
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    max_queue: int = 1024
    max_model_len: int | None = None  # None: the model's own context length
    torch_threads: int | None = None
    spec: SpecConfig | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            try:
                self.dtype = DType(self.dtype)
            except ValueError:
                raise ValueError(f"dtype must be one of {[d.value for d in DType]}, got {self.dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be >= 2")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_queue < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_queue must be >= 1")
        if isinstance(self.spec, dict):
            self.spec = SpecConfig(**self.spec)
