"""Continuous batching scheduler.

Owns: the waiting queue and the running set, and per step which sequences run with how many new
tokens under the token and sequence budgets: running sequences first (decode, or the K+1 tokens
of a verification when the caller asks for num_draft_tokens), then waiting ones admitted FIFO as
(chunked) prefills. Reserves KV blocks for everything it schedules; when the pool is full it
preempts the most recently admitted sequence (frees its blocks; it recomputes later) instead of
failing or deadlocking. With prefix caching, a sequence admitted (or readmitted after preemption)
first takes the cached blocks of its prefix (``share_prefix``: the engine decides what may be
shared), and only the rest is prefilled; the blocks a step will fill are indexed as it is
scheduled, so a sequence admitted later in the same step shares them too. Ignores: model execution, sampling and acceptance.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from cluster.engine.sequence import Sequence, SeqStatus
from cluster.models.kv_cache import KVCacheManager


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens of seq.token_ids[num_cached:] fed this step
    samples: bool  # the chunk reaches the end of the known tokens: a token is produced
    num_draft_tokens: int  # K: KV slots reserved for draft tokens after the new tokens (0: plain)


@dataclass(slots=True)
class SchedulerBudget:
    max_num_seqs: int
    max_num_batched_tokens: int


class Scheduler:
    def __init__(self, kv: KVCacheManager, budget: SchedulerBudget,
                 on_preempt: Callable[[Sequence], None] | None = None,
                 share_prefix: Callable[[Sequence], int] | None = None) -> None:
        self.kv = kv
        self.budget = budget
        # holds the cached blocks of a sequence's prefix for it, returns the tokens they cover
        self._share_prefix = share_prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order, oldest first
        self.num_preemptions = 0
        self._on_preempt = on_preempt

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, num_draft_tokens: Callable[[Sequence], int] = lambda s: 0) -> list[ScheduledSeq]:
        tokens_left = self.budget.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        preemptions_before = self.num_preemptions
        # 1. running sequences, oldest first (they hold blocks already)
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if tokens_left <= 0:
                break
            pending = seq.num_pending_tokens
            chunk = min(pending, tokens_left)
            samples = chunk == pending
            k = min(num_draft_tokens(seq), tokens_left - chunk) if samples else 0
            k = max(0, k)
            while not self.kv.can_reserve(seq.seq_id, seq.num_cached + chunk + k):
                if k > 0:
                    k = 0  # speculation is the first thing to give up under memory pressure
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:  # preempted itself
                continue
            self.kv.reserve(seq.seq_id, seq.num_cached + chunk + k)
            self._index(seq, chunk)
            out.append(ScheduledSeq(seq, chunk, samples, k))
            tokens_left -= chunk + k
            i += 1
        # 2. admit waiting sequences FIFO while budgets and free blocks allow (not in a step that
        #    had to preempt: the pool is tight and re-admitting the victim would only thrash)
        while (self.num_preemptions == preemptions_before and self.waiting and tokens_left > 0
               and len(self.running) < self.budget.max_num_seqs):
            seq = self.waiting[0]
            if seq.num_cached == 0 and self._share_prefix is not None:
                seq.num_cached = self._share_prefix(seq)
            pending = seq.num_pending_tokens
            chunk = min(pending, tokens_left)
            if not self.kv.can_reserve(seq.seq_id, seq.num_cached + chunk):
                if seq.num_cached:  # give the shared blocks back: admitted later, it matches again
                    self.kv.free(seq.seq_id)
                    seq.num_cached = 0
                break
            self.waiting.popleft()
            self.kv.reserve(seq.seq_id, seq.num_cached + chunk)
            self._index(seq, chunk)
            if seq.num_preemptions == 0:  # the prompt tokens its first admission did not prefill
                seq.num_prompt_cached = min(seq.num_cached, seq.prompt_len)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, chunk, chunk == pending, 0))
            tokens_left -= chunk
        return out

    def _index(self, seq: Sequence, chunk: int) -> None:
        """Sharing prefixes: the blocks this step fills with the sequence's known tokens are
        indexed now, so a sequence admitted after it in the same step shares them (the caller
        settles them after the forward: ``KVCacheManager.settle_scheduled``)."""
        if self._share_prefix is not None:
            self.kv.index_scheduled(seq.seq_id, seq.token_ids, seq.num_cached + chunk)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop its KV, keep its tokens, queue it first."""
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.num_cached = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        if self._on_preempt is not None:
            self._on_preempt(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.kv.free(seq.seq_id)
