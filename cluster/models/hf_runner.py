"""Fallback runner on Hugging Face ``transformers`` models, for architectures outside our Llama
family (MoE targets included). Same interface as ``cluster.models.runner.ModelRunner``.

Owns: one HF ``DynamicCache`` per sequence, kept in step with the same ``KVCacheManager`` block
accounting the scheduler uses (so memory pressure and preemption behave the same), rollback by
cropping the cache. Runs sequences one by one: slower than the native runner, but correct.
Ignores: layer-skip drafting (not offered on this runner).
"""
from __future__ import annotations

import torch

from cluster.models.kv_cache import KVCacheManager, sizing_num_blocks
from cluster.models.runner import SeqChunk


class HFRunner:
    def __init__(self, model, num_blocks: int | None, block_size: int, kv_cache_memory_mb: int = 512) -> None:
        self.model = model.eval()
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_model_len = int(getattr(cfg, "max_position_embeddings", 4096))
        if num_blocks is None:
            layers = int(getattr(cfg, "num_hidden_layers", 1))
            heads = int(getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", 1))
            head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
            per_token = 2 * layers * heads * head_dim * next(model.parameters()).element_size()
            num_blocks = sizing_num_blocks(kv_cache_memory_mb * 2**20, block_size, per_token)
        self.kv = KVCacheManager(num_blocks, block_size)
        self._caches: dict[str, object] = {}

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def reserve(self, seq_id: str, total_tokens: int) -> None:
        self.kv.reserve(seq_id, total_tokens)

    def free(self, seq_id: str) -> None:
        self.kv.free(seq_id)
        self._caches.pop(seq_id, None)

    def truncate(self, seq_id: str, length: int) -> None:
        self.kv.truncate(seq_id, length)
        cache = self._caches.get(seq_id)
        if cache is not None:
            _crop(cache, length, self._caches, seq_id)

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], num_layers: int | None = None,
                commit: bool = True) -> torch.Tensor:  # [sum num_logits, V] float32
        if num_layers is not None:
            raise ValueError("layer-skip drafting needs the native Llama-family runner")
        from transformers import DynamicCache

        outs = []
        for c in chunks:
            if commit and c.start_pos != self.kv.num_tokens(c.seq_id):
                raise ValueError(f"{c.seq_id}: chunk starts at {c.start_pos} but {self.kv.num_tokens(c.seq_id)} cached")
            bad = [t for t in c.token_ids if t < 0 or t >= self.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
            self.kv.reserve(c.seq_id, c.start_pos + len(c.token_ids))
            cache = self._caches.get(c.seq_id)
            if cache is None or c.start_pos == 0:
                cache = DynamicCache()
                self._caches[c.seq_id] = cache
            if cache.get_seq_length() > c.start_pos:
                cache = _crop(cache, c.start_pos, self._caches, c.seq_id)
            ids = torch.tensor([c.token_ids], dtype=torch.int64)  # [1, Q]
            pos = torch.arange(c.start_pos, c.start_pos + len(c.token_ids)).unsqueeze(0)
            out = self.model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True)
            if c.num_logits:
                outs.append(out.logits[0, -c.num_logits :].float())  # [num_logits, V]
            if commit:
                self.kv.set_num_tokens(c.seq_id, c.start_pos + len(c.token_ids))
        if not outs:
            return torch.empty(0, self.vocab_size)
        return torch.cat(outs)


def _crop(cache, length: int, caches: dict, seq_id: str):
    """Keep the first ``length`` tokens of an HF cache (newer transformers take a negative count)."""
    from transformers import DynamicCache

    have = cache.get_seq_length()
    if have <= length:
        return cache
    if length == 0:
        caches[seq_id] = DynamicCache()
        return caches[seq_id]
    cache.crop(length - have)
    return cache
