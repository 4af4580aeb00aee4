"""Speculation inside one engine step: which sequences draft how many tokens, asking the
drafter, verifying with the rejection sampler, and learning α and step costs.

Owns: K per sequence (fixed, or adaptive from ``AdaptiveK``) within each sequence's remaining
budget and context, the MoE gate (in a closed segment only probes draft, and their acceptance
opens it), draft-side failure handling (a ``DraftUnavailableError`` makes
this step plain and backs off before asking again: no request waits on a dead drafter), checking
each sequence's drafts (ids inside the target vocabulary; a constrained sequence's draft cut
where its grammar rejects it, and its verification rows masked by the grammar state after the
draft prefix before them, so rejection sampling sees the masked target p'; q of shape [K_i, V] with finite
non-negative entries; anything else drops that sequence's drafts for the step — a lossless plain
step for it — counted as a draft fallback), isolating a drafter exception to the sequence that
causes it (that sequence decodes plainly from then on), verification with per-sequence faults
(``cluster.engine.faults``), and speculation statistics per traffic segment: lifetime counters
(``SpecStats``) and the live α the Router gates on (``LiveAlpha``, per-position like the
break-even α it is compared with; ``cluster.speculative.acceptance``). The step's drafts travel
as one ``StepDrafts`` (``cluster.engine.drafts``) from ``propose`` to ``verify``. Ignores:
scheduling and KV allocation (the scheduler reserves the K lookahead slots this controller asks
for), model execution, per-request counters (the engine's commit records them on the sequence).
"""
from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass

import torch

from cluster.common.config import AUTO_K, EngineConfig, SpecConfig
from cluster.common.request import SpecMode, SpecStats
from cluster.engine.drafts import SeqDraft, StepDrafts, Verdict
from cluster.engine.faults import FaultStage, SeqFault, per_row
from cluster.engine.grammar import apply_masks
from cluster.engine.protocol import EngineStats
from cluster.engine.scheduler import ScheduledSeq
from cluster.engine.sequence import Sequence
from cluster.speculative.acceptance import LiveAlpha, with_context
from cluster.speculative.adaptive_k import AdaptiveK, StepCostModel
from cluster.speculative.calibration import StepCosts, measure_step_costs
from cluster.speculative.moe import MoeGate
from cluster.speculative.proposer import (
    MODEL_FREE, ContextualProposer, DrafterKind, LocalModelProposer, MemberStatsProposer, Proposer,
    RemoteDraft, parse_drafter_spec,
)
from cluster.speculative.rejection_sampler import rejection_sample
from cluster.speculative.types import DraftProposal, DraftUnavailableError, ProposeInput, SpecBatchMetadata
from cluster.telemetry.engine_spans import kvsync_context

log = logging.getLogger(__name__)

DRAFT_RETRY_S = 1.0  # back-off after the drafter failed, before speculating again


@dataclass(slots=True)
class SpecTiming:
    """Cheap cumulative counters for cost measurements (``bench spec``): time inside the
    drafter and in target forwards that verified drafts or decoded plainly. Read deltas."""

    propose_s: float = 0.0
    proposals: int = 0  # propose calls that returned (one per speculating step)
    draft_rounds: int = 0  # sum over proposals of max K asked (draft rounds run)
    verify_forward_s: float = 0.0
    verify_steps: int = 0
    plain_forward_s: float = 0.0
    plain_steps: int = 0


