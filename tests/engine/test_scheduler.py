"""Scheduler bookkeeping without a model: the token and sequence budgets, decodes before prefills,
chunked prefill of long prompts, and recompute preemption when the KV pool runs out."""
from __future__ import annotations

from cluster.common.request import GenerationRequest, SamplingParams
from cluster.engine.scheduler import Scheduler, SchedulerBudget
from cluster.engine.sequence import Sequence, SeqStatus
from cluster.models.kv_cache import KVCacheManager


class _NoDetok:
    def add(self, *a, **k):  # never reached: these tests append no tokens through a Sequence
        raise AssertionError("no detokenization in scheduler tests")


def seq(rid: str, prompt_len: int) -> Sequence:
    req = GenerationRequest(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=8))
    return Sequence(req, _NoDetok(), frozenset(), speculate=False)


def run_step(sched: Scheduler, sampled: int = 7) -> list[tuple[str, int, bool, int]]:
    """Schedule one step and play the model: cache what was fed, append one token per sampler."""
    plan = sched.schedule()
    for s in plan:
        s.seq.num_cached += s.num_new_tokens
        sched.kv.set_num_tokens(s.seq.seq_id, s.seq.num_cached)
        if s.samples:
            s.seq.token_ids.append(sampled)
    return [(s.seq.seq_id, s.num_new_tokens, s.samples, s.num_draft_tokens) for s in plan]


def test_long_prompt_is_prefilled_in_chunks_while_decodes_keep_running():
    sched = Scheduler(KVCacheManager(64, 16), SchedulerBudget(max_num_seqs=4, max_num_batched_tokens=32))
    a = seq("a", 10)
    sched.add(a)
    assert run_step(sched) == [("a", 10, True, 0)]  # whole prompt fits: prefill + first token
    b = seq("b", 70)
    sched.add(b)
    # every step: a's decode first (1 token), then b's prompt in chunks of what the budget leaves
    assert run_step(sched) == [("a", 1, True, 0), ("b", 31, False, 0)]
    assert run_step(sched) == [("a", 1, True, 0), ("b", 31, False, 0)]
    assert run_step(sched) == [("a", 1, True, 0), ("b", 8, True, 0)]  # last chunk samples
    assert run_step(sched) == [("a", 1, True, 0), ("b", 1, True, 0)]
    assert b.num_cached == 71 and a.num_cached == 14


def test_budget_never_exceeded_and_sequences_capped():
    budget = SchedulerBudget(max_num_seqs=3, max_num_batched_tokens=20)
    sched = Scheduler(KVCacheManager(256, 16), budget)
    for i in range(6):
        sched.add(seq(f"r{i}", 15))
    for _ in range(12):
        plan = run_step(sched)
        assert sum(n + k for _, n, _, k in plan) <= budget.max_num_batched_tokens
        assert len(sched.running) <= budget.max_num_seqs
    assert [s.seq_id for s in sched.running] == ["r0", "r1", "r2"]  # FIFO admission
    assert [s.seq_id for s in sched.waiting] == ["r3", "r4", "r5"]


def test_draft_slots_only_when_the_chunk_samples_and_the_budget_allows():
    sched = Scheduler(KVCacheManager(64, 16), SchedulerBudget(max_num_seqs=2, max_num_batched_tokens=8))
    sched.add(seq("a", 4))
    run_step(sched)
    plan = sched.schedule(num_draft_tokens=lambda s: 5)
    assert [(p.num_new_tokens, p.num_draft_tokens) for p in plan] == [(1, 5)]
    plan = sched.schedule(num_draft_tokens=lambda s: 50)  # clipped to what the token budget leaves
    assert [(p.num_new_tokens, p.num_draft_tokens) for p in plan] == [(1, 7)]


def test_full_pool_preempts_the_newest_and_it_recomputes_later():
    kv = KVCacheManager(4, 4)  # 16 token slots in all
    sched = Scheduler(kv, SchedulerBudget(max_num_seqs=4, max_num_batched_tokens=64))
    old, new = seq("old", 7), seq("new", 7)
    sched.add(old)
    sched.add(new)
    assert run_step(sched) == [("old", 7, True, 0), ("new", 7, True, 0)]  # 2 blocks each
    run_step(sched)  # 8 cached tokens each: the pool is exactly full
    assert kv.num_free_blocks == 0
    # the next decode needs a fifth block: the newest sequence gives its blocks back
    assert run_step(sched) == [("old", 1, True, 0)]
    assert new.status is SeqStatus.WAITING and new.num_cached == 0 and sched.num_preemptions == 1
    assert list(sched.waiting) == [new] and len(new.token_ids) == 9  # tokens kept for recompute
    sched.remove(old)
    assert kv.num_free_blocks == 4
    assert run_step(sched) == [("new", 9, True, 0)]  # whole sequence recomputed in one chunk


def test_admission_takes_a_cached_prefix_and_gives_it_back_when_the_rest_does_not_fit():
    kv = KVCacheManager(4, 4)
    kv.enable_prefix_caching()
    sched = Scheduler(kv, SchedulerBudget(max_num_seqs=4, max_num_batched_tokens=64),
                      share_prefix=lambda s: kv.match_prefix(s.seq_id, s.token_ids))
    a = seq("a", 9)
    sched.add(a)
    assert run_step(sched) == [("a", 9, True, 0)]
    kv.cache_prefix("a", a.token_ids, a.num_cached)  # the engine indexes committed blocks after each step
    sched.remove(a)  # finished: its two full blocks stay cached (and free)
    b = seq("b", 10)  # the same first 9 tokens, then its own
    sched.add(b)
    assert run_step(sched) == [("b", 2, True, 0)]  # 8 tokens from the cache, 2 prefilled
    assert b.num_prompt_cached == 8 and kv.num_free_blocks == 1
    # d shares the first block (its 8 tokens leave one to compute: 4 cached) and takes the last
    # free block; c would share b's two blocks but needs a third, and none is left
    c, d = seq("c", 9), seq("d", 8)
    sched.add(d)
    sched.add(c)
    assert run_step(sched) == [("b", 1, True, 0), ("d", 4, True, 0)] and kv.num_free_blocks == 0
    assert c.status is SeqStatus.WAITING and c.num_cached == 0 and not kv.has("c")  # gave the shared blocks back
    never = Scheduler(KVCacheManager(4, 4), SchedulerBudget(4, 64))  # no share_prefix: nothing shared
    e = seq("e", 9)
    never.add(e)
    assert run_step(never) == [("e", 9, True, 0)] and e.num_prompt_cached == 0
