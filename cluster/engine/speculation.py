"""Speculation inside one engine step: which sequences draft how many tokens, asking the
drafter, verifying with the rejection sampler, and learning α and step costs.

Owns: K per sequence by its segment's policy (``SpecConfig.k_policy``: fixed, or adaptive from
``AdaptiveK``) within its remaining budget and context (the drafter asked is its segment's too:
``cluster.engine.drafters`` routes a union of drafters by segment), the MoE gate (in a closed
segment only probes draft, and their acceptance opens it), draft-side failure handling (a ``DraftUnavailableError`` makes
this step plain and backs off before asking again: no request waits on a dead drafter), checking
each sequence's drafts (ids inside the target vocabulary; q of shape [K_i, V] with finite
non-negative entries; anything else drops that sequence's drafts for the step — a lossless plain
step for it — counted as a draft fallback), a constrained sequence's K as its forced tokens plus
the drafter's K for the context after them (``cluster.engine.grammar_drafts`` cuts the draft under
the grammar and masks its verification rows, so rejection sampling sees the masked target p';
adaptive K learns the drafter's share only), a request's predicted output (its prediction drafts
for it wherever the output stands in it — ``cluster.speculative.prediction`` — and the drafter is not
asked for it that step; those drafts teach the prediction's own α only), isolating a drafter exception to the sequence that
causes it (that sequence decodes plainly from then on), verification with per-sequence faults
(``cluster.engine.faults``), and speculation statistics per traffic segment: lifetime counters
(``SpecStats``) and the live α the Router gates on (``LiveAlpha``, per-position like the
break-even α it is compared with; ``cluster.speculative.acceptance``). The step's drafts travel
as one ``StepDrafts`` (``cluster.engine.drafts``) from ``propose`` to ``verify``. Ignores:
scheduling and KV allocation (the scheduler reserves the K draft-token slots this controller asks
for), model execution, per-request counters (the engine's commit records them on the sequence).
"""
from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass

import torch

from cluster.common.acceptance_class import ACCEPTANCE_CLASSES, acceptance_class, class_name, classed_context
from cluster.common.config import AUTO_K, EngineConfig, SpecConfig
from cluster.common.request import SpecMode, SpecStats
from cluster.engine.drafters import build_drafters, draft_cost_ratio
from cluster.engine.drafts import SeqDraft, StepDrafts, Verdict
from cluster.engine.faults import FaultStage, SeqFault, per_row
from cluster.engine.grammar_drafts import ForcedText, forced_prefix, grammar_draft
from cluster.engine.target_rows import process_rows
from cluster.engine.protocol import EngineStats
from cluster.engine.scheduler import ScheduledSeq
from cluster.engine.sequence import Sequence
from cluster.speculative.acceptance import LiveAlpha, with_context
from cluster.speculative.adaptive_k import AdaptiveK, StepCostModel
from cluster.speculative.calibration import StepCosts, measure_step_costs
from cluster.speculative.moe import MoeGate
from cluster.speculative.prediction import PREDICTION, PredictedOutputs
from cluster.speculative.proposer import (
    CatchUpProposer, ContextualProposer, LocalModelProposer, MemberStatsProposer, Proposer, RemoteDraft,
    TargetFeatureReader, parse_drafter_choice,
)
from cluster.speculative.rejection_sampler import rejection_sample
from cluster.speculative.types import DraftProposal, DraftUnavailableError, ProposeInput, SpecBatchMetadata
from cluster.telemetry.engine_spans import kvsync_context

log = logging.getLogger(__name__)

DRAFT_RETRY_S = 1.0  # back-off after the drafter failed, before speculating again