class SpecController:
    def __init__(self, config: SpecConfig, proposer: Proposer, drafter_name: str,
                 moe_gate: MoeGate, max_model_len: int, draft_cost_ratio_prior: float | None = None,
                 step_costs: StepCosts | None = None, vocab_size: int | None = None) -> None:
        self.config = config
        self.vocab_size = vocab_size  # the target's: drafts and q are checked against it
        self.proposer = proposer
        self.drafter_name = drafter_name
        self.moe_gate = moe_gate
        self.max_model_len = max_model_len
        self.adaptive = None
        if config.adaptive:
            priors = {}
            if step_costs is not None:  # measured on this machine at start-up
                priors = dict(target_a_prior=step_costs.decode_s, slope_prior_ratio=step_costs.slope_ratio)
            self.adaptive = AdaptiveK(costs=StepCostModel(draft_cost_ratio_prior=draft_cost_ratio_prior, **priors))
        self.draft_fallbacks = 0
        self._retry_at = 0.0
        self._plan: dict[str, int] = {}
        # adaptive K's (sequence, segment) keys this step, refined by the drafter's draft context
        self._keys: dict[str, tuple[str, str]] = {}
        self._derived: dict[str, set[str]] = {}  # seq_id -> context keys handed to adaptive K
        self._no_drafts: set[str] = set()  # sequences whose drafting raised: plain until they finish
        self.grammar_cut_tokens = 0  # draft tokens cut because the grammar rejects them
        self.timing = SpecTiming()
        self.segment_stats: dict[str, SpecStats] = {}  # lifetime counters per traffic segment
        self.live_alpha = LiveAlpha()  # per segment, decayed: what the Router gates on

    # -- before scheduling: K per running sequence -----------------------------------------------
    def plan(self, running: list[Sequence]) -> None:
        self._plan = {}
        if time.monotonic() < self._retry_at:
            return
        eligible = [s for s in running if s.speculate and s.num_pending_tokens == 1 and self._moe_allows(s)]
        if not eligible:
            return
        if self.adaptive is not None:
            eligible, keys = self._adaptive_keys(eligible)
            ks = self.adaptive.choose(keys, self.config.k_max)
            self._keys = {s.seq_id: key for s, key in zip(eligible, keys)}
        else:
            ks = [int(self.config.num_spec_tokens)] * len(eligible)
        self._plan = {s.seq_id: k for s, k in zip(eligible, ks)}

    def _moe_allows(self, seq: Sequence) -> bool:
        """MoE gate: a segment speculates once open; while closed only the Router's probes
        (forwarded with mode SPECULATIVE) draft, to measure it."""
        return self.moe_gate.allows(seq.request.segment) or seq.request.mode is SpecMode.SPECULATIVE

    def _moe_observe(self, sampling: list[ScheduledSeq], counts: list[int], accepted: list[int]) -> None:
        if self.moe_gate.speculation_allowed:
            return
        for s, k, a in zip(sampling, counts, accepted):
            segment = s.seq.request.segment
            if k and self.moe_gate.record(segment, k, a) and self.moe_gate.decide(segment, self.moe_threshold()):
                log.info("MoE gate open for segment %r: %s", segment, self.moe_gate.segment_reason(segment))

    def moe_threshold(self) -> float:
        """α a probe window must reach: the configured one, else the cost model's break-even."""
        if self.config.moe_alpha_threshold != AUTO_K:
            return float(self.config.moe_alpha_threshold)
        if self.adaptive is not None:
            return self.adaptive.break_even_alpha(self.config.k_max)
        return self.moe_gate.threshold

    def _adaptive_keys(self, eligible: list[Sequence]) -> tuple[list[Sequence], list[tuple[str, str]]]:
        """(sequence, segment) keys for adaptive K. A drafter with a draft context (ngram: the
        match length) splits both by it, so acceptance is learnt per context; sequences it has
        nothing to draft for are left out (K = 0, no probe wasted on them)."""
        context = self.proposer.draft_context if isinstance(self.proposer, ContextualProposer) else None
        if context is None:
            return eligible, [(s.seq_id, s.request.segment) for s in eligible]
        kept, keys = [], []
        for s in eligible:
            ctx = context(s.seq_id, s.token_ids, s.request.segment)
            if ctx is None:
                continue
            sub_id = with_context(s.seq_id, ctx)
            self._derived.setdefault(s.seq_id, set()).add(sub_id)
            kept.append(s)
            keys.append((sub_id, with_context(s.request.segment, ctx)))
        return kept, keys

    def lookahead(self, seq: Sequence) -> int:
        k = 0 if seq.seq_id in self._no_drafts else self._plan.get(seq.seq_id, 0)
        # never draft past max_tokens (K+1 tokens may commit) or the context length
        return max(0, min(k, seq.remaining_budget - 1, self.max_model_len - len(seq.token_ids) - 1))

    # -- drafting ---------------------------------------------------------------------------------
    def propose(self, scheduled: list[ScheduledSeq]) -> StepDrafts:
        """Ask the drafter for every sequence with lookahead slots; check each draft (a bad one
        drops that sequence's drafts for the step) -> the step's drafts."""
        drafts = StepDrafts()
        asks = [s for s in scheduled if s.samples and s.num_lookahead > 0]
        if not asks:
            return drafts
        inputs = [ProposeInput(s.seq.seq_id, s.seq.token_ids, s.num_lookahead, s.seq.request.params,
                               segment=s.seq.request.segment) for s in asks]
        t0 = time.perf_counter()
        try:
            with kvsync_context(s.seq.trace for s in asks):  # KVSync spans under these requests
                proposals = per_row(len(asks), lambda rows: self._propose_rows(inputs, rows),
                                    FaultStage.PROPOSE, [i.seq_id for i in inputs],
                                    not_theirs=(DraftUnavailableError,))
        except DraftUnavailableError as exc:
            self._drafter_unavailable(asks, exc)
            return drafts
        elapsed = time.perf_counter() - t0
        self.timing.propose_s += elapsed
        self.timing.proposals += 1
        self.timing.draft_rounds += max(s.num_lookahead for s in asks)
        resynced = self.proposer.last_resynced if isinstance(self.proposer, RemoteDraft) else ()
        for s in asks:
            if s.seq.seq_id in resynced:
                s.seq.trace.resync(len(s.seq.token_ids), "draft lacked the committed prefix")
        if self.adaptive is not None:
            self.adaptive.costs.observe_draft(max(s.num_lookahead for s in asks), elapsed)
        for s, got in zip(asks, proposals):
            if isinstance(got, SeqFault):  # its drafting raises: no more drafts for it
                self._no_drafts.add(s.seq.seq_id)
                self._draft_fallback(s, got.message)
                continue
            draft, problem = self._checked(s, *got)
            if problem is not None:
                self._draft_fallback(s, problem)
            elif draft is not None:
                drafts.by_seq[s.seq.seq_id] = draft
        return drafts

    def _checked(self, s: ScheduledSeq, ids: list[int], probs) -> tuple[SeqDraft | None, str | None]:
        """One sequence's proposal -> (its draft, None), (None, None) when nothing is left to
        verify, or (None, why it cannot be verified)."""
        problem = self._check_draft(ids, probs)
        if problem is not None:
            return None, problem
        forced, allowed = 0, None
        if s.seq.grammar is not None:
            ids, probs, forced = self._forced_first(s, ids, probs)
            if ids:
                ids, probs, allowed, problem = self._under_grammar(s.seq, ids, probs)
        if problem is not None or not ids:
            return None, problem
        return SeqDraft(ids, probs, min(forced, len(ids)), allowed), None

    def _forced_first(self, s: ScheduledSeq, ids: list[int], probs):
        """Jump-forward: when the grammar forces the next tokens (its only legal continuation),
        they are the draft — one-hot, accepted by verification under any sampling settings
        since the masked target is one-hot there too, and verified like any draft (lossless
        whatever the grammar engine returns). The drafter's own draft is dropped for the step
        (it was drafted for the position before the forced tokens) -> (ids, q, forced count)."""
        try:
            forced = [int(t) for t in s.seq.grammar.forced_tokens()][: s.num_lookahead]
        except Exception:  # noqa: BLE001 (an optimisation: without it the drafter's draft stands)
            log.exception("request %s: computing forced tokens failed", s.seq.seq_id)
            return ids, probs, 0
        if not forced:
            return ids, probs, 0
        return forced, None, len(forced)

    def _under_grammar(self, seq: Sequence, ids: list[int], probs):
        """Cut a constrained sequence's draft where the grammar rejects it and keep the masks
        along it for verification -> (ids, q, allowed [K + 1, V] | None, problem). A deterministic draft (q None, or a
        greedy / seeded request, whose verification ignores q) is cut before its first illegal
        token; a sampled draft keeps that token (p' = 0 there rejects it and the residual is
        drawn under the mask: cutting it would bias rejection sampling)."""
        sp = seq.request.params
        keep_illegal = probs is not None and not (sp.greedy or sp.coupled)
        try:
            k, allowed = seq.grammar.walk(ids, keep_illegal)
        except Exception as exc:  # noqa: BLE001 (its grammar; verification masks it again or fails it)
            return [], None, None, f"grammar walk over the draft failed: {type(exc).__name__}: {exc}"
        self.grammar_cut_tokens += len(ids) - k
        return ids[:k], (probs[:k] if probs is not None else None), (allowed if k else None), None

    def _propose_rows(self, inputs: list[ProposeInput], rows: list[int]) -> list[tuple[list, object]]:
        """The proposer on inputs[rows] -> per row (draft ids, q [K_i, V] | None), trimmed to K_i.
        A DraftUnavailableError propagates (the drafter, not a sequence, is at fault)."""
        asked = [inputs[r] for r in rows]
        proposal: DraftProposal = self.proposer.propose(asked)
        if len(proposal.draft_token_ids) != len(asked) or len(proposal.draft_probs) != len(asked):
            raise ValueError(f"drafter answered {len(proposal.draft_token_ids)} sequences "
                             f"({len(proposal.draft_probs)} q) for {len(asked)}")
        out = []
        for inp, ids, probs in zip(asked, proposal.draft_token_ids, proposal.draft_probs):
            ids = [operator.index(t) for t in list(ids)[: inp.num_draft_tokens]]
            out.append((ids, probs[: len(ids)] if probs is not None and ids else None))
        return out

    def _check_draft(self, ids: list[int], probs) -> str | None:
        """Why these drafts cannot be verified against the target, or None when they can."""
        vocab = self.vocab_size
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            return f"draft token ids outside the target vocabulary [0, {vocab})"
        if probs is None:
            return None
        if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or probs.shape[0] != len(ids):
            return f"draft q has shape {tuple(getattr(probs, 'shape', ()))}, expected [{len(ids)}, V]"
        if vocab is not None and probs.shape[1] != vocab:
            return f"draft q is {probs.shape[1]} wide but the target vocabulary has {vocab} tokens"
        if not bool((torch.isfinite(probs) & (probs >= 0)).all()):
            return "draft q has negative or non-finite probabilities"
        return None

    def _draft_fallback(self, s: ScheduledSeq, reason: str) -> None:
        """This sequence's drafts are dropped for the step: it decodes plainly (lossless)."""
        self.draft_fallbacks += 1
        s.seq.trace.fallback(reason)
        log.warning("request %s: dropping its drafts this step: %s", s.seq.seq_id, reason)

    def _drafter_unavailable(self, asks: list[ScheduledSeq], exc: Exception) -> None:
        for s in asks:
            s.seq.trace.fallback(str(exc))
        self.draft_fallbacks += 1
        self._retry_at = time.monotonic() + DRAFT_RETRY_S
        log.warning("drafter unavailable, continuing without speculation: %s", exc)

    # -- verification -----------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, sampling: list[ScheduledSeq], drafts: StepDrafts,
               forward_s: float, num_tokens: int) -> list[Verdict | SeqFault]:
        """logits: [sum(K_i + 1), V] rows of the sampling sequences in order -> per sequence its
        committed tokens and accepted count, or the fault that ended it."""
        seq_ids = [s.seq.seq_id for s in sampling]
        counts = drafts.num_draft_tokens(seq_ids)  # [B] K_i
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c + 1)

        def run(rows: list[int]) -> list[Verdict]:
            seqs, ids = [sampling[r] for r in rows], [seq_ids[r] for r in rows]
            target_rows = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in rows])
            result = rejection_sample(
                self._masked(logits[target_rows], seqs, drafts),  # [sum(K_i + 1), V]
                drafts.flat_token_ids(ids), drafts.probs(ids),  # [sum K_i], [B] q [K_i, V] | None
                SpecBatchMetadata.from_counts([counts[r] for r in rows]),
                [s.seq.request.params for s in seqs], [len(s.seq.token_ids) for s in seqs])
            return [(result.committed(i), int(result.num_accepted[i])) for i in range(len(rows))]

        verdicts = per_row(len(sampling), run, FaultStage.VERIFY, seq_ids)
        self._observe_verdicts(sampling, counts, verdicts, drafts)
        self.timing.verify_forward_s += forward_s
        self.timing.verify_steps += 1
        self._observe_target_step(forward_s)
        if self.adaptive is not None:
            self.adaptive.costs.observe_target(num_tokens, forward_s)
        return verdicts

    def _observe_verdicts(self, sampling: list[ScheduledSeq], counts: list[int],
                          verdicts: list[Verdict | SeqFault], drafts: StepDrafts) -> None:
        """What each verified sequence teaches about α: its segment's counters and live α, the
        MoE gate, adaptive K. A faulted row says nothing about α."""
        ok = [not isinstance(v, SeqFault) for v in verdicts]
        self._moe_observe(sampling, [k if o else 0 for k, o in zip(counts, ok)],
                          [v[1] if o else 0 for v, o in zip(verdicts, ok)])
        for s, k, v, o in zip(sampling, counts, verdicts, ok):
            if not (k and o):
                continue
            segment, accepted = s.seq.request.segment, v[1]
            self.segment_stats.setdefault(segment, SpecStats()).record(k, accepted, drafts.by_seq[s.seq.seq_id].num_forced)
            self.live_alpha.observe(segment, k, accepted)
            if self.adaptive is not None:
                sub_id, key = self._keys.get(s.seq.seq_id, (s.seq.seq_id, segment))
                self.adaptive.observe(sub_id, key, k, accepted)

    def _masked(self, logits: torch.Tensor, seqs: list[ScheduledSeq], drafts: StepDrafts) -> torch.Tensor:
        """logits [sum(K_i + 1), V] of seqs with each constrained sequence's rows masked: row j
        by the grammar state after its first j draft tokens (the walk's masks; a sequence
        without drafts gets its committed state's mask)."""
        out = logits
        start = 0
        for s in seqs:
            draft = drafts.get(s.seq.seq_id)
            k = 0 if draft is None else draft.k
            if s.seq.grammar is not None:
                allowed = None if draft is None else draft.allowed  # [K_i + 1, V]
                if allowed is None:
                    allowed = s.seq.grammar.allowed()[None, :]  # no drafts: [1, V]
                if allowed.shape[0] != k + 1:
                    raise RuntimeError(f"{allowed.shape[0]} grammar masks for {k + 1} verified positions")
                if out is logits:
                    out = logits.clone()
                out[start : start + k + 1] = apply_masks(out[start : start + k + 1], allowed)
            start += k + 1
        return out

    def observe_plain_step(self, forward_s: float, num_tokens: int) -> None:
        self.timing.plain_forward_s += forward_s
        self.timing.plain_steps += 1
        self._observe_target_step(forward_s)
        if self.adaptive is not None:
            self.adaptive.costs.observe_target(num_tokens, forward_s)

    def _observe_target_step(self, forward_s: float) -> None:
        if isinstance(self.proposer, RemoteDraft):  # a remote drafter's deadline follows the step time
            self.proposer.observe_target_step(forward_s)

    def release(self, seq_id: str) -> None:
        self._no_drafts.discard(seq_id)
        if self.adaptive is not None:
            self.adaptive.release(seq_id)
            for sub_id in self._derived.pop(seq_id, ()):
                self.adaptive.release(sub_id)
        try:
            self.proposer.release(seq_id)
        except DraftUnavailableError:
            pass  # a draft server that is gone holds nothing worth freeing

    def fill_stats(self, st: EngineStats) -> None:
        st.spec_enabled = True
        st.drafter = self.drafter_name
        st.moe = self.moe_gate.moe
        st.moe_gate_open = self.moe_gate.speculation_allowed  # open for every segment
        st.spec_by_segment = {seg: stats.to_dict() for seg, stats in self.segment_stats.items()}
        for segment, d in st.spec_by_segment.items():  # the Router's per-segment gate
            live = self.live_alpha.get(segment)
            if live is not None and live.alpha is not None:  # per position, unrounded: it is gated on
                d["live_alpha"], d["live_draft_tokens"] = live.alpha, int(live.drafted)
            d["moe_gate_open"] = self.moe_gate.allows(segment)
            if self.moe_gate.moe:
                d["moe_gate"] = self.moe_gate.segment_reason(segment)
        st.draft_fallbacks = self.draft_fallbacks
        st.draft_resyncs = int(self.proposer.num_resyncs) if isinstance(self.proposer, RemoteDraft) else 0
        if isinstance(self.proposer, MemberStatsProposer):  # a portfolio's members
            st.drafter_steps = self.proposer.drafter_stats()
        if self.adaptive is not None:  # from the measured step costs; the router's default gate
            st.break_even_alpha = self.adaptive.break_even_alpha(self.config.k_max)


