"""Model runner: turns a ragged list of sequence chunks into one forward pass over the block KV
cache.

Owns: the KV storage tensors and the ``KVCacheManager`` of one model, building ``ForwardBatch``
metadata (positions, slot mapping, attention groups with padding masks, logits rows) from
``SeqChunk``s on the CPU and handing it to the model's device, updating each sequence's cached
length after the pass, and the feature tap: when one is installed, every committed full forward
also hands the tap the chosen layers' states of every fed token (an EAGLE drafter reads the
target's features from the verification pass), and is told when a sequence is freed. A tap that
keeps the features of cached prefix blocks (``PrefixFeatures``) lets the engine share prefixes.
Ignores: which chunks to run (scheduler) and what to do with the logits (sampler, verifier).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cluster.models.kv_cache import CachedBlock, KVCacheManager, sizing_num_blocks
from cluster.models.llama import AttentionGroup, ForwardBatch, LlamaModel

# Chunks with more new tokens than this get their own attention group, so that one long prefill
# does not pad every decode row to its length.
_SMALL_Q = 16


@dataclass(slots=True)
class SeqChunk:
    """New tokens of one sequence for this forward pass.

    token_ids are appended at positions [start_pos, start_pos + len); logits are returned for the
    last ``num_logits`` of them (0: mid-prefill chunk, 1: decode / end of prefill, K+1: verify).
    """

    seq_id: str
    token_ids: list[int]
    start_pos: int
    num_logits: int

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(f"{self.seq_id}: empty chunk")
        if not 0 <= self.num_logits <= len(self.token_ids):
            raise ValueError(f"{self.seq_id}: num_logits {self.num_logits} outside [0, {len(self.token_ids)}]")


class FeatureTap(Protocol):
    """Receives the target's features of every committed full forward."""

    feature_layers: tuple[int, ...]  # empty: no features wanted (yet)

    def record(self, chunks: list[SeqChunk], features: torch.Tensor) -> None:
        """features: [sum len(token_ids), len(feature_layers) * hidden] float32, chunk rows in order;
        handed over (a fresh tensor no one writes again: the tap may keep it)."""

    def forget(self, seq_id: str) -> None:
        """The runner freed this sequence: its features are stale."""