@dataclass(slots=True)
class SpecTiming:
    """Cheap cumulative counters for cost measurements (``bench spec``): time planning K (and, for
    a portfolio, choosing a member: its model-free members' drafts are made there), inside the
    drafter, in target forwards that verified drafts or decoded plainly, and sampling their
    tokens. Read deltas."""

    plan_s: float = 0.0  # ``plan``: K per sequence (adaptive K, a portfolio's choice, draft contexts)
    propose_s: float = 0.0
    proposals: int = 0  # propose calls that returned (one per speculating step)
    draft_rounds: int = 0  # sum over proposals of max K asked (draft rounds run)
    verify_forward_s: float = 0.0
    verify_s: float = 0.0  # rejection sampling of the verification rows, grammar masks included
    verify_steps: int = 0
    plain_forward_s: float = 0.0
    plain_sample_s: float = 0.0  # sampling the plain steps' tokens
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
        # what the drafter can do, checked once: a protocol isinstance costs ~10 µs, several a step
        self.members = proposer if isinstance(proposer, MemberStatsProposer) else None  # a portfolio
        self._remote = proposer if isinstance(proposer, RemoteDraft) else None
        self._contextual = proposer if isinstance(proposer, ContextualProposer) else None
        self._local_model = proposer if isinstance(proposer, LocalModelProposer) else None
        # a drafter that catches up before drafting (EAGLE); a portfolio prices its members' own
        self._catch_up = proposer if self.members is None and isinstance(proposer, CatchUpProposer) else None
        self.adaptive = None
        if config.adaptive:
            priors = {}
            if step_costs is not None:  # measured on this machine at start-up
                priors = dict(target_a_prior=step_costs.decode_s, slope_prior_ratio=step_costs.slope_ratio)
            if self.members is not None:  # a portfolio: each member's round cost apart
                priors["draft_cost_ratio_priors"] = self.members.member_cost_priors()
            self.adaptive = AdaptiveK(costs=StepCostModel(draft_cost_ratio_prior=draft_cost_ratio_prior, **priors))
            self.adaptive.costs.draft_cost_ratio_priors[PREDICTION] = 0.0  # nothing runs to draft it
            if self.members is not None:
                self.members.use_costs(self.adaptive.costs)
        self.draft_fallbacks = 0
        self._retry_at = 0.0
        self._plan: dict[str, int] = {}  # seq_id -> K this step (forced tokens + the drafter's)
        self._forced: dict[str, list[int]] = {}  # seq_id -> the tokens its grammar forces this step
        self.predictions = PredictedOutputs()  # requests that sent a prediction: where each stands in it
        self._predicted: dict[str, list[int]] = {}  # seq_id -> its prediction's draft this step
        self._no_prediction: set[str] = set()  # sequences whose prediction drafting raised
        self.prediction_steps = {"steps": 0, "draft_tokens": 0, "accepted_tokens": 0}  # drafted from predictions
        self.forced_text = ForcedText()  # the target's tokenization of held-back forced text
        # adaptive K's (sequence, segment) keys this step, refined by the drafter's draft context
        self._keys: dict[str, tuple[str, str]] = {}
        self._derived: dict[str, set[str]] = {}  # seq_id -> context keys handed to adaptive K
        self._no_drafts: set[str] = set()  # sequences whose drafting raised: plain until they finish
        self.grammar_cut_tokens = 0  # draft tokens cut because the grammar rejects them
        self.timing = SpecTiming()
        self.segment_stats: dict[str, SpecStats] = {}  # lifetime counters per traffic segment
        self.live_alpha = LiveAlpha()  # per segment, decayed: what the Router gates on
        self.live_alpha_by_class = LiveAlpha()  # per segment and acceptance class (classed_context)

    # -- before scheduling: K per running sequence -----------------------------------------------
    def plan(self, running: list[Sequence]) -> None:
        """K per sequence this step: a constrained sequence's forced tokens (jump-forward, free
        drafts the drafter is not asked for) plus the drafter's K for the context after them."""
        t0 = time.perf_counter()
        try:
            self._plan_k(running)
        finally:
            self.timing.plan_s += time.perf_counter() - t0

    def _plan_k(self, running: list[Sequence]) -> None:
        self._plan, self._forced, self._predicted = {}, {}, {}
        eligible = [s for s in running if s.speculate and s.num_pending_tokens == 1 and self._moe_allows(s)]
        if not eligible:
            return
        retrying = time.monotonic() < self._retry_at  # the drafter failed a moment ago: not asked
        if not retrying:
            self._forced = {s.seq_id: f for s in eligible if s.grammar is not None and (f := self._forced_of(s))}
        self._predicted = self._prediction_drafts(eligible)  # the drafter is not asked for these
        for sid, draft in self._predicted.items():
            self._plan[sid] = len(draft)
        if retrying:
            return
        # a remote drafter holds committed tokens only: after forced tokens it is not asked
        remote = self._remote is not None
        drafting = [s for s in eligible if not (remote and s.seq_id in self._forced) and s.seq_id not in self._predicted]
        # the drafter's K: each sequence's segment policy, a fixed K or adaptive K (planned
        # together, as one batch); forced tokens come on top of it
        policy = {s.seq_id: self.config.k_policy(s.request.segment) for s in drafting}
        drafter_k = {sid: int(k) for sid, k in policy.items() if k != AUTO_K}
        auto = [s for s in drafting if policy[s.seq_id] == AUTO_K]
        self._keys = {}
        if auto:  # self.adaptive is set whenever some policy is "auto"
            auto, keys, drafters = self._adaptive_keys(auto)
            # a portfolio plans with the rates it chose each member by (see planning_alpha)
            alphas = None if self.members is None else [self.members.planning_alpha(s.seq_id) for s in auto]
            behind = (None if self._catch_up is None
                      else [self._catch_up.positions_behind(s.seq_id, self._context(s)) for s in auto])
            num_draft_tokens = self.adaptive.choose(keys, self.config.max_draft_tokens, drafters=drafters,
                                                    alphas=alphas, behind=behind)
            self._keys = {s.seq_id: key for s, key in zip(auto, keys)}
            drafter_k.update((s.seq_id, k) for s, k in zip(auto, num_draft_tokens))
        for s in eligible:
            k = len(self._forced.get(s.seq_id, ())) + drafter_k.get(s.seq_id, 0)
            if k:
                self._plan[s.seq_id] = k

    def _prediction_drafts(self, eligible: list[Sequence]) -> dict[str, list[int]]:
        """seq_id -> the next draft of its prediction, for each sequence that sent one, has no
        forced tokens this step, and stands somewhere in its prediction (``PredictedOutputs``):
        K from the prediction's own α at the engine's step costs (a fixed-K segment: its K)."""
        out = {}
        for s in eligible:
            if not s.request.prediction_token_ids or s.seq_id in self._forced or s.seq_id in self._no_prediction:
                continue
            fixed = self.config.k_policy(s.request.segment)
            costs = self.adaptive.costs if fixed == AUTO_K and self.adaptive is not None else None
            max_k = self.config.max_draft_tokens if fixed == AUTO_K else int(fixed)
            try:
                draft = self.predictions.draft(s.seq_id, s.request.prediction_token_ids, s.prompt_len,
                                               s.token_ids, max_k, costs)
            except Exception:  # noqa: BLE001 (an optimisation: the drafter drafts for it from now on)
                log.exception("request %s: drafting from its prediction failed", s.seq_id)
                self._no_prediction.add(s.seq_id)
                continue
            if draft:
                out[s.seq_id] = draft
        return out

    def _forced_of(self, seq: Sequence) -> list[int]:
        """The grammar's drafts of a constrained sequence: its forced tokens, then the learnt
        tokenization of the forced text held back after them."""
        forced = forced_prefix(seq)
        try:
            return forced + self.forced_text.draft(seq, forced)
        except Exception:  # noqa: BLE001 (an optimisation: the forced tokens stand alone)
            log.exception("request %s: drafting the forced text failed", seq.seq_id)
            return forced

    def _context(self, seq: Sequence) -> list[int]:
        """The tokens the drafter drafts after: committed tokens + this step's forced tokens."""
        forced = self._forced.get(seq.seq_id)
        return seq.token_ids + forced if forced else seq.token_ids

    def _moe_allows(self, seq: Sequence) -> bool:
        """MoE gate: a segment speculates once open; while closed only the Router's probes
        (forwarded with mode SPECULATIVE) draft, to measure it."""
        return self.moe_gate.allows(seq.request.segment) or seq.request.mode is SpecMode.SPECULATIVE

    def _moe_observe(self, sampling: list[ScheduledSeq], num_draft_tokens: list[int], accepted: list[int]) -> None:
        if self.moe_gate.speculation_allowed:
            return
        for s, k, a in zip(sampling, num_draft_tokens, accepted):
            segment = s.seq.request.segment
            if k and self.moe_gate.record(segment, k, a) and self.moe_gate.decide(segment, self.moe_threshold()):
                log.info("MoE gate open for segment %r: %s", segment, self.moe_gate.segment_reason(segment))

    def moe_threshold(self) -> float:
        """α a probe window must reach: the configured one, else the cost model's break-even."""
        if self.config.moe_alpha_threshold != AUTO_K:
            return float(self.config.moe_alpha_threshold)
        if self.adaptive is not None:
            return self.adaptive.break_even_alpha(self.config.max_draft_tokens)
        return self.moe_gate.threshold

    def _adaptive_keys(self, eligible: list[Sequence]) -> tuple[list[Sequence], list[tuple[str, str]], list[str] | None]:
        """(sequences, their (sequence, segment) keys for adaptive K, the portfolio member each
        drafts with — planned at that member's own draft cost — or None for a single drafter). A
        drafter with a draft context (ngram: the match length) splits both keys by it, so
        acceptance is learnt per context; sequences it has nothing to draft for are left out
        (K = 0, no probe wasted on them). Each acceptance class (sampled, shaped logits) is
        learnt apart (``acceptance_class``): in its draft context, or in its segment's key."""
        context = self._contextual.draft_context if self._contextual is not None else None
        if context is None:
            return eligible, [(s.seq_id, classed_context(s.request.segment, acceptance_class(s.request.params)))
                              for s in eligible], None
        kept, keys, contexts = [], [], []
        for s in eligible:
            ctx = context(s.seq_id, self._context(s), s.request.segment, s.request.draft_scope,
                          acceptance_class=acceptance_class(s.request.params))
            if ctx is None:
                continue
            sub_id = with_context(s.seq_id, ctx)
            self._derived.setdefault(s.seq_id, set()).add(sub_id)
            kept.append(s)
            keys.append((sub_id, with_context(s.request.segment, ctx)))
            contexts.append(ctx)
        drafters = None if self.members is None else [self.members.member_of(c) for c in contexts]
        return kept, keys, drafters

    def num_draft_tokens(self, seq: Sequence) -> int:
        k = 0 if seq.seq_id in self._no_drafts else self._plan.get(seq.seq_id, 0)
        # never draft past max_tokens (K+1 tokens may commit) or the context length
        return max(0, min(k, seq.remaining_budget - 1, self.max_model_len - len(seq.token_ids) - 1))

    # -- drafting ---------------------------------------------------------------------------------
    def propose(self, scheduled: list[ScheduledSeq]) -> StepDrafts:
        """Ask the drafter for every sequence with draft-token slots left after its forced tokens
        (a constrained sequence's drafter drafts after them); check each draft (a bad one is
        dropped for the step: that sequence verifies its forced tokens only, or decodes
        plainly) -> the step's drafts."""
        drafts = StepDrafts()
        asks = [s for s in scheduled if s.samples and s.num_draft_tokens > 0]
        if not asks:
            return drafts
        forced = {s.seq.seq_id: self._forced.get(s.seq.seq_id, [])[: s.num_draft_tokens] for s in asks}
        drafting = [s for s in asks if s.num_draft_tokens > len(forced[s.seq.seq_id])
                    and s.seq.seq_id not in self._predicted]
        proposals = dict(zip([s.seq.seq_id for s in drafting], self._ask_drafter(drafting, forced)))
        for s in asks:  # a prediction's draft, cut to the slots the scheduler gave
            if s.seq.seq_id in self._predicted:
                proposals[s.seq.seq_id] = (self._predicted[s.seq.seq_id][: s.num_draft_tokens], None)
        for s in asks:
            got = proposals.get(s.seq.seq_id, ([], None))
            if isinstance(got, SeqFault):  # its drafting raises: no more drafts for it
                self._no_drafts.add(s.seq.seq_id)
                self._draft_fallback(s, got.message)
                continue
            draft, problem = self._checked(s, forced[s.seq.seq_id], *got)
            if problem is not None:
                self._draft_fallback(s, problem)
            elif draft is not None:
                drafts.by_seq[s.seq.seq_id] = draft
        return drafts

    def _ask_drafter(self, drafting: list[ScheduledSeq], forced: dict[str, list[int]]) -> list:
        """The proposer on ``drafting`` (each asked for its draft-token slots left after its forced tokens)
        -> per sequence (draft ids, q | None) or its SeqFault; all ([], None) when the drafter
        is unavailable (forced tokens still stand: they are the grammar's, not the drafter's)."""
        if not drafting:
            return []
        cursors = self._draft_cursors(drafting, forced)
        stop = self.config.draft_stop_confidence  # adaptive K's sequences only: a fixed K drafts K
        inputs = [ProposeInput(s.seq.seq_id, self._context(s.seq), s.num_draft_tokens - len(forced[s.seq.seq_id]),
                               s.seq.request.params, segment=s.seq.request.segment,
                               draft_scope=s.seq.request.draft_scope, grammar=cursors.get(s.seq.seq_id),
                               stop_confidence=stop if s.seq.seq_id in self._keys else 0.0) for s in drafting]
        t0 = time.perf_counter()
        try:
            with kvsync_context(s.seq.trace for s in drafting):  # KVSync spans under these requests
                proposals = per_row(len(drafting), lambda rows: self._propose_rows(inputs, rows),
                                    FaultStage.PROPOSE, [i.seq_id for i in inputs],
                                    not_theirs=(DraftUnavailableError,))
        except DraftUnavailableError as exc:
            self._drafter_unavailable(drafting, exc)
            return [([], None)] * len(drafting)
        finally:
            for c in cursors.values():  # back to the committed state before the walk
                c.close()
        elapsed = time.perf_counter() - t0
        # the rounds that ran: the longest draft (a confidence floor stops drafts short of K)
        rounds = max((len(p[0]) for p in proposals if not isinstance(p, SeqFault)), default=0)
        self.timing.propose_s += elapsed
        self.timing.proposals += 1
        self.timing.draft_rounds += rounds
        resynced = self._remote.last_resynced if self._remote is not None else ()
        for s in drafting:
            if s.seq.seq_id in resynced:
                s.seq.trace.resync(len(s.seq.token_ids), "draft lacked the committed prefix")
        if self.adaptive is not None:
            caught_up = 0 if self._catch_up is None else self._catch_up.last_caught_up
            self.adaptive.costs.observe_draft(rounds, elapsed, catch_up=caught_up)
            if self.members is not None:  # and each member's rounds on their own
                for member, (member_rounds, seconds, caught_up) in self.members.last_member_rounds.items():
                    self.adaptive.costs.observe_draft(member_rounds, seconds, member, catch_up=caught_up)
        return proposals

    def _draft_cursors(self, drafting: list[ScheduledSeq], forced: dict[str, list[int]]) -> dict:
        """seq_id -> its grammar's draft cursor after its forced tokens, for a drafter that runs
        a model here (it drafts under the mask); none for model-free or remote drafters."""
        if self._local_model is None or self._local_model.runner is None:
            return {}
        out = {}
        for s in drafting:
            if s.seq.grammar is not None:
                try:
                    out[s.seq.seq_id] = s.seq.grammar.draft_cursor(forced[s.seq.seq_id])
                except Exception:  # noqa: BLE001 (drafting unmasked is still lossless: the walk cuts it)
                    log.exception("request %s: opening a draft cursor failed", s.seq.seq_id)
        return out

    def _checked(self, s: ScheduledSeq, forced: list[int], ids: list[int], probs) -> tuple[SeqDraft | None, str | None]:
        """One sequence's forced tokens and proposal -> (its draft, None), (None, None) when
        nothing is left to verify, or (None, why it cannot be verified). A drafter's draft that
        cannot be verified is dropped (reported through the fallback) and the forced tokens
        stand alone."""
        problem = self._check_draft(ids, probs)
        if problem is not None:
            if not forced:
                return None, problem
            self._draft_fallback(s, problem)
            ids, probs = [], None
        if s.seq.grammar is None:
            return (SeqDraft(ids, probs) if ids else None), None
        try:
            draft, cut = grammar_draft(s.seq, forced, ids, probs)
        except Exception as exc:  # noqa: BLE001 (its grammar; verification masks it again or fails it)
            return None, f"grammar walk over the draft failed: {type(exc).__name__}: {exc}"
        self.grammar_cut_tokens += cut
        return draft, None

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
        num_draft_tokens = drafts.num_draft_tokens(seq_ids)  # [B] K_i
        starts = [0]
        for c in num_draft_tokens:
            starts.append(starts[-1] + c + 1)

        def run(rows: list[int]) -> list[Verdict]:
            seqs, ids = [sampling[r] for r in rows], [seq_ids[r] for r in rows]
            if len(rows) == len(sampling):  # every row (not isolating a fault): no gathered copy
                own = logits
            else:
                own = logits[torch.cat([torch.arange(starts[r], starts[r + 1]) for r in rows])]
            result = rejection_sample(
                process_rows(own, seqs, drafts),  # [sum(K_i + 1), V] shaped and masked per request
                drafts.flat_token_ids(ids), drafts.probs(ids),  # [sum K_i], [B] q [K_i, V] | None
                SpecBatchMetadata.from_num_draft_tokens([num_draft_tokens[r] for r in rows]),
                [s.seq.request.params for s in seqs], [len(s.seq.token_ids) for s in seqs])
            return result.verdicts()

        t0 = time.perf_counter()
        verdicts = per_row(len(sampling), run, FaultStage.VERIFY, seq_ids)
        picked_s = time.perf_counter() - t0
        self.timing.verify_s += picked_s
        if self.adaptive is not None:
            self.adaptive.costs.observe_sampling(True, picked_s)
        self._observe_verdicts(sampling, num_draft_tokens, verdicts, drafts)
        self.timing.verify_forward_s += forward_s
        self.timing.verify_steps += 1
        self._observe_target_step(forward_s)
        if self.adaptive is not None:
            self.adaptive.costs.observe_target(num_tokens, forward_s)
        return verdicts

    def _observe_verdicts(self, sampling: list[ScheduledSeq], num_draft_tokens: list[int],
                          verdicts: list[Verdict | SeqFault], drafts: StepDrafts) -> None:
        """What each verified sequence teaches about α: its segment's counters and live α, the
        MoE gate, adaptive K. A faulted row says nothing about α."""
        ok = [not isinstance(v, SeqFault) for v in verdicts]
        # a prediction's drafts say how good the client's guess was, not the drafter nor the segment
        own = [o and s.seq.seq_id not in self._predicted for s, o in zip(sampling, ok)]
        self._moe_observe(sampling, [k if o else 0 for k, o in zip(num_draft_tokens, own)],
                          [v[1] if o else 0 for v, o in zip(verdicts, own)])
        for s, k, v, o in zip(sampling, num_draft_tokens, verdicts, ok):
            if not (k and o):
                continue
            if s.seq.seq_id in self._predicted:
                self.predictions.observe(s.seq.seq_id, k, v[1])
                for name, n in (("steps", 1), ("draft_tokens", k), ("accepted_tokens", v[1])):
                    self.prediction_steps[name] += n
                continue
            segment, accepted = s.seq.request.segment, v[1]
            forced = drafts.by_seq[s.seq.seq_id].num_forced
            self.segment_stats.setdefault(segment, SpecStats()).record(k, accepted, forced)
            self.live_alpha.observe(segment, k, accepted)  # the grammar's drafts count in the segment's α
            self.live_alpha_by_class.observe(classed_context(segment, acceptance_class(s.seq.request.params)),
                                             k, accepted)
            # adaptive K plans the drafter's share: it learns from the draft tokens after the
            # forced ones, when verification reached them
            # (a fixed-K segment's K needs no α: only sequences adaptive K planned teach it)
            if k > forced and accepted >= forced and s.seq.seq_id in self._keys:
                sub_id, key = self._keys[s.seq.seq_id]
                self.adaptive.observe(sub_id, key, k - forced, accepted - forced)

    def observe_plain_step(self, forward_s: float, num_tokens: int, sample_s: float | None = None) -> None:
        """A step without drafts: its forward over ``num_tokens`` took ``forward_s``, sampling its
        tokens ``sample_s`` (what verification's rejection sampling is compared with)."""
        self.timing.plain_forward_s += forward_s
        self.timing.plain_sample_s += sample_s or 0.0
        self.timing.plain_steps += 1
        self._observe_target_step(forward_s)
        if self.adaptive is not None:
            self.adaptive.costs.observe_target(num_tokens, forward_s)
            if sample_s is not None:
                self.adaptive.costs.observe_sampling(False, sample_s)

    def _observe_target_step(self, forward_s: float) -> None:
        if self._remote is not None:  # a remote drafter's deadline follows the step time
            self._remote.observe_target_step(forward_s)

    def drafted_by(self, seq_id: str) -> str | None:
        """This step's drafts of a sequence came from its prediction: "prediction"; else None (the
        engine's drafter, named on the request's trace)."""
        return PREDICTION if seq_id in self._predicted else None

    def release(self, seq_id: str) -> None:
        self._no_drafts.discard(seq_id)
        self.forced_text.release(seq_id)
        self.predictions.release(seq_id)
        self._no_prediction.discard(seq_id)
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
            by_class = {}
            for tag in ACCEPTANCE_CLASSES:  # each class's own: a request is gated on its class's
                live = self.live_alpha_by_class.get(classed_context(segment, tag))
                if live is not None and live.alpha is not None:
                    by_class[class_name(tag)] = {"live_alpha": live.alpha, "live_draft_tokens": int(live.drafted)}
            if by_class:
                d["live_alpha_by_class"] = by_class
            d["moe_gate_open"] = self.moe_gate.allows(segment)
            if self.moe_gate.moe:
                d["moe_gate"] = self.moe_gate.segment_reason(segment)
        st.draft_fallbacks = self.draft_fallbacks
        st.draft_resyncs = int(self._remote.num_resyncs) if self._remote is not None else 0
        if self.members is not None:  # a portfolio's members
            st.drafter_steps = self.members.drafter_stats()
        if self.prediction_steps["steps"]:  # requests' predicted outputs, beside the drafter(s)
            st.drafter_steps = {**st.drafter_steps, PREDICTION: dict(self.prediction_steps)}
        if self.adaptive is not None:  # from the measured step costs; the router's default gate
            st.break_even_alpha = self.adaptive.break_even_alpha(self.config.max_draft_tokens)