def draft_cost_ratio(proposer, target_runner) -> float | None:
    """Prior for one draft round relative to a target decode step, before any is timed: ngram
    (and suffix, and the model-free portfolio) ~0; self:L and local draft models their share of the weights a decode step reads (decoder
    layers + LM head); eagle its head's decoder layer + trimmed LM head over the target's
    parameters; None (absolute prior) for drafters we cannot size, e.g. remote ones."""
    kind = proposer.kind
    if kind in MODEL_FREE:
        return 0.0
    if kind is DrafterKind.EAGLE:  # one decoder layer + the trimmed LM head (parameters read per round)
        target_model = getattr(target_runner, "model", None)
        return None if target_model is None else (
            proposer.round_parameters() * target_model.embed.element_size() / target_model.weight_bytes())
    runner = proposer.runner if isinstance(proposer, LocalModelProposer) else None
    arch = getattr(getattr(runner, "model", None), "arch", None)
    if arch is None or kind not in (DrafterKind.SELF, DrafterKind.DRAFT_MODEL):
        return None

    def weights(a, layers: int) -> float:
        attn = a.hidden_size * a.head_dim * (2 * a.num_heads + 2 * a.num_kv_heads)
        return layers * (attn + 3 * a.hidden_size * a.intermediate_size) + a.vocab_size * a.hidden_size

    if kind is DrafterKind.SELF:
        return weights(arch, proposer.num_layers) / weights(arch, arch.num_layers)
    target_arch = getattr(getattr(target_runner, "model", None), "arch", None)
    return None if target_arch is None else weights(arch, arch.num_layers) / weights(target_arch, target_arch.num_layers)


