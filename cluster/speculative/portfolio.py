"""Drafter portfolio: per sequence and per step, the drafter expected to commit the most tokens
per unit of cost.

Owns: ``PortfolioProposer`` (DrafterKind.PORTFOLIO) over named member proposers (n-gram and
suffix by default; any ``Proposer``, e.g. a model drafter, can join with its cost), the
acceptance it measures per member and draft context, per-member counts for the stats, and
``SegmentRoutes`` (route each sequence to its segment's member instead of choosing).

How it chooses. A member's acceptance α is a per-position rate, learnt as accepted draft tokens
over (accepted + rejections) — the geometric estimate; plain accepted / drafted would count the
positions after a rejection, which are never tried, as failures and bias α low. It is kept per
(member, the member's draft context, e.g. the n-gram match length) and per (sequence, member),
the sequence's own rate shrunk towards the global one. A draft of k tokens is expected to commit
1 + α + … + α^k tokens (the +1: the recovered or bonus token) at a cost of
1 + (verify_slope + member cost) · k target decode steps; the member with the highest ratio wins,
ties to the earlier member; a member without a draft is not a candidate.

How it learns. Members of cost 0 (no model) draft for every sequence each time (shadow drafts),
so each is measured whether chosen or not; a costly member only drafts when chosen. On the next
call for the same sequence, the tokens committed since are compared with each member's last
draft: the common prefix was accepted (exact for deterministic drafts: a rejected one-hot draft
token is never the recovered token); a mismatch inside the committed tokens is one rejection;
a draft longer than what was committed is censored there (no rejection counted). No engine change
is needed: the committed tokens arrive with the next ``draft_context`` or ``propose``.

Routed by segment (``routes``, the engine's per-segment drafters: ``router.segments.<name>.drafter``):
no choice — each sequence drafts with its segment's member (``SegmentRoutes``), and only that
member is asked (shadow drafts, learning and stats work as above for it); a member with nothing
to draft leaves the sequence plain for the step.

Drafts are the chosen member's, q included (a model member's q travels unchanged), so
verification stays lossless exactly as it is for that member alone.
Ignores: K (the engine's adaptive K plans it per draft context; ``draft_context`` answers
"<member>:<member's context>", so acceptance is learnt per member there too), sampling.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cluster.common.request import SamplingParams
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
    """Geometric acceptance counts: accepted draft tokens and observed rejections."""

    accepted: float = 0.0
    rejected: float = 0.0

    def alpha(self, prior: float, weight: float) -> float:
        return (self.accepted + prior * weight) / (self.accepted + self.rejected + weight)


@dataclass(slots=True)
class _Pending:
    """A sequence's drafts awaiting the tokens committed after them."""

    length: int  # committed tokens when drafted
    drafts: dict[str, tuple[list[int], str]] = field(default_factory=dict)  # member -> (draft, context)
    chosen: str | None = None  # the member expected to commit most per cost (None: no candidate)
    sent: bool = False  # the chosen member's draft was returned by ``propose``


@dataclass(slots=True)
class MemberStats:
    steps: int = 0  # steps whose drafts this member produced
    draft_tokens: int = 0
    accepted_tokens: int = 0  # of its chosen drafts, seen in the tokens committed next

    def to_dict(self) -> dict:
        return {"steps": self.steps, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens}


@dataclass(slots=True)
class SegmentRoutes:
    """Which member drafts for each segment: ``by_segment``'s, else ``default``'s."""

    default: str
    by_segment: dict[str, str] = field(default_factory=dict)

    def member(self, segment: str) -> str:
        return self.by_segment.get(segment, self.default)