def build_spec_controller(config: EngineConfig, model, proposer: Proposer | None = None) -> SpecController | None:
    """Build the drafter named by config.spec.drafter (or use an injected one, e.g. remote)."""
    from cluster.speculative.moe import MoeGate

    spec_cfg = config.spec
    spec = parse_drafter_choice(spec_cfg.drafter)
    if spec is None and proposer is None:
        return None
    name = spec_cfg.drafter
    if proposer is None:  # its drafter, or the union of the per-segment ones
        proposer, prior = build_drafters(spec_cfg, config, model)
    else:
        if len(spec_cfg.drafters()) > 1:
            raise ValueError("per-segment drafters need the drafters built here, not one injected "
                             "(placement 'separate' serves the global drafter only)")
        if isinstance(proposer, RemoteDraft) and proposer.expected_vocab_size is None:  # q must be this wide
            proposer.expected_vocab_size = model.runner.vocab_size
        if isinstance(proposer, TargetFeatureReader):  # a remote EAGLE head reads this target's features
            proposer.attach_target(model.runner)
        prior = draft_cost_ratio(proposer, model.runner)
    gate = MoeGate.for_config(model.hf_config, validated=spec_cfg.moe_validated,
                              min_draft_tokens=spec_cfg.moe_min_draft_tokens)
    step_costs = measure_step_costs(model.runner, spec_cfg.max_draft_tokens) if spec_cfg.adaptive else None
    return SpecController(spec_cfg, proposer, name, gate, model.runner.max_model_len,
                          prior, step_costs, model.runner.vocab_size)