def build_spec_controller(config: EngineConfig, model, proposer: Proposer | None = None) -> SpecController | None:
    """Build the drafter named by config.spec.drafter (or use an injected one, e.g. remote)."""
    from cluster.speculative.moe import MoeGate

    spec_cfg = config.spec
    spec = parse_drafter_spec(spec_cfg.drafter)
    if spec is None and proposer is None:
        return None
    name = spec_cfg.drafter
    if proposer is None:
        proposer = _build_proposer(spec, spec_cfg, config, model)
    elif isinstance(proposer, RemoteDraft) and proposer.expected_vocab_size is None:  # q must be this wide
        proposer.expected_vocab_size = model.runner.vocab_size
    gate = MoeGate.for_config(model.hf_config, validated=spec_cfg.moe_validated,
                              min_draft_tokens=spec_cfg.moe_min_draft_tokens)
    step_costs = measure_step_costs(model.runner, spec_cfg.k_max) if spec_cfg.adaptive else None
    return SpecController(spec_cfg, proposer, name, gate, model.runner.max_model_len,
                          draft_cost_ratio(proposer, model.runner), step_costs, model.runner.vocab_size)


def _build_proposer(spec, spec_cfg: SpecConfig, config: EngineConfig, model) -> Proposer:
    if spec.kind is DrafterKind.NGRAM:
        from cluster.speculative.ngram import NgramProposer

        return NgramProposer(spec_cfg.ngram_min, spec_cfg.ngram_max)
    if spec.kind is DrafterKind.SUFFIX:
        from cluster.speculative.suffix import SuffixProposer

        return SuffixProposer()
    if spec.kind is DrafterKind.PORTFOLIO:
        from cluster.speculative.portfolio import default_portfolio

        return default_portfolio(spec_cfg.ngram_min, spec_cfg.ngram_max, spec_cfg.k_max)
    if spec.kind is DrafterKind.EAGLE:
        from cluster.speculative.eagle import EagleProposer

        return EagleProposer.from_dir(spec.model, model.runner)
    if spec.kind is DrafterKind.SELF:
        from cluster.models.runner import ModelRunner
        from cluster.speculative.layer_skip import LayerSkipProposer, default_self_layers

        if not isinstance(model.runner, ModelRunner):
            from cluster.common.errors import ModelLoadError

            raise ModelLoadError("the self (layer-skip) drafter needs a Llama-family target")
        n = model.runner.model.arch.num_layers
        return LayerSkipProposer(model.runner, spec.self_layers or default_self_layers(n))
    return build_draft_model_proposer(spec.model, spec_cfg, config, model.tokenizer)


def build_draft_model_proposer(draft_spec: str, spec_cfg: SpecConfig, config: EngineConfig,
                               target_tokenizer=None):
    """Load a draft model (own runner, own KV pool) and check its vocabulary against the target."""
    from cluster.models.load import load_model
    from cluster.speculative.draft_model import DraftModelProposer, TrimmedHead, frequent_ids
    from cluster.speculative.vocab_check import require_vocab_compatible

    draft = load_model(draft_spec, config)
    if target_tokenizer is not None:
        require_vocab_compatible(target_tokenizer, draft.tokenizer, force=spec_cfg.force_vocab_mismatch)
    trimmed = None
    if spec_cfg.draft_vocab_trim:
        trimmed = TrimmedHead(draft.runner, frequent_ids(draft.tokenizer, spec_cfg.draft_vocab_trim))
    return DraftModelProposer(draft.runner, trimmed)