@dataclass(slots=True)
class PortfolioProposer:
    members: list[Member]
    horizon: int = 6  # draft length a cost-0 member is asked for in ``draft_context``
    verify_slope: float = 0.05  # extra target cost per verified draft token, in decode steps
    prior_alpha: float = 0.5  # α before anything is measured
    prior_weight: float = 2.0  # pseudo trials behind the prior
    seq_weight: float = 4.0  # pseudo trials of the global rate behind a sequence's own rate
    routes: SegmentRoutes | None = None  # set: route each sequence by its segment, no choice
    kind: DrafterKind = field(default=DrafterKind.PORTFOLIO, init=False)
    last_choice: dict[str, str] = field(default_factory=dict, init=False)  # seq_id -> member, last propose
    _rates: dict[tuple[str, str], Rate] = field(default_factory=dict, init=False, repr=False)
    _seq_rates: dict[tuple[str, str], Rate] = field(default_factory=dict, init=False, repr=False)
    _pending: dict[str, _Pending] = field(default_factory=dict, init=False, repr=False)
    _stats: dict[str, MemberStats] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        names = [m.name for m in self.members]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a portfolio needs members with distinct names, got {names}")
        if any(m.cost < 0 for m in self.members) or self.horizon < 1 or self.verify_slope < 0:
            raise ValueError("member costs and verify_slope must be >= 0, horizon >= 1")
        if not 0.0 < self.prior_alpha < 1.0 or self.prior_weight <= 0 or self.seq_weight <= 0:
            raise ValueError("prior_alpha must be in (0, 1), prior_weight and seq_weight > 0")
        if self.routes is not None:
            unknown = {self.routes.default, *self.routes.by_segment.values()} - set(names)
            if unknown:
                raise ValueError(f"segment routes name drafters that are not members: {sorted(unknown)}")
        self._stats = {m.name: MemberStats() for m in self.members}

    # -- Proposer ---------------------------------------------------------------------------------
    def draft_context(self, seq_id: str, token_ids: list[int], segment: str = "") -> str | None:
        pending = self._prepare(seq_id, token_ids, segment)
        if pending.chosen is None:
            return None
        return f"{pending.chosen}:{pending.drafts[pending.chosen][1]}"

    def propose(self, inputs: list[ProposeInput]) -> DraftProposal:
        drafts: list[list[int]] = [[] for _ in inputs]
        probs: list[object] = [None] * len(inputs)
        costly: dict[str, list[int]] = {}  # member -> rows it drafts for now
        self.last_choice = {}
        for row, inp in enumerate(inputs):
            if inp.num_draft_tokens <= 0:
                continue
            pending = self._prepare(inp.seq_id, inp.token_ids, inp.segment)
            if pending.chosen is None:
                continue
            if self._member(pending.chosen).cost > 0:
                costly.setdefault(pending.chosen, []).append(row)
            else:
                drafts[row] = pending.drafts[pending.chosen][0][: inp.num_draft_tokens]
        for name, rows in costly.items():
            got = self._member(name).proposer.propose([inputs[r] for r in rows])
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
        for m in self.members:
            self._seq_rates.pop((seq_id, m.name), None)
            m.proposer.release(seq_id)

    # -- what the stats show ------------------------------------------------------------------------
    def drafter_stats(self) -> dict[str, dict]:
        """member -> steps it drafted for, its draft tokens, and how many of those were accepted."""
        return {name: st.to_dict() for name, st in self._stats.items()}

    def alpha(self, member: str, context: str = "", seq_id: str | None = None) -> float:
        """The acceptance rate the portfolio plans with for ``member`` in ``context``."""
        g = self._rates.get((member, context), Rate()).alpha(self.prior_alpha, self.prior_weight)
        if seq_id is None:
            return g
        return self._seq_rates.get((seq_id, member), Rate()).alpha(g, self.seq_weight)

    def expected_per_cost(self, member: Member, k: int, alpha: float) -> float:
        committed = sum(alpha ** i for i in range(k + 1))  # 1 + α + … + α^k
        return committed / (1.0 + (self.verify_slope + member.cost) * k)

    # -- internals ----------------------------------------------------------------------------------
    def _member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def _prepare(self, seq_id: str, token_ids: list[int], segment: str) -> _Pending:
        """Learn from the tokens committed since the sequence's last drafts, then draft with the
        cost-0 members and choose; cached until the sequence's tokens change."""
        pending = self._pending.get(seq_id)
        if pending is not None and pending.length == len(token_ids):
            return pending
        if pending is not None and pending.length < len(token_ids):
            self._learn(seq_id, pending, token_ids[pending.length:])
        pending = self._pending[seq_id] = _Pending(len(token_ids))
        best, best_value = None, 1.0  # a candidate must beat plain decoding (1 token per step)
        routed = self.routes is not None
        for m in [self._member(self.routes.member(segment))] if routed else self.members:
            context_of = getattr(m.proposer, "draft_context", None)
            ctx = context_of(seq_id, token_ids, segment) if context_of is not None else ""
            if ctx is None:
                continue
            if m.cost > 0:
                draft, k = [], self.horizon
            else:
                inp = ProposeInput(seq_id, token_ids, self.horizon, _GREEDY, segment=segment)
                draft = list(m.proposer.propose([inp]).draft_token_ids[0])
                k = len(draft)
                if not k:
                    continue
            pending.drafts[m.name] = (draft, ctx)
            if routed:  # the segment's drafter, whatever its value: adaptive K plans its K
                best = m.name
                break
            value = self.expected_per_cost(m, k, self.alpha(m.name, ctx, seq_id))
            if value > best_value:
                best, best_value = m.name, value
        pending.chosen = best
        return pending

    def _learn(self, seq_id: str, pending: _Pending, committed: list[int]) -> None:
        for name, (draft, ctx) in pending.drafts.items():
            if not draft:
                continue
            n = min(len(draft), len(committed))
            accepted = 0
            while accepted < n and draft[accepted] == committed[accepted]:
                accepted += 1
            rejected = 1.0 if accepted < n else 0.0  # past what was committed: censored
            for rate in (self._rates.setdefault((name, ctx), Rate()), self._seq_rates.setdefault((seq_id, name), Rate())):
                rate.accepted += accepted
                rate.rejected += rejected
            if pending.sent and name == pending.chosen:
                self._stats[name].accepted_tokens += accepted


def default_portfolio(ngram_min: int = 1, ngram_max: int = 4, horizon: int = 6,
                      extra: list[Member] | tuple[Member, ...] = ()) -> PortfolioProposer:
    """``--draft portfolio``: n-gram prompt lookup and suffix drafting, then ``extra`` members (the
    engine adds an EAGLE head trained for its target: ``cluster.engine.drafters.build_portfolio``)."""
    from cluster.speculative.ngram import NgramProposer
    from cluster.speculative.suffix import SuffixProposer

    return PortfolioProposer([Member("ngram", NgramProposer(ngram_min, ngram_max)),
                              Member("suffix", SuffixProposer()), *extra], horizon=horizon)
