"""What one KVSync caller may ask of a DraftServer, and the gRPC message sizes that follow.

Owns: ``KVSyncLimits`` — draft tokens per sequence (K, at most ``MAX_DRAFT_TOKENS``), sequences
per Propose (the engine's batch), committed tokens per sequence (the model's context), sequences
held per caller (LRU past it) and callers held, the q width (vocabulary), the target feature width
(an EAGLE DraftServer) — and the message size bounds derived from them (a Propose reply carries at
most batch × K rows of q, float32; a request at most every committed position's features, float32),
so the server never accepts or builds a message bigger than a legitimate engine can need.
Ignores: enforcing them (``cluster.kvsync.server``), auth and TLS.
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.common.config import MAX_DRAFT_TOKENS  # the protocol caps K as every setting does

_PER_TOKEN_BYTES = 6  # a varint token id (<= 5 bytes) plus slack
_PER_SEQ_BYTES = 512  # seq id (<= MAX_SEQ_ID_CHARS), params, field tags
_OVERHEAD_BYTES = 64 << 10
MAX_SEQ_ID_CHARS = 128
_MAX_FEATURE_BYTES = 4  # a feature value travels as float32 at most
GRPC_MAX_MESSAGE_BYTES = 2**31 - 1  # gRPC's message size limits are int32


@dataclass(frozen=True)
class KVSyncLimits:
    max_draft_tokens: int = MAX_DRAFT_TOKENS  # K per sequence per call
    max_batch: int = 8  # sequences per Propose (and ids per Release/piggybacked releases)
    max_seq_tokens: int = 8192  # committed tokens per sequence (the target's context)
    max_sequences: int = 4096  # sequences held per caller; the least recently used are evicted
    max_callers: int = 16  # callers held; the least recently seen one is forgotten past it
    vocab_size: int = 0  # q row width; 0: the drafter returns no probabilities (n-gram)
    feature_width: int = 0  # target feature values per position; 0: the drafter reads none

    def __post_init__(self) -> None:
        if not 1 <= self.max_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"max_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.max_draft_tokens}")
        for name in ("max_batch", "max_seq_tokens", "max_sequences", "max_callers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab_size < 0 or self.feature_width < 0:
            raise ValueError(f"vocab_size and feature_width must be >= 0, got {self.vocab_size}, {self.feature_width}")

    @property
    def request_bytes(self) -> int:
        """Largest legitimate Propose/Release request: every sequence resent in full (a resync)
        with its features, plus as many piggybacked release ids; at most gRPC's 2 GiB."""
        per_token = _PER_TOKEN_BYTES + _MAX_FEATURE_BYTES * self.feature_width
        per_seq = self.max_seq_tokens * per_token + 2 * _PER_SEQ_BYTES
        return min(self.max_batch * per_seq + _OVERHEAD_BYTES, GRPC_MAX_MESSAGE_BYTES)

    @property
    def response_bytes(self) -> int:
        """Largest legitimate Propose reply: K draft tokens and K rows of float32 q per sequence."""
        per_seq = self.max_draft_tokens * (_PER_TOKEN_BYTES + 4 * self.vocab_size) + _PER_SEQ_BYTES
        return self.max_batch * per_seq + _OVERHEAD_BYTES
