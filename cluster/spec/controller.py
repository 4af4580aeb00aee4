"""Speculation inside one engine step: which sequences draft how many tokens, asking the
drafter, verifying with the rejection sampler, and learning α and step costs.

Owns: K per sequence (fixed, or adaptive from ``AdaptiveK``) within each sequence's remaining
budget and context, the MoE gate, draft-side failure handling (a ``DraftUnavailableError`` makes
this step plain and backs off before asking again: no request waits on a dead drafter), and
speculation statistics. Ignores: scheduling and KV allocation (the scheduler reserves the K
lookahead slots this controller asks for), model execution.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from cluster.engine.config import EngineConfig, SpecConfig
from cluster.engine.protocol import EngineStats
from cluster.engine.scheduler import ScheduledSeq
from cluster.engine.sequence import Sequence
from cluster.spec.adaptive_k import AdaptiveK, StepCostModel, with_context
from cluster.spec.calibration import StepCosts, measure_step_costs
from cluster.spec.moe import MoeGate
from cluster.spec.proposer import DrafterKind, Proposer, parse_drafter_spec
from cluster.spec.rejection_sampler import rejection_sample
from cluster.spec.types import DraftUnavailableError, ProposeInput, SpecBatchMetadata
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
                 step_costs: StepCosts | None = None) -> None:
        self.config = config
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
        self.timing = SpecTiming()

    # -- before scheduling: K per running sequence -----------------------------------------------
    def plan(self, running: list[Sequence]) -> None:
        self._plan = {}
        if not self.moe_gate.speculation_allowed or time.monotonic() < self._retry_at:
            return
        eligible = [s for s in running if s.speculate and s.num_pending_tokens == 1]
        if not eligible:
            return
        if self.adaptive is not None:
            eligible, keys = self._adaptive_keys(eligible)
            ks = self.adaptive.choose(keys, self.config.k_max)
            self._keys = {s.seq_id: key for s, key in zip(eligible, keys)}
        else:
            ks = [int(self.config.num_spec_tokens)] * len(eligible)
        self._plan = {s.seq_id: k for s, k in zip(eligible, ks)}

    def _adaptive_keys(self, eligible: list[Sequence]) -> tuple[list[Sequence], list[tuple[str, str]]]:
        """(sequence, segment) keys for adaptive K. A drafter with a draft context (ngram: the
        match length) splits both by it, so acceptance is learnt per context; sequences it has
        nothing to draft for are left out (K = 0, no probe wasted on them)."""
        context = getattr(self.proposer, "draft_context", None)
        if context is None:
            return eligible, [(s.seq_id, s.request.segment) for s in eligible]
        kept, keys = [], []
        for s in eligible:
            ctx = context(s.seq_id, s.token_ids)
            if ctx is None:
                continue
            sub_id = with_context(s.seq_id, ctx)
            self._derived.setdefault(s.seq_id, set()).add(sub_id)
            kept.append(s)
            keys.append((sub_id, with_context(s.request.segment, ctx)))
        return kept, keys

    def lookahead(self, seq: Sequence) -> int:
        k = self._plan.get(seq.seq_id, 0)
        # never draft past max_tokens (K+1 tokens may commit) or the context length
        return max(0, min(k, seq.remaining_budget - 1, self.max_model_len - len(seq.token_ids) - 1))

    # -- drafting ---------------------------------------------------------------------------------
    def propose(self, scheduled: list[ScheduledSeq]) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        asks = [s for s in scheduled if s.samples and s.num_lookahead > 0]
        if not asks:
            return {}
        inputs = [ProposeInput(s.seq.seq_id, s.seq.token_ids, s.num_lookahead, s.seq.request.params,
                               s.seq.generator) for s in asks]
        t0 = time.perf_counter()
        try:
            with kvsync_context(s.seq.trace for s in asks):  # KVSync spans under these requests
                proposal = self.proposer.propose(inputs)
        except DraftUnavailableError as exc:
            for s in asks:
                s.seq.trace.fallback(str(exc))
            self.draft_fallbacks += 1
            self._retry_at = time.monotonic() + DRAFT_RETRY_S
            log.warning("drafter unavailable, continuing without speculation: %s", exc)
            return {}
        elapsed = time.perf_counter() - t0
        self.timing.propose_s += elapsed
        self.timing.proposals += 1
        self.timing.draft_rounds += max(s.num_lookahead for s in asks)
        resynced = getattr(self.proposer, "last_resynced", ())
        for s in asks:
            if s.seq.seq_id in resynced:
                s.seq.trace.resync(len(s.seq.token_ids), "draft lacked the committed prefix")
        if self.adaptive is not None:
            self.adaptive.costs.observe_draft(max(s.num_lookahead for s in asks), elapsed)
        drafts = {}
        for s, ids, probs in zip(asks, proposal.draft_token_ids, proposal.draft_probs):
            ids = ids[: s.num_lookahead]
            if ids:
                drafts[s.seq.seq_id] = (ids, probs[: len(ids)] if probs is not None else None)
        return drafts

    # -- verification -----------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, sampling: list[ScheduledSeq],
               drafts: dict[str, tuple[list[int], torch.Tensor | None]],
               forward_s: float, num_tokens: int) -> tuple[list[list[int]], list[int]]:
        """logits: [sum(K_i + 1), V] rows of the sampling sequences in order."""
        counts = [len(drafts[s.seq.seq_id][0]) if s.seq.seq_id in drafts else 0 for s in sampling]
        meta = SpecBatchMetadata.from_counts(counts)
        flat = [t for s in sampling for t in (drafts[s.seq.seq_id][0] if s.seq.seq_id in drafts else [])]
        probs = [drafts[s.seq.seq_id][1] if s.seq.seq_id in drafts else None for s in sampling]
        result = rejection_sample(
            logits, torch.tensor(flat, dtype=torch.int64), probs, meta,
            [s.seq.request.params for s in sampling], [s.seq.generator for s in sampling])
        committed = [result.committed(i) for i in range(len(sampling))]
        accepted = [int(a) for a in result.num_accepted]
        self.timing.verify_forward_s += forward_s
        self.timing.verify_steps += 1
        self._observe_target_step(forward_s)
        if self.adaptive is not None:
            self.adaptive.costs.observe_target(num_tokens, forward_s)
            for s, k, a in zip(sampling, counts, accepted):
                if k:
                    sub_id, key = self._keys.get(s.seq.seq_id, (s.seq.seq_id, s.seq.request.segment))
                    self.adaptive.observe(sub_id, key, k, a)
        return committed, accepted

    def observe_plain_step(self, forward_s: float, num_tokens: int) -> None:
        self.timing.plain_forward_s += forward_s
        self.timing.plain_steps += 1
        self._observe_target_step(forward_s)
        if self.adaptive is not None:
            self.adaptive.costs.observe_target(num_tokens, forward_s)

    def _observe_target_step(self, forward_s: float) -> None:
        observe = getattr(self.proposer, "observe_target_step", None)
        if observe is not None:  # a remote drafter's deadline follows the measured step time
            observe(forward_s)

    def release(self, seq_id: str) -> None:
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
        st.moe_gate_open = self.moe_gate.speculation_allowed
        st.draft_fallbacks = self.draft_fallbacks
        st.draft_resyncs = int(getattr(self.proposer, "num_resyncs", 0))  # RemoteProposer's counter
        if self.adaptive is not None:  # from the measured step costs; the router's default gate
            st.break_even_alpha = round(self.adaptive.break_even_alpha(self.config.k_max), 4)


def draft_cost_ratio(proposer, target_runner) -> float | None:
    """Prior for one draft round relative to a target decode step, before any is timed: ngram
    ~0; self:L and local draft models their share of the weights a decode step reads (decoder
    layers + LM head); None (absolute prior) for drafters we cannot size, e.g. remote ones."""
    kind = getattr(proposer, "kind", None)
    if kind is DrafterKind.NGRAM:
        return 0.0
    runner = getattr(proposer, "runner", None)
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
    from cluster.spec.moe import MoeGate

    spec_cfg = config.spec
    spec = parse_drafter_spec(spec_cfg.drafter)
    if spec is None and proposer is None:
        return None
    name = spec_cfg.drafter
    if proposer is None:
        proposer = _build_proposer(spec, spec_cfg, config, model)
    elif getattr(proposer, "expected_vocab_size", 0) is None:  # a remote draft: q must be this wide
        proposer.expected_vocab_size = model.runner.vocab_size
    gate = MoeGate.for_config(model.hf_config, validated=spec_cfg.moe_validated)
    step_costs = measure_step_costs(model.runner, spec_cfg.k_max) if spec_cfg.adaptive else None
    return SpecController(spec_cfg, proposer, name, gate, model.runner.max_model_len,
                          draft_cost_ratio(proposer, model.runner), step_costs)


def _build_proposer(spec, spec_cfg: SpecConfig, config: EngineConfig, model) -> Proposer:
    if spec.kind is DrafterKind.NGRAM:
        from cluster.spec.ngram import NgramProposer

        return NgramProposer(spec_cfg.ngram_min, spec_cfg.ngram_max)
    if spec.kind is DrafterKind.SELF:
        from cluster.engine.runner import ModelRunner
        from cluster.spec.layer_skip import LayerSkipProposer, default_self_layers

        if not isinstance(model.runner, ModelRunner):
            from cluster.errors import ModelLoadError

            raise ModelLoadError("the self (layer-skip) drafter needs a Llama-family target")
        n = model.runner.model.arch.num_layers
        return LayerSkipProposer(model.runner, spec.self_layers or default_self_layers(n))
    return build_draft_model_proposer(spec.model, spec_cfg, config, model.tokenizer)


def build_draft_model_proposer(draft_spec: str, spec_cfg: SpecConfig, config: EngineConfig,
                               target_tokenizer=None):
    """Load a draft model (own runner, own KV pool) and check its vocabulary against the target."""
    from cluster.models.load import load_model
    from cluster.spec.draft_model import DraftModelProposer, TrimmedHead, frequent_ids
    from cluster.spec.vocab_check import require_vocab_compatible

    draft = load_model(draft_spec, config)
    if target_tokenizer is not None:
        require_vocab_compatible(target_tokenizer, draft.tokenizer, force=spec_cfg.force_vocab_mismatch)
    trimmed = None
    if spec_cfg.draft_vocab_trim:
        trimmed = TrimmedHead(draft.runner, frequent_ids(draft.tokenizer, spec_cfg.draft_vocab_trim))
    return DraftModelProposer(draft.runner, trimmed)
