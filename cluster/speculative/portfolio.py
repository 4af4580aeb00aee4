"""Drafter portfolio: per sequence and per step, the drafter expected to commit the most tokens
per unit of cost.

Owns: ``PortfolioProposer`` (DrafterKind.PORTFOLIO) over named member proposers (n-gram and
suffix by default; any ``Proposer``, e.g. a model drafter, can join with its cost), the
acceptance it measures per member, draft context and segment, per-member counts for the stats, and
``SegmentRoutes`` (each sequence drafts with its segment's members only).

How it chooses. A member's acceptance is two rates: α1, its first draft token's (accepted or
rejected), and α, each later token's given the ones before were accepted — the geometric
estimate, accepted tokens over (accepted + rejections); plain accepted / drafted would count the
positions after a rejection, which are never tried, as failures. One pooled rate overvalued short
drafts of weak matches (a 1-token match is right 10-20% of the time, but once its first token
is, the copy usually runs on). Both are kept per (member, the member's draft context, e.g. the
n-gram match length), per (segment, member, context) shrunk towards that, and per (sequence,
member, context) shrunk towards the segment's: a head accepted at 0.6 on json and ~0 on other
languages is judged by the traffic it drafts for. A draft of k tokens is expected to commit
E(k) = 1 + α1·(1 + α + … + α^(k-1)) tokens (the 1: the recovered or bonus token) in a step of
k · c_member + t(k + 1) + (rejection sampling's cost over plain sampling) seconds, against 1
token in t(1) for a plain step — with the engine's measured step costs (``use_costs``: adaptive
K's ``StepCostModel``, which times each member's draft rounds on its own), else the member's
prior cost and ``verify_slope`` in decode steps. A member's value is that ratio at its best k
(up to its draft's length, or ``horizon`` for a costly member — valuing an EAGLE head at 6
tokens when it pays at 2 hid it behind a 1-token n-gram match); the member with the highest
value above 1 + ``min_gain`` wins, ties to the earlier member; a member without a draft is not a
candidate.

How it learns. Members of cost 0 (no model) draft for every sequence each time (shadow drafts),
so each is measured whether chosen or not; a costly member only drafts when chosen — and so that
one that lost its segment's choices is measured there again, after ``explore_every`` lost choices
in a row it drafts once (a probe), at the first step where it could still win: valued at
optimistic rates (``optimistic_alpha``: two standard errors of the segment's own trials above
them), it must beat that step's choice — a head rejected all along on a copy-heavy segment stops
being probed against long n-gram matches it cannot beat; its K is then planned optimistic about
the first token only (what the probe asks). On the next call for the same
sequence, the tokens committed since are compared with each member's last draft: the common
prefix was accepted (exact for deterministic drafts: a rejected one-hot draft token is never
the recovered token); a mismatch inside the committed tokens is one rejection; a draft longer
than what was committed is censored there (no rejection counted). Where both model-free members
could draft, each one's context also says whether the other's draft agrees on its first token
(``+agree``, ``+differ``, ``+alone``); a sequence's contexts carry its acceptance class
(``classed_context``: ``+sampled``, whose one-hot drafts are accepted at the target's probability
of the token, about half as often as greedy ones; ``+shaped``, under penalties or ``logit_bias``). No engine
change is needed: the committed tokens arrive with the
next ``draft_context`` or ``propose``.

Routed by segment (``routes``, the engine's per-segment drafters: ``router.segments.<name>.drafter``):
each sequence drafts with its segment's members only (``SegmentRoutes``) — one member: no choice,
that member drafts whatever its value (a member with nothing to draft leaves the sequence plain
for the step); several (the segment's drafter is ``portfolio``): the choice above among them.
Only a segment's members are asked (shadow drafts, learning and stats work as above for them).

Each costly member's draft rounds are timed (``last_member_rounds``): the engine's cost model
learns every member's round cost on its own, so neither adaptive K nor this choice plans an
n-gram draft at an EAGLE head's cost or the other way round — and, apart from it, what the
member's catch-up costs per position: a head first runs the positions committed since it last
drafted for the sequence (all of a 750-token prompt on its first draft: 30 ms on 2 cores, where a
round takes 1.5). A choice charges that catch-up shared over ``catch_up_steps`` drafts, and a
probe waits longer where its catch-up is dear (``probe_budget``).

Drafts are the chosen member's, q included (a model member's q travels unchanged), so
verification stays lossless exactly as it is for that member alone.
Ignores: K (the engine's adaptive K plans it per draft context — ``draft_context`` answers
"<member>:<member's context>" — with the rates the chosen member was valued at,
``planning_alpha``: adaptive K's own estimate pools a context over segments, and a head hopeless
on other languages made it plan K = 0 on chat, where this portfolio had measured the head
winning), sampling.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from cluster.common.acceptance_class import acceptance_class as acceptance_class_of, classed_context
from cluster.common.request import SamplingParams
from cluster.speculative.adaptive_k import CostModel, catch_up_cost_of, catch_up_wait, draft_cost_of, verify_overhead
from cluster.speculative.proposer import DrafterKind, Proposer
from cluster.speculative.types import DraftProposal, ProposeInput

_GREEDY = SamplingParams(max_tokens=1)  # shadow drafts of cost-0 members (deterministic: params unused)


@dataclass(slots=True)
class Member:
    name: str
    proposer: Proposer
    cost: float = 0.0  # one draft token's cost in target decode steps; 0: drafts in the shadow too


@dataclass(slots=True)
class Rate:
    """Acceptance counts: accepted draft tokens and observed rejections."""

    accepted: float = 0.0
    rejected: float = 0.0

    def alpha(self, prior: float, weight: float) -> float:
        return (self.accepted + prior * weight) / (self.accepted + self.rejected + weight)


@dataclass(slots=True)
class Acceptance:
    """A draft's first token apart from the rest: a 1-token n-gram match is right 10-20% of the
    time, but once its first token is, the copy usually runs on (chat: 0.16 at position 1, 0.42+
    after) — one pooled rate overvalued short drafts of weak matches."""

    first: Rate = field(default_factory=Rate)  # position 1: accepted or rejected
    later: Rate = field(default_factory=Rate)  # positions 2..: geometric, censored at what was committed

    def add(self, accepted: int, observed: int) -> None:
        """A draft whose first ``accepted`` tokens matched the ``observed`` committed tokens compared."""
        if observed <= 0:
            return
        if accepted == 0:
            self.first.rejected += 1
            return
        self.first.accepted += 1
        self.later.accepted += accepted - 1
        self.later.rejected += 1 if accepted < observed else 0


@dataclass(slots=True)
class _Pending:
    """A sequence's drafts awaiting the tokens committed after them."""

    length: int  # committed tokens when drafted
    segment: str = ""
    drafts: dict[str, tuple[list[int], str]] = field(default_factory=dict)  # member -> (draft, context)
    chosen: str | None = None  # the member expected to commit most per cost (None: no candidate)
    sent: bool = False  # the chosen member's draft was returned by ``propose``
    probe: bool = False  # chosen to measure it (a costly member that had been losing), not by value
    # (α1, α) the chosen member was valued at (K is planned with them); a probe: its optimistic α1,
    # its ordinary α
    rates: tuple[float, float] | None = None
    catch_up: dict[str, int] = field(default_factory=dict)  # costly member -> positions it would run first