class PrefixFeatures(Protocol):
    """A feature tap that can stand in for the forwards a cached prefix skips (prefix caching
    under a drafter that reads the features of every position)."""

    def keep_prefix(self, seq_id: str, blocks: list[CachedBlock]) -> None:
        """These blocks of the sequence were just indexed: keep their positions' features."""

    def adopt_prefix(self, seq_id: str, blocks: list[CachedBlock], in_flight: dict[int, str] | None = None) -> int:
        """A new sequence starts with these cached blocks (from position 0): give it the kept
        features of as many leading ones as it has, then those of the blocks the step being
        scheduled writes for another sequence (``in_flight``: block -> that sequence, their
        features taken from its rows of the same forward); returns how many."""


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int | None, block_size: int,
                 kv_cache_memory_mb: int = 512) -> None:
        self.model = model
        a = model.arch
        if num_blocks is None:
            per_token = 2 * a.num_layers * a.num_kv_heads * a.head_dim * model.embed.element_size()
            num_blocks = sizing_num_blocks(kv_cache_memory_mb * 2**20, block_size, per_token)
        self.kv = KVCacheManager(num_blocks, block_size)
        self.paged_kv = True  # attention reads K/V from the blocks: they can be shared (prefix caching)
        self.k_cache, self.v_cache = model.new_kv_storage(num_blocks * block_size)
        self.vocab_size = a.vocab_size
        self.max_model_len = a.max_position_embeddings
        self.feature_tap: FeatureTap | None = None

    def reserve(self, seq_id: str, total_tokens: int) -> None:
        self.kv.reserve(seq_id, total_tokens)

    def free(self, seq_id: str) -> None:
        self.kv.free(seq_id)
        if self.feature_tap is not None:
            self.feature_tap.forget(seq_id)

    def truncate(self, seq_id: str, length: int) -> None:
        self.kv.truncate(seq_id, length)

    def build_batch(self, chunks: list[SeqChunk]) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        small: list[tuple[int, SeqChunk]] = []  # (first flat row, chunk)
        large: list[tuple[int, SeqChunk]] = []
        for c in chunks:
            row0 = len(ids)
            n = len(c.token_ids)
            if c.start_pos + n > self.max_model_len:
                raise ValueError(f"{c.seq_id}: position {c.start_pos + n} exceeds the model's context {self.max_model_len}")
            ids.extend(c.token_ids)
            positions.extend(range(c.start_pos, c.start_pos + n))
            slots.extend(self.kv.slots(c.seq_id, c.start_pos, c.start_pos + n))
            logits_rows.extend(range(row0 + n - c.num_logits, row0 + n))
            (small if n <= _SMALL_Q else large).append((row0, c))
        T = len(ids)
        if any(t < 0 or t >= self.vocab_size for t in ids):
            bad = next(t for t in ids if t < 0 or t >= self.vocab_size)
            raise ValueError(f"token id {bad} outside the vocabulary [0, {self.vocab_size})")
        groups = [self._group(small, T, paged=True)] if small else []
        groups += [self._group([item], T) for item in large]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            groups=groups,
            logits_index=torch.tensor(logits_rows, dtype=torch.int64),
        )

    def _group(self, items: list[tuple[int, SeqChunk]], T: int, paged: bool = False) -> AttentionGroup:
        """One attention group; ``paged`` (decode / verification rows) also says, per query, its
        sequence's row of the slot table and how many keys it sees (the paged-attention kernel's)."""
        G = len(items)
        q_lens = [len(c.token_ids) for _, c in items]
        ctx_lens = [c.start_pos + len(c.token_ids) for _, c in items]
        qmax, lmax = max(q_lens), max(ctx_lens)
        q_index = torch.full((G, qmax), T, dtype=torch.int64)
        kv_slots = torch.zeros((G, lmax), dtype=torch.int64)
        out_rows, out_src, q_seq, q_keys = [], [], [], []
        for g, (row0, c) in enumerate(items):
            q = q_lens[g]
            q_index[g, :q] = torch.arange(row0, row0 + q)
            kv_slots[g, : ctx_lens[g]] = self.kv.slot_tensor(c.seq_id, ctx_lens[g])
            out_rows.extend(range(row0, row0 + q))
            out_src.extend(range(g * qmax, g * qmax + q))
            q_seq.extend([g] * q)
            q_keys.extend(range(c.start_pos + 1, c.start_pos + q + 1))  # query i sees keys [0, start + i]
        mask = None
        if qmax > 1 or any(n != lmax for n in ctx_lens):
            # query i of sequence g sits at position start+i and sees keys [0, start+i]
            key_pos = torch.arange(lmax).view(1, 1, lmax)  # [1, 1, Lmax]
            starts = torch.tensor([c.start_pos for _, c in items]).view(G, 1, 1)
            q_pos = starts + torch.arange(qmax).view(1, qmax, 1)  # [G, Qmax, 1]
            valid_q = torch.arange(qmax).view(1, qmax, 1) < torch.tensor(q_lens).view(G, 1, 1)
            mask = (key_pos <= q_pos) & valid_q
            mask[:, :, 0] = True  # padding queries attend to key 0 so no row is all -inf (NaN)
            mask = mask.unsqueeze(1)  # [G, 1, Qmax, Lmax]
        row0s = [row0 for row0, _ in items]
        dense = None
        if all(q == qmax for q in q_lens) and row0s == list(range(row0s[0], row0s[0] + G * qmax, qmax)):
            dense = (row0s[0], G, qmax)
        return AttentionGroup(q_index, kv_slots, mask, torch.tensor(out_rows), torch.tensor(out_src), dense,
                              torch.tensor(q_seq) if paged else None, torch.tensor(q_keys) if paged else None)

    def forward(self, chunks: list[SeqChunk], num_layers: int | None = None,
                commit: bool = True) -> torch.Tensor:  # [sum num_logits, V] float32, on the model's device
        """Run one ragged forward. commit=True records the new tokens as cached; a layer-skip
        draft pass uses commit=False (its K/V in those slots get overwritten by verification)."""
        for c in chunks:
            if commit and c.start_pos != self.kv.num_tokens(c.seq_id):
                raise ValueError(f"{c.seq_id}: chunk starts at {c.start_pos} but {self.kv.num_tokens(c.seq_id)} cached")
            self.kv.reserve(c.seq_id, c.start_pos + len(c.token_ids))
        batch = self.build_batch(chunks)
        if self.model.device.type != "cpu":
            batch = batch.to(self.model.device)
        tap = self.feature_tap if commit and num_layers is None else None
        if tap is not None and not tap.feature_layers:  # a KVSync tap before its DraftServer named layers
            tap = None
        if tap is not None:
            logits, feats = self.model.forward_features(batch, self.k_cache, self.v_cache, tap.feature_layers)
        else:
            logits = self.model.forward(batch, self.k_cache, self.v_cache, num_layers=num_layers)
        if commit:
            for c in chunks:
                self.kv.set_num_tokens(c.seq_id, c.start_pos + len(c.token_ids))
        if tap is not None:
            tap.record(chunks, feats)
        return logits
