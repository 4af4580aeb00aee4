"""Synchronous engine: one ``step()`` = schedule -> propose -> forward -> verify -> commit -> emit,
the loop of arXiv 2211.17192 over a continuous batch, each phase a method of a few lines.

Owns: request admission and validation against the model's limits, the step loop body, turning
committed tokens into ``RequestOutput`` deltas, aborts, and engine statistics. A request is a unit
of failure: an exception traced to one sequence (its sampling row, its verification, its
detokenizer / stop check) finishes that sequence alone with ``FinishReason.ERROR`` and a message
in ``RequestOutput.error``, frees its KV, and leaves every other sequence's tokens unchanged; a
forward pass that raises fails the sequences it carried (``cluster.engine.faults``). A constrained
request (json_schema / regex) gets its grammar matcher at admission (``cluster.engine.grammar``,
compiled on the step thread) and samples under its mask on the plain path; a matcher error is
that sequence's fault. Speculation is
delegated to a ``SpecController`` (``cluster.engine.speculation``) when configured — it owns
K, the drafts (one ``StepDrafts`` from propose to verify), verification and the per-segment
speculation statistics (α); without one every sequence decodes plainly. Ignores: threads and
asyncio (``cluster.engine.async_engine``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from cluster.common.config import EngineConfig
from cluster.common.errors import InvalidRequestError
from cluster.common.request import (
    FinishReason, GenerationRequest, Logprob, ModelLimits, RequestOutput, SpecMode, TokenLogprobs,
)
from cluster.engine.detokenizer import Detokenizer
from cluster.engine.drafts import SeqDraft, StepDrafts, Verdict
from cluster.engine.faults import FaultStage, SeqFault, fault, per_row
from cluster.engine.grammar import GrammarCompiler
from cluster.engine.protocol import EngineStats
from cluster.engine.scheduler import ScheduledSeq, Scheduler, SchedulerBudget
from cluster.engine.sequence import Sequence
from cluster.engine.target_rows import process_rows
from cluster.models.kv_cache import CachedBlock
from cluster.models.load import LoadedModel
from cluster.models.runner import SeqChunk
from cluster.sampling.logprobs import token_logprobs
from cluster.sampling.sampler import sample
from cluster.telemetry.engine_spans import start_request_trace


@dataclass(slots=True, frozen=True)
class TargetPass:
    """One target forward over every scheduled chunk and its drafts."""

    logits: torch.Tensor  # [sum(K_i + 1), V]: the sampling sequences' rows, in batch order
    seconds: float
    num_tokens: int  # tokens fed (prefill chunks + new tokens + drafts)
    # per sequence that asked for prompt_logprobs and was owed some in this pass: the positions
    # and their rows ([len(positions), V]; the row at position p is prompt token p + 1's)
    prompt_rows: dict[str, tuple[range, torch.Tensor]] = field(default_factory=dict)


log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, model: LoadedModel, spec=None) -> None:
        self.config = config
        self.model = model
        self.runner = model.runner
        self.tokenizer = model.tokenizer
        self.spec = spec  # SpecController | None
        self.max_model_len = min(config.max_model_len or self.runner.max_model_len, self.runner.max_model_len)
        if config.prefix_caching and getattr(self.runner, "paged_kv", False):
            self.runner.kv.enable_prefix_caching()  # the runner reads K/V from the blocks themselves
        self.scheduler = Scheduler(
            self.runner.kv,
            SchedulerBudget(config.max_num_seqs, config.max_num_batched_tokens),
            on_preempt=self._on_preempt,
            share_prefix=self._share_prefix,
        )
        self.seqs: dict[str, Sequence] = {}
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size, model.eos_token_ids,
                                        time_limit_s=config.grammar_compile_s)

    # -- admission ----------------------------------------------------------------------------
    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(self.runner.vocab_size, self.max_model_len,
                           self.runner.kv.num_blocks * self.runner.kv.block_size)

    def validate(self, request: GenerationRequest) -> None:
        self.limits.check(request)
        if request.request_id in self.seqs:
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}")

    def add_request(self, request: GenerationRequest) -> None:
        """Admit a request; a constraint is compiled here (the step thread, never an event
        loop), InvalidRequestError when it is unsupported or over the compile limits."""
        self.validate(request)
        speculate = (self.spec is not None and request.mode is not SpecMode.PLAIN
                     and not request.params.scores_only)
        grammar = self.grammars.matcher(request.constraint) if request.constraint is not None else None
        seq = Sequence(
            request=request,
            detok=Detokenizer(self.tokenizer, request.params.stop),
            eos_token_ids=self.model.eos_token_ids,
            speculate=speculate,
            grammar=grammar,
        )
        if request.params.prompt_logprobs is not None:  # the first prompt token: nothing before it
            seq.pending_prompt_logprobs.append(TokenLogprobs(Logprob(request.prompt_token_ids[0], None)))
        seq.trace = start_request_trace(request.trace_carrier, request.request_id,
                                        engine="spec" if self.spec is not None else "batch",
                                        segment=request.segment,
                                        drafter=self.spec.config.drafter_for(request.segment) if speculate else None)
        self.seqs[request.request_id] = seq
        self.scheduler.add(seq)

    def _share_prefix(self, seq: Sequence) -> int:
        """Hold the cached blocks of ``seq``'s prefix for it; returns the tokens they cover. None
        when the prefill's rows are owed (its prompt's log-probabilities). Under a feature tap (a
        drafter that reads the target's features of every position: EAGLE) only as many leading
        blocks as the tap has features for (kept, or the rows of the forward that writes them in
        this step), and none under a tap that cannot stand in for a prefix (no ``adopt_prefix``)."""
        if seq.request.params.prompt_logprobs is not None:
            return 0
        tap = getattr(self.runner, "feature_tap", None)
        adopt = getattr(tap, "adopt_prefix", None)
        if tap is not None and adopt is None:
            return 0
        kv = self.runner.kv
        cached = kv.match_prefix(seq.seq_id, seq.token_ids)
        if cached and adopt is not None:
            blocks = kv.prefix_blocks(seq.seq_id)
            kept = adopt(seq.seq_id, blocks, kv.in_flight())  # (blocks this step writes: borrowed)
            if kept < len(blocks):  # give back the blocks past the features the tap has
                if kept:
                    kv.truncate(seq.seq_id, blocks[kept].start)
                else:
                    kv.free(seq.seq_id)
                cached = blocks[kept].start
        return cached

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        seq.finish(FinishReason.CANCELLED)
        return self._retire(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self._schedule()  # 1. which sequences run, with K draft slots each
        if not batch:
            return []
        written = False  # did the forward write the blocks indexed as they were scheduled?
        try:
            drafts = self._propose(batch)  # 2. K_i draft tokens per speculating sequence
            try:
                target = self._forward(batch, drafts)  # 3. one target pass over chunks + drafts
            except Exception as exc:  # noqa: BLE001 (no one sequence to blame: fail those it carried)
                return [self.fail(s.seq, fault(FaultStage.FORWARD, exc, s.seq.seq_id).message) for s in batch]
            written = True
        finally:
            indexed = self.runner.kv.settle_scheduled(written)  # unwritten: unindexed
        self._keep_prefix_features(indexed)
        verdicts = self._verify(batch, drafts, target)  # 4. accepted prefix + recovered/bonus token
        self._commit(batch, drafts, verdicts, target)  # 5. advance KV and tokens
        return self._emit(batch)  # 6. deltas and finished outputs

    def _schedule(self) -> list[ScheduledSeq]:
        num_draft_tokens = (lambda seq: 0)  # noqa: E731 (the plain path's; speculation's below)
        if self.spec is not None:
            self.spec.plan(self.scheduler.running)
            num_draft_tokens = self.spec.num_draft_tokens
        scheduled = self.scheduler.schedule(num_draft_tokens)
        now = time.monotonic()
        for s in scheduled:
            if s.seq.request.params.scores_only:  # its prefill's end samples nothing: it finishes there
                s.samples = False
            if s.seq.scheduled_at is None:
                s.seq.scheduled_at = now
                s.seq.trace.admitted()
        return scheduled

    def _propose(self, batch: list[ScheduledSeq]) -> StepDrafts:
        return self.spec.propose(batch) if self.spec is not None else StepDrafts()

    def _forward(self, batch: list[ScheduledSeq], drafts: StepDrafts) -> TargetPass:
        """Each chunk feeds its new tokens + its drafts and asks for K_i + 1 logits rows when it
        samples (0 for a prefill chunk that samples nothing yet); a chunk owed prompt
        log-probabilities asks for every row from the first owed position on, and those rows are
        split off (``TargetPass.prompt_rows``) so the rest is the sampling rows alone."""
        chunks, owed = [], []  # owed: per chunk, (positions owed, rows asked, sampling rows)
        for s in batch:
            seq = s.seq
            start, end = seq.num_cached, seq.num_cached + s.num_new_tokens
            new = seq.token_ids[start:end]
            d = drafts.token_ids(seq.seq_id)
            sampling = len(d) + 1 if s.samples else 0
            positions = seq.prompt_rows(start, end)
            asked = (end - positions.start + len(d)) if positions else sampling
            chunks.append(SeqChunk(seq.seq_id, new + d, start, asked))
            owed.append((positions, asked, sampling))
        t0 = time.perf_counter()
        logits = self.runner.forward(chunks)  # [sum(asked), V]
        seconds = time.perf_counter() - t0
        num_tokens = sum(len(c.token_ids) for c in chunks)
        if not any(positions for positions, _, _ in owed):
            return TargetPass(logits, seconds, num_tokens)
        keep, prompt_rows, row = [], {}, 0
        for c, (positions, asked, sampling) in zip(chunks, owed):
            if positions:
                prompt_rows[c.seq_id] = (positions, logits[row : row + len(positions)])
            keep.extend(range(row + asked - sampling, row + asked))
            row += asked
        index = torch.tensor(keep, dtype=torch.int64, device=logits.device)
        return TargetPass(logits.index_select(0, index), seconds, num_tokens, prompt_rows)

    def _verify(self, batch: list[ScheduledSeq], drafts: StepDrafts, target: TargetPass) -> list[Verdict | SeqFault]:
        """Per sampling sequence (batch order) its committed tokens and accepted count, or its fault."""
        sampling = [s for s in batch if s.samples]
        if drafts:
            return self.spec.verify(target.logits, sampling, drafts, target.seconds, target.num_tokens)
        t0 = time.perf_counter()
        verdicts = self._sample(target.logits, sampling)
        if self.spec is not None:
            self.spec.observe_plain_step(target.seconds, target.num_tokens,
                                         time.perf_counter() - t0 if sampling else None)
        return verdicts

    def _sample(self, logits: torch.Tensor, sampling: list[ScheduledSeq]) -> list[Verdict | SeqFault]:
        """Plain step: one token per sampling sequence (logits [len(sampling), V]), each from its
        row as its request shapes it (bias, penalties, a grammar's mask: ``process_rows``; a
        matcher error fails that sequence alone)."""
        def run(rows: list[int]) -> list[Verdict]:
            seqs = [sampling[r] for r in rows]
            rows_logits = process_rows(logits[rows], seqs, StepDrafts())  # [len(rows), V]
            tokens = sample(rows_logits, [q.seq.request.params for q in seqs], [len(q.seq.token_ids) for q in seqs])
            return [([int(t)], 0) for t in tokens]

        return per_row(len(sampling), run, FaultStage.SAMPLE, [s.seq.seq_id for s in sampling])

    def _commit(self, batch: list[ScheduledSeq], drafts: StepDrafts, verdicts: list[Verdict | SeqFault],
                target: TargetPass) -> None:
        """Advance every scheduled sequence by what it committed; a fault (its verdict, its
        log-probabilities, or its detokenizer / stop check here) fails that sequence alone.
        target.logits: [sum(K_i + 1), V], the sampling sequences' rows in batch order."""
        logits = target.logits
        verdict = iter(verdicts)
        row = 0  # the sequence's first row in logits
        for s in batch:
            owed = target.prompt_rows.get(s.seq.seq_id)
            if owed is not None:
                try:
                    self._score_prompt(s.seq, *owed)
                except Exception as exc:  # noqa: BLE001 (a non-finite row: this sequence's fault)
                    s.seq.fail(fault(FaultStage.COMMIT, exc, s.seq.seq_id).message)
            if not s.samples:  # a prefill chunk that samples nothing (yet, or ever: scores_only)
                s.seq.num_cached += s.num_new_tokens
                if s.seq.request.params.scores_only and s.seq.num_cached >= s.seq.prompt_len:
                    s.seq.finish(FinishReason.LENGTH)  # scored: the budget was no output
                continue
            draft = drafts.get(s.seq.seq_id)
            rows = logits[row : row + (0 if draft is None else draft.k) + 1]  # [K_i + 1, V]
            row += rows.shape[0]
            v = next(verdict)
            if isinstance(v, SeqFault):
                s.seq.fail(v.message)
                continue
            if s.seq.finished:  # its prompt's log-probabilities failed it above
                s.seq.num_cached += s.num_new_tokens
                continue
            try:
                self._commit_one(s, v, draft, rows)
            except Exception as exc:  # noqa: BLE001 (its detokenizer / stop check: its own fault)
                s.seq.fail(fault(FaultStage.COMMIT, exc, s.seq.seq_id).message)

    def _commit_one(self, s: ScheduledSeq, verdict: Verdict, draft: SeqDraft | None, rows: torch.Tensor) -> None:
        """rows: [K_i + 1, V] the target rows of this step; row j chose committed token j."""
        seq = s.seq
        committed, accepted = verdict
        num_top = seq.request.params.logprobs
        logprobs = None if num_top is None else token_logprobs(rows[: len(committed)], committed, num_top)
        seq.num_cached += s.num_new_tokens + accepted
        self.runner.truncate(seq.seq_id, seq.num_cached)  # drop the K/V of rejected drafts
        if draft is not None:
            seq.spec.record(draft.k, accepted, draft.num_forced)
            seq.trace.step(draft.k, accepted, self.spec.drafted_by(seq.seq_id) if self.spec is not None else None)
        seq.append_committed(committed, logprobs)
        indexed = self.runner.kv.cache_prefix(seq.seq_id, seq.token_ids, seq.num_cached)  # accepted drafts' blocks
        self._keep_prefix_features([(seq.seq_id, b) for b in indexed])
        seq.trace.prefill_done()  # idempotent: marks the first token only

    def _keep_prefix_features(self, indexed: list[tuple[str, CachedBlock]]) -> None:
        """Blocks the KV cache indexed once their K/V were written: a feature tap that stands in
        for shared prefixes keeps their features (the forward that wrote them recorded those)."""
        keep = getattr(getattr(self.runner, "feature_tap", None), "keep_prefix", None)
        if not indexed or keep is None:
            return
        by_seq: dict[str, list[CachedBlock]] = {}
        for seq_id, block in indexed:
            by_seq.setdefault(seq_id, []).append(block)
        for seq_id, blocks in by_seq.items():
            keep(seq_id, blocks)

    @staticmethod
    def _score_prompt(seq: Sequence, positions: range, rows: torch.Tensor) -> None:
        """rows: [len(positions), V]; the row at position p gives prompt token p + 1 its
        log-probability (``SamplingParams.prompt_logprobs``), reported with the first output after
        the first token's entry (it has none: ``add_request`` puts it first)."""
        tokens = seq.token_ids[positions.start + 1 : positions.stop + 1]
        seq.pending_prompt_logprobs.extend(token_logprobs(rows, tokens, seq.request.params.prompt_logprobs))
        seq.num_prompt_scored = positions.stop

    def _emit(self, batch: list[ScheduledSeq]) -> list[RequestOutput]:
        """A finished sequence's last output (it is retired), else its delta if it has one."""
        outputs: list[RequestOutput] = []
        for s in batch:
            if s.seq.finished:
                outputs.append(self._retire(s.seq))
            elif s.seq.pending_ids or s.seq.pending_text:
                outputs.append(self._delta(s.seq))
        return outputs

    def fail(self, seq: Sequence, message: str) -> RequestOutput:
        """Finish one sequence with FinishReason.ERROR and ``message`` (its KV freed)."""
        seq.fail(message)
        return self._retire(seq)

    # -- outputs ------------------------------------------------------------------------------
    def _delta(self, seq: Sequence) -> RequestOutput:
        out = RequestOutput(
            request_id=seq.seq_id,
            new_token_ids=seq.pending_ids,
            text_delta=seq.pending_text,
            logprobs=seq.pending_logprobs,
            prompt_logprobs=seq.pending_prompt_logprobs,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.prompt_len,
            num_output_tokens=seq.num_output,
            num_cached_tokens=seq.num_prompt_cached,
            spec=seq.spec if seq.speculate else None,
            error=seq.error if seq.finish_reason is FinishReason.ERROR else None,
        )
        seq.pending_ids, seq.pending_text, seq.pending_logprobs, seq.pending_prompt_logprobs = [], "", [], []
        return out

    def _retire(self, seq: Sequence) -> RequestOutput:
        self.scheduler.remove(seq)
        self.seqs.pop(seq.seq_id, None)
        self._release_draft(seq)
        out = self._delta(seq)
        start = seq.scheduled_at if seq.scheduled_at is not None else time.monotonic()
        out.queue_time = start - seq.arrival
        out.first_token_time = (seq.first_token_at - seq.arrival) if seq.first_token_at else None
        out.finish_time = time.monotonic() - seq.arrival
        seq.trace.finish(seq.finish_reason, seq.num_output, seq.prompt_len)  # spans built off-thread
        return out

    def _on_preempt(self, seq: Sequence) -> None:
        seq.trace.preempted()
        self._release_draft(seq)

    def _release_draft(self, seq: Sequence) -> None:
        if self.spec is None:
            return
        try:
            self.spec.release(seq.seq_id)
        except Exception:  # noqa: BLE001 (a drafter's bookkeeping must not fail the request)
            log.exception("releasing draft state of %s failed", seq.seq_id)

    def stats(self) -> EngineStats:
        kv = self.runner.kv
        st = EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=kv.num_blocks,
            kv_blocks_free=kv.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix.queries if kv.prefix is not None else 0,
            prefix_cache_hits=kv.prefix.hits if kv.prefix is not None else 0,
        )
        if self.spec is not None:
            self.spec.fill_stats(st)
        return st