@dataclass(slots=True)
class MemberStats:
    steps: int = 0  # steps whose drafts this member produced
    draft_tokens: int = 0
    accepted_tokens: int = 0  # of its chosen drafts, seen in the tokens committed next

    def to_dict(self) -> dict:
        return {"steps": self.steps, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens}


@dataclass(slots=True)
class SegmentRoutes:
    """Which members may draft for each segment: ``by_segment``'s, else ``default``'s — one member
    (that drafter, no choice) or several (a portfolio among them, e.g. a segment whose drafter is
    ``portfolio`` in a union that also serves an ``eagle`` or ``ngram`` segment)."""

    default: str | tuple[str, ...]
    by_segment: dict[str, str | tuple[str, ...]] = field(default_factory=dict)

    def candidates(self, segment: str) -> tuple[str, ...]:
        got = self.by_segment.get(segment, self.default)
        return (got,) if isinstance(got, str) else tuple(got)

    def names(self) -> set[str]:
        """Every member some segment may draft with."""
        routes = [self.default, *self.by_segment.values()]
        return {n for r in routes for n in ((r,) if isinstance(r, str) else r)}


@dataclass(slots=True)
class PortfolioProposer:
    members: list[Member]
    horizon: int = 6  # draft length a cost-0 member is asked for in ``draft_context``
    verify_slope: float = 0.05  # extra target cost per verified draft token, in decode steps
    prior_alpha: float = 0.5  # α before anything is measured
    prior_weight: float = 2.0  # pseudo trials behind the prior
    seq_weight: float = 4.0  # pseudo trials of the segment's rate behind a sequence's own rate
    segment_weight: float = 4.0  # pseudo trials of the member's global rate behind a segment's rate
    explore_every: int = 16  # a costly member losing this many choices in a row in a segment is probed once
    probe_z: float = 2.0  # a probe's optimism: standard errors of the segment's rate added to it
    probe_memory: float = 64.0  # the most segment trials that shrink that optimism
    min_gain: float = 0.05  # a member must beat plain decoding by this much (adaptive K's margin)
    catch_up_steps: int = 2  # a costly member's catch-up is charged to this many of its drafts
    probe_budget: float = 0.02  # probes' catch-ups take at most this share of a segment's decode time
    routes: SegmentRoutes | None = None  # set: each sequence drafts with its segment's members only
    kind: DrafterKind = field(default=DrafterKind.PORTFOLIO, init=False)
    last_choice: dict[str, str] = field(default_factory=dict, init=False)  # seq_id -> member, last propose
    # costly member -> (draft rounds, seconds, positions it caught up on first) of the last propose:
    # the engine's cost model learns from it
    last_member_rounds: dict[str, tuple[int, float, int]] = field(default_factory=dict, init=False)
    costs: CostModel | None = field(default=None, init=False, repr=False)  # the engine's, once given
    _rates: dict[tuple[str, str], Acceptance] = field(default_factory=dict, init=False, repr=False)  # (member, ctx)
    _segment_rates: dict[tuple[str, str, str], Acceptance] = field(default_factory=dict, init=False, repr=False)
    _seq_rates: dict[str, dict[tuple[str, str], Acceptance]] = field(default_factory=dict, init=False, repr=False)
    _losses: dict[tuple[str, str], int] = field(default_factory=dict, init=False, repr=False)  # (segment, member)
    _pending: dict[str, _Pending] = field(default_factory=dict, init=False, repr=False)
    # seq_id -> costly member -> the sequence's length when the member last drafted for it
    _drafted_at: dict[str, dict[str, int]] = field(default_factory=dict, init=False, repr=False)
    _stats: dict[str, MemberStats] = field(default_factory=dict, init=False, repr=False)
    # member -> (the cost model's version, then ``_prices``' tuple)
    _price_cache: dict[str, tuple] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        names = [m.name for m in self.members]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a portfolio needs members with distinct names, got {names}")
        if any(m.cost < 0 for m in self.members) or self.horizon < 1 or self.verify_slope < 0:
            raise ValueError("member costs and verify_slope must be >= 0, horizon >= 1")
        if not 0.0 < self.prior_alpha < 1.0 or min(self.prior_weight, self.seq_weight, self.segment_weight) <= 0:
            raise ValueError("prior_alpha must be in (0, 1), prior_weight, seq_weight and segment_weight > 0")
        if self.explore_every < 1 or self.probe_z < 0 or self.probe_memory < 0:
            raise ValueError("explore_every must be >= 1, probe_z and probe_memory >= 0")
        if self.min_gain < 0 or self.catch_up_steps < 1 or not 0.0 < self.probe_budget <= 1.0:
            raise ValueError("min_gain must be >= 0, catch_up_steps >= 1 and probe_budget in (0, 1]")
        if self.routes is not None:
            unknown = self.routes.names() - set(names)
            if unknown:
                raise ValueError(f"segment routes name drafters that are not members: {sorted(unknown)}")
        self._stats = {m.name: MemberStats() for m in self.members}

    # -- Proposer ---------------------------------------------------------------------------------
    def draft_context(self, seq_id: str, token_ids: list[int], segment: str = "",
                      draft_scope: str = "", acceptance_class: str = "") -> str | None:
        pending = self._prepare(seq_id, token_ids, segment, draft_scope, acceptance_class)
        if pending.chosen is None:
            return None
        return f"{pending.chosen}:{pending.drafts[pending.chosen][1]}"

    def propose(self, inputs: list[ProposeInput]) -> DraftProposal:
        drafts: list[list[int]] = [[] for _ in inputs]
        probs: list[object] = [None] * len(inputs)
        costly: dict[str, list[int]] = {}  # member -> rows it drafts for now
        self.last_choice, self.last_member_rounds = {}, {}
        for row, inp in enumerate(inputs):
            if inp.num_draft_tokens <= 0:
                continue
            pending = self._prepare(inp.seq_id, inp.token_ids, inp.segment, inp.draft_scope,
                                    acceptance_class_of(inp.params))
            if pending.chosen is None:
                continue
            if self._member(pending.chosen).cost > 0:
                costly.setdefault(pending.chosen, []).append(row)
            else:
                drafts[row] = pending.drafts[pending.chosen][0][: inp.num_draft_tokens]
        for name, rows in costly.items():
            t0 = time.perf_counter()
            got = self._member(name).proposer.propose([inputs[r] for r in rows])
            rounds = max((len(ids) for ids in got.draft_token_ids), default=0)  # the longest draft: the rounds run
            caught_up = sum(self._pending[inputs[r].seq_id].catch_up.get(name, 0) for r in rows)
            self.last_member_rounds[name] = (rounds, time.perf_counter() - t0, caught_up)
            for r in rows:
                self._drafted_at.setdefault(inputs[r].seq_id, {})[name] = len(inputs[r].token_ids)
            for r, ids, q in zip(rows, got.draft_token_ids, got.draft_probs):
                drafts[r] = list(ids)[: inputs[r].num_draft_tokens]
                probs[r] = q[: len(drafts[r])] if q is not None and drafts[r] else None
        for inp, ids in zip(inputs, drafts):
            if ids:
                pending = self._pending[inp.seq_id]
                name = pending.chosen
                pending.sent = True
                pending.drafts[name] = (ids, pending.drafts[name][1])  # what verification sees
                self.last_choice[inp.seq_id] = name
                self._stats[name].steps += 1
                self._stats[name].draft_tokens += len(ids)
        return DraftProposal(draft_token_ids=drafts, draft_probs=probs)

    def release(self, seq_id: str) -> None:
        self._pending.pop(seq_id, None)
        self.last_choice.pop(seq_id, None)
        self._seq_rates.pop(seq_id, None)
        self._drafted_at.pop(seq_id, None)
        for m in self.members:
            m.proposer.release(seq_id)

    # -- what the stats show ------------------------------------------------------------------------
    def drafter_stats(self) -> dict[str, dict]:
        """member -> steps it drafted for, its draft tokens, and how many of those were accepted."""
        return {name: st.to_dict() for name, st in self._stats.items()}

    def alpha(self, member: str, context: str = "", seq_id: str | None = None, segment: str | None = None,
              later: bool = False) -> float:
        """The acceptance rate the portfolio plans with for ``member``'s first draft token in
        ``context`` (``later``: for each token after an accepted one): the member's global rate
        there, the segment's shrunk towards it (an EAGLE head is accepted at 0.6 on json and ~0
        on other languages), the sequence's shrunk towards that."""
        def part(acc: Acceptance | None) -> Rate:
            return Rate() if acc is None else (acc.later if later else acc.first)

        a = part(self._rates.get((member, context))).alpha(self.prior_alpha, self.prior_weight)
        if segment is not None:
            a = part(self._segment_rates.get((segment, member, context))).alpha(a, self.segment_weight)
        if seq_id is None:
            return a
        return part(self._seq_rates.get(seq_id, {}).get((member, context))).alpha(a, self.seq_weight)

    def planning_alpha(self, seq_id: str) -> tuple[float, float] | None:
        """(α1, α) the member chosen for the sequence's next draft was valued at — adaptive K plans
        its K with them (its own estimator pools a draft context over segments: a head hopeless
        on other languages planned K = 0 on chat, where this portfolio had measured it winning,
        and the portfolio's probes there drafted nothing); on a probe, its optimistic first-token
        rate and its ordinary later rate (what a probe asks is the first token). None:
        no choice was made (nothing to draft, or the segment's one routed member)."""
        pending = self._pending.get(seq_id)
        return None if pending is None or pending.chosen is None else pending.rates

    def member_cost_priors(self) -> dict[str, float]:
        """member -> its prior cost per draft round, in target decode steps."""
        return {m.name: m.cost for m in self.members}

    def member_of(self, context: str) -> str:
        """The member a ``draft_context`` label belongs to ("<member>:<member's context>")."""
        return context.split(":", 1)[0]

    def use_costs(self, costs: CostModel) -> None:
        """Plan with the engine's measured step costs (its members' round costs included)."""
        self.costs = costs
        self._price_cache.clear()

    def expected_per_cost(self, member: Member, k: int, alpha: float, later: float | None = None,
                          catch_up: int = 0) -> float:
        """Tokens committed per unit time drafting k tokens with ``member`` (its first token
        accepted at ``alpha``, each next one at ``later``, default the same; ``catch_up``
        positions to run first), relative to plain decoding (1.0: as fast as plain)."""
        return self._per_cost(member, k, alpha, later, catch_up)[-1] if k >= 1 else 0.0

    def value(self, member: Member, max_k: int, alpha: float, later: float | None = None,
              catch_up: int = 0) -> float:
        """``expected_per_cost`` at the member's best k in [1, max_k]."""
        return max(self._per_cost(member, max_k, alpha, later, catch_up), default=0.0)

    def _per_cost(self, member: Member, max_k: int, alpha: float, later: float | None, catch_up: int = 0) -> list[float]:
        """``expected_per_cost`` for k = 1 .. max_k in one pass: E(k) = 1 + α1·(1 + α + … +
        α^(k-1)) tokens in k·c_member + t(k+1) + verification's extra sampling seconds + the
        member's catch-up (``catch_up`` positions at its measured cost per position, shared by
        ``catch_up_steps`` drafts: once caught up, the drafts after it ride on it), against 1
        token in t(1); without measured costs, in 1 + (verify_slope + the member's prior cost)·k
        decode steps."""
        first = min(max(alpha, 0.0), 1.0)
        rest = first if later is None else min(max(later, 0.0), 1.0)
        plain, per_round, extra, times = self._prices(member, max_k)
        if catch_up > 0 and self.costs is not None:
            extra += catch_up * catch_up_cost_of(self.costs, member.name) / self.catch_up_steps
        out, run, power = [], 0.0, 1.0
        for k in range(1, max_k + 1):
            run += power  # 1 + α + … + α^(k-1)
            power *= rest
            out.append((1.0 + first * run) * plain / max(per_round * k + times[k] + extra, 1e-12))
        return out

    def _prices(self, member: Member, max_k: int) -> tuple[float, float, float, list[float]]:
        """(t(1), seconds per draft round of ``member``, a drafting step's extra seconds
        (verification's sampling), [_, t(2), …, t(max_k + 1)]); without measured costs, in
        decode steps (1, verify_slope + the member's prior cost, 1, zeros). Kept per member while
        the cost model's ``version`` stands: valuing the members read the same few step times
        ~40 times a step (~0.1 ms with the calls around them, of a ~1.5 ms host share)."""
        costs = self.costs
        if costs is None:
            return 1.0, self.verify_slope + member.cost, 1.0, [0.0] * (max_k + 1)
        version = getattr(costs, "version", None)
        got = self._price_cache.get(member.name)
        if got is not None and version is not None and got[0] == version and len(got[4]) > max_k:
            return got[1:]
        times = [0.0] + [costs.target_time(k + 1) for k in range(1, max(max_k, self.horizon) + 1)]
        prices = (costs.target_time(1), draft_cost_of(costs, member.name),
                  verify_overhead(costs, {member.name: 1}), times)
        if version is not None:
            self._price_cache[member.name] = (version, *prices)
        return prices

    # -- internals ----------------------------------------------------------------------------------
    def _member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def _prepare(self, seq_id: str, token_ids: list[int], segment: str, draft_scope: str = "",
                 acceptance_class: str = "") -> _Pending:
        """Learn from the tokens committed since the sequence's last drafts, then draft with the
        cost-0 members and choose; cached until the sequence's tokens change. The
        sequence's contexts carry its acceptance class (``classed_context``): its rates are learnt
        apart."""
        pending = self._pending.get(seq_id)
        if pending is not None and pending.length == len(token_ids):
            return pending
        if pending is not None and pending.length < len(token_ids):
            self._learn(seq_id, pending, token_ids[pending.length:])
        pending = self._pending[seq_id] = _Pending(len(token_ids), segment)
        best, best_value = None, 1.0 + self.min_gain  # a candidate must beat plain decoding
        candidates = [self._member(n) for n in self.routes_of(segment)]
        routed = self.routes is not None and len(candidates) == 1  # the segment's one drafter: no choice
        found: list[tuple[Member, int]] = []  # members with something to draft, the draft's length
        for m in candidates:
            context_of = getattr(m.proposer, "draft_context", None)
            ctx = context_of(seq_id, token_ids, segment, draft_scope) if context_of is not None else ""
            if ctx is None:
                continue
            if m.cost > 0:
                draft, k = [], self.horizon
                pending.catch_up[m.name] = self._positions_behind(seq_id, m.name, len(token_ids))
            else:
                inp = ProposeInput(seq_id, token_ids, self.horizon, _GREEDY, segment=segment, draft_scope=draft_scope)
                draft = list(m.proposer.propose([inp]).draft_token_ids[0])
                k = len(draft)
                if not k:
                    continue
            pending.drafts[m.name] = (draft, ctx)
            if routed:  # the segment's drafter, whatever its value: adaptive K plans its K
                best = m.name
                break
            found.append((m, k))
        if not routed:
            self._refine_by_agreement(pending, candidates, [m for m, _ in found])
        if acceptance_class:
            pending.drafts = {name: (draft, classed_context(ctx, acceptance_class)) for name, (draft, ctx) in pending.drafts.items()}
        for m, k in found:
            ctx = pending.drafts[m.name][1]
            rates = (self.alpha(m.name, ctx, seq_id, segment), self.alpha(m.name, ctx, seq_id, segment, later=True))
            value = self.value(m, k, *rates, catch_up=pending.catch_up.get(m.name, 0))
            if value > best_value:
                best, best_value, pending.rates = m.name, value, rates
        pending.chosen = best
        if not routed:
            self._explore(seq_id, pending, best, best_value)
        return pending

    def _refine_by_agreement(self, pending: _Pending, candidates: list[Member], found: list[Member]) -> None:
        """Where two or more cost-0 members could draft, each one's context says whether another
        one's draft starts with the same token ("+agree"), only with others ("+differ") or
        whether it alone has a draft ("+alone"): acceptance is learnt apart for each. Copy-heavy
        traffic showed why: a suffix match found where prompt lookup finds none (from the
        segment's other documents) was accepted ~0-25% of the time, the same match length
        backed by prompt lookup 60%+ — pooled, the lone drafts looked worth a verification."""
        if sum(1 for m in candidates if m.cost <= 0) < 2:  # the segment's members: nothing to compare
            return
        firsts = {m.name: pending.drafts[m.name][0][0] for m in found if m.cost <= 0}
        for name, first in firsts.items():
            others = [f for other, f in firsts.items() if other != name]
            tag = "alone" if not others else "agree" if first in others else "differ"
            draft, ctx = pending.drafts[name]
            pending.drafts[name] = (draft, f"{ctx}+{tag}")

    def _positions_behind(self, seq_id: str, member: str, length: int) -> int:
        """Committed positions a costly member would run before drafting for the sequence: those
        since it last drafted for it (an EAGLE head holds its K/V up to there), else all but the
        last token (it never ran the sequence)."""
        since = self._drafted_at.get(seq_id, {}).get(member)
        return max(0, length - 1 if since is None else length - since)

    def routes_of(self, segment: str) -> tuple[str, ...]:
        """The members that may draft for ``segment``."""
        return tuple(m.name for m in self.members) if self.routes is None else self.routes.candidates(segment)

    def _explore(self, seq_id: str, pending: _Pending, best: str | None, best_value: float) -> None:
        """A costly member drafts only when chosen, so one that lost its segment's choices
        would never be measured there again: after ``explore_every`` lost choices in a row it
        drafts once (a probe) — at the first step where it could still win: valued at its
        optimistic rates (``optimistic_alpha``), it must beat the step's choice (or plain). The
        interval stays fixed: backing off after probes that commit nothing starved a head
        accepted at 0.4 (its probes fail more often than not) of the measurements that would
        have shown it wins; the optimism fades with the segment's measurements instead, so a
        head rejected all along on a copy-heavy segment stops being probed against long
        n-gram matches it cannot beat (each probe there cost a catch-up over the sequence)."""
        for name, (_, ctx) in pending.drafts.items():
            member = self._member(name)
            if name == best or member.cost <= 0:
                continue
            key = (pending.segment, name)
            self._losses[key] = self._losses.get(key, 0) + 1
            catch_up = pending.catch_up.get(name, 0)
            if pending.probe or self._losses[key] < self._probe_interval(name, catch_up):
                continue
            first = self.optimistic_alpha(name, ctx, seq_id, pending.segment)
            hope_rates = (first, self.optimistic_alpha(name, ctx, seq_id, pending.segment, later=True))
            if self.value(member, self.horizon, *hope_rates, catch_up=catch_up) <= best_value:
                continue  # cannot win this step even at its optimistic rate: probe at a later one
            self._losses[key] = 0
            # K is planned optimistic about the first token only — what a probe asks; planned at
            # both optimistic rates, probes drafted 5 tokens where the head was rejected at once
            pending.chosen, pending.probe = name, True
            pending.rates = (first, self.alpha(name, ctx, seq_id, pending.segment, later=True))

    def _probe_interval(self, member: str, catch_up: int) -> int:
        """Lost choices in a row before a probe: ``explore_every``, or more where the probe's
        catch-up is dear — its seconds at most ``probe_budget`` of the decode steps in between (a
        head probed on long summarize or edit prompts ran 100-750 positions first, 5-30 ms, every
        16 steps: 2-3% of those segments' time for a member that lost there)."""
        if self.costs is None:
            return self.explore_every
        return max(self.explore_every, catch_up_wait(self.costs, member, catch_up, self.probe_budget))

    def optimistic_alpha(self, member: str, context: str, seq_id: str | None, segment: str,
                         later: bool = False) -> float:
        """``member``'s first-token rate (``later``: its rate after an accepted token) plus
        ``probe_z`` standard errors of the segment's own trials of it there (at most
        ``probe_memory`` of them count: the bonus never quite vanishes, so a segment whose
        traffic changes is probed again where the member could win)."""
        a = self.alpha(member, context, seq_id, segment, later=later)
        got = self._segment_rates.get((segment, member, context))
        rate = None if got is None else (got.later if later else got.first)
        n = 0.0 if rate is None else rate.accepted + rate.rejected
        return min(1.0, a + self.probe_z * math.sqrt(a * (1.0 - a) / (min(n, self.probe_memory) + 1.0)))

    def _learn(self, seq_id: str, pending: _Pending, committed: list[int]) -> None:
        for name, (draft, ctx) in pending.drafts.items():
            if not draft:
                continue
            n = min(len(draft), len(committed))
            accepted = 0
            while accepted < n and draft[accepted] == committed[accepted]:
                accepted += 1
            for acc in (self._rates.setdefault((name, ctx), Acceptance()),
                        self._segment_rates.setdefault((pending.segment, name, ctx), Acceptance()),
                        self._seq_rates.setdefault(seq_id, {}).setdefault((name, ctx), Acceptance())):
                acc.add(accepted, n)  # past what was committed: censored
            if pending.sent and name == pending.chosen:
                self._losses[(pending.segment, name)] = 0
                self._stats[name].accepted_tokens += accepted


def default_portfolio(ngram_min: int = 1, ngram_max: int = 4, horizon: int = 6,
                      extra: list[Member] | tuple[Member, ...] = (), suffix_corpus=None) -> PortfolioProposer:
    """``--draft portfolio``: n-gram prompt lookup and suffix drafting (over ``suffix_corpus`` too,
    when given), then ``extra`` members (the engine adds an EAGLE head trained for its target and
    the suffix corpus written by it: ``cluster.engine.drafters.build_portfolio``)."""
    from cluster.speculative.ngram import NgramProposer
    from cluster.speculative.suffix import SuffixProposer

    return PortfolioProposer([Member("ngram", NgramProposer(ngram_min, ngram_max)),
                              Member("suffix", SuffixProposer(corpus=suffix_corpus)), *extra], horizon=horizon)
