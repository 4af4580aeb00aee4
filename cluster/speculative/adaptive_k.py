"""Adaptive K: how many draft tokens each sequence should get this step (0 = decode plainly).

Owns: the online step-cost model (``StepCostModel``: draft cost per round, of the drafter as a
whole and of each named drafter of a portfolio; target forward time as a linear function of
batch tokens), the choice of K for one sequence (``choose_k``) and for a whole batch
(``AdaptiveK``), plus a deterministic exploration schedule so sequences parked at K=0 keep
measuring α. Ignores: how α is estimated (``cluster.speculative.acceptance``:
``AcceptanceEstimator``), timing itself (the engine measures and calls ``observe_*``), the
router's segment policy, and fixed-K configurations.

Model. α is the per-position probability that the target accepts a draft token (arXiv
2211.17192), so a step with K drafts commits E(K) = (1 - α^(K+1)) / (1 - α) tokens on average
(K + 1 when α = 1; 1 when K = 0). A step costs K draft rounds plus one target forward over every
token in the batch, plus — when anything was drafted — what rejection sampling costs beyond a
plain step's sampling (measured: ~0.6 ms of a 13 ms decode step on the 2-core development VM,
enough to make a 1-token draft at α 0.17 a loss the model called a gain). α here is always the
per-position probability, never accepted / drafted (``cluster.speculative.acceptance`` says why
the two differ).
"""
from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from cluster.speculative.acceptance import Alpha, AcceptanceEstimator, expected_committed


class CostModel(Protocol):
    @property
    def draft_cost(self) -> float: ...

    def target_time(self, num_tokens: int) -> float: ...


def draft_cost_of(costs: CostModel, drafter: str) -> float:
    """Seconds per draft round of ``drafter`` (a portfolio's member, "" = the engine's drafter as a
    whole); a cost model without per-drafter costs has one cost for every drafter."""
    per = getattr(costs, "draft_cost_of", None) if drafter else None
    return costs.draft_cost if per is None else per(drafter)


def draft_seconds(rounds: Mapping[str, int], costs: CostModel) -> float:
    """The draft phase of a step: each drafter runs its rounds (the most any of its sequences
    asked) one drafter after the other."""
    return sum(n * draft_cost_of(costs, d) for d, n in rounds.items() if n > 0)


def catch_up_cost_of(costs: CostModel, drafter: str) -> float:
    """Seconds ``drafter`` ("": the engine's) spends per committed position it runs before
    drafting (an EAGLE head catching up on the target's features since its last draft for the
    sequence); 0 for a cost model that does not measure it."""
    per = getattr(costs, "catch_up_cost_of", None)
    return 0.0 if per is None else per(drafter)


def catch_up_wait(costs: CostModel, drafter: str, positions: int, budget: float) -> int:
    """Plain steps a probe of ``drafter`` waits so that its catch-up over ``positions`` costs at
    most ``budget`` of the decode time in between (0 while its catch-up is unmeasured)."""
    seconds = max(0, positions) * catch_up_cost_of(costs, drafter)
    return math.ceil(seconds / (budget * costs.target_time(1))) if seconds > 0 else 0


def verify_overhead(costs: CostModel, rounds: Mapping[str, int]) -> float:
    """What verifying costs beyond a plain step's sampling, charged once to a step in which any
    sequence drafts (0 for a cost model that does not measure it)."""
    return getattr(costs, "verify_overhead", 0.0) if any(n > 0 for n in rounds.values()) else 0.0


@dataclass(slots=True)
class _Mean:
    """Measured seconds (of one drafter's draft round, of a step's sampling): a running mean that
    turns into an EWMA, each observation clipped to ``clip`` times the estimate so far — one
    spike (a head's first catch-up over a long prompt, a page fault) would otherwise price a
    drafter out of its own measurements, which it only gets when chosen."""

    seconds: float = 0.0
    n: int = 0
    clip: float = 3.0

    def observe(self, per_round: float, ewma: float, prior: float | None = None) -> None:
        """``prior``: the estimate before any observation (clips the first one)."""
        bound = self.seconds if self.n else prior
        if bound is not None and bound > 0:
            per_round = min(per_round, self.clip * bound)
        if self.n == 0:
            self.seconds = per_round  # a prior served until now; trust data
        self.n += 1
        beta = max(ewma, 1.0 / (self.n + 1))
        self.seconds += beta * (per_round - self.seconds)


@dataclass(slots=True)
class _CatchUp:
    """Seconds per committed position a drafter runs before drafting (``g`` of ``_DraftCost``),
    learnt from proposes that caught up at least ``min_positions``."""

    per_position: _Mean = field(default_factory=_Mean)
    min_positions: int = 32

    def rounds_share(self, rounds: int, seconds: float, positions: int, per_round: float | None,
                     ewma: float) -> float:
        """A propose of ``rounds`` rounds after ``positions`` caught up took ``seconds`` -> the
        seconds its rounds took (learning ``g`` from what ``per_round`` does not explain)."""
        if positions >= self.min_positions and per_round is not None:
            self.per_position.observe(max(0.0, seconds - rounds * per_round) / positions, ewma)
        return max(0.0, seconds - max(0, positions) * self.per_position.seconds)


@dataclass(slots=True)
class _DraftCost:
    """One named drafter's measured costs: seconds ≈ c·rounds + g·positions caught up. A draft
    model that keeps its own state (an EAGLE head) first runs the positions committed since its
    last draft for the sequence — all of the prompt on its first — so a propose after a long gap
    took 5-30 ms where a round takes ~1.5 ms (the default model's head, 2 cores): averaged into
    the round cost, those catch-ups priced the head 15-30% dearer on every segment after the
    copy-heavy ones where it is only probed. ``g`` (``_CatchUp``) is learnt from proposes that caught
    up at least its ``min_positions`` (below that a batch of positions costs about what one does),
    from what the rounds do not explain; the round cost from what the catch-up does not."""

    per_round: _Mean = field(default_factory=_Mean)
    catch_up: _CatchUp = field(default_factory=_CatchUp)

    def observe(self, rounds: int, seconds: float, positions: int, ewma: float, prior: float | None) -> None:
        per_round = self.per_round.seconds if self.per_round.n else prior  # None: nothing to tell them apart by
        seconds = self.catch_up.rounds_share(rounds, seconds, positions, per_round, ewma)
        self.per_round.observe(seconds / rounds, ewma, prior)


@dataclass(slots=True)
class _Window:
    """The last ``size`` target forwards (tokens, seconds), with what the fit reads kept up to
    date as forwards come and go: the sums of n, n², t and n·t, and each token count's seconds
    (their median recomputed only for the counts that changed). Refitting from the whole window
    each step cost ~0.1 ms, and the engine refits once a step (2-core VM)."""

    size: int
    obs: deque = field(default_factory=deque)  # (n, t), oldest first
    by_count: dict[int, deque] = field(default_factory=dict)  # n -> its seconds, oldest first
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])  # Σn, Σn², Σt, Σn·t
    changed: set[int] = field(default_factory=set)  # counts whose median is stale
    _since_exact: int = 0

    def add(self, n: int, t: float) -> None:
        self.obs.append((n, t))
        self.by_count.setdefault(n, deque()).append(t)
        self._shift(n, t, 1.0)
        if len(self.obs) > self.size:
            old_n, old_t = self.obs.popleft()
            kept = self.by_count[old_n]
            kept.popleft()
            if not kept:
                del self.by_count[old_n]
            self._shift(old_n, old_t, -1.0)
        self._since_exact += 1
        if self._since_exact >= 4 * self.size:  # running sums drift: recompute them now and then
            self.sums = [sum(float(n) for n, _ in self.obs), sum(float(n) * n for n, _ in self.obs),
                         sum(t for _, t in self.obs), sum(n * t for n, t in self.obs)]
            self._since_exact = 0

    def _shift(self, n: int, t: float, sign: float) -> None:
        s = self.sums
        s[0] += sign * n
        s[1] += sign * n * n
        s[2] += sign * t
        s[3] += sign * n * t
        self.changed.add(n)


@dataclass(slots=True)
class StepCostModel:
    """Measured step costs. Draft: seconds per draft round (one drafted token for every
    speculating sequence), a running mean that turns into an EWMA (``draft_ewma``). Target:
    t(n) = a + b·n seconds for a forward over n batch tokens, a least-squares fit over the last
    ``window`` observations with two weak priors: a ≈ ``target_a_prior`` (``intercept_prior_weight``
    pseudo observations; it only matters before data) and b ≈ ``slope_prior_ratio``·a (the cost
    of one more token relative to a decode forward; weight ``slope_prior_weight`` in tokens², as if
    one observation sat 8 tokens away). So decode-only data (one batch size) fits t there exactly
    and keeps the prior slope ratio; data over many batch sizes overrides both priors.

    A token count seen at least ``min_points`` times in the window costs the median of those
    forwards, not the line: on a CPU a 1-token forward takes the matrix-vector path and a 2-token
    one is ~2 ms dearer on a 13 ms step, ~0.6 ms a token after that — one line through both
    overstated t(1) by 4-7% and understated t(3) by up to 10% (the default model, 2 cores), so a
    draft that barely paid on paper (an EAGLE head at α 0.3 on long edit prompts) lost in fact.
    The median, not the mean: with the few 2-token forwards a parked drafter's probes leave in the
    window, one slowed by the machine priced t(2) 25% above t(1) and moved the break-even α from
    ~0.2 to 0.36 within a minute (the EAGLE head, 2 cores). Only the window's forwards count:
    keeping each count's last forwards however old priced t(2) from a noisy minute long after
    (the drafter, parked by that price, made no new 2-token forwards to correct it)."""

    draft_cost_prior: float = 0.002
    target_a_prior: float = 0.02
    # draft cost per round as a fraction of a target decode step, used until the first draft is
    # timed (ngram: 0; self:L and draft models: their share of the target's weights). Seconds
    # priors are machine-specific; a ratio times the measured decode step is not.
    draft_cost_ratio_prior: float | None = None
    # the same prior per named drafter (a portfolio's members, each timed on its own: an n-gram
    # round costs ~0, an EAGLE head's a measurable share of a decode step)
    draft_cost_ratio_priors: dict[str, float] = field(default_factory=dict)
    slope_prior_ratio: float = 1.0 / 256  # a 256-token forward costs twice a decode step
    intercept_prior_weight: float = 0.01
    slope_prior_weight: float = 64.0
    window: int = 128
    min_points: int = 3  # forwards of exactly n tokens in the window that price t(n) by their median
    draft_ewma: float = 0.05
    _draft_cost: float = field(default=0.0, init=False)
    _draft_n: int = field(default=0, init=False)
    _by_drafter: dict[str, _DraftCost] = field(default_factory=dict, init=False, repr=False)
    _catch_up: _CatchUp = field(default_factory=_CatchUp, init=False, repr=False)  # the engine's drafter
    # seconds a step spends outside the forward and the drafter picking its tokens: sampling
    # (plain) or rejection sampling (speculative); their difference is what verifying costs extra
    _sampling: dict[bool, _Mean] = field(default_factory=dict, init=False, repr=False)
    _obs: _Window = field(init=False, repr=False)
    _fit: tuple[float, float] | None = field(default=None, init=False, repr=False)
    _medians: dict[int, float] = field(default_factory=dict, init=False, repr=False)  # n -> median t, refit with _fit
    # (token counts ascending, the least t(n) from each count on), refit with _fit
    _floor: tuple[list[int], list[float]] = field(default_factory=lambda: ([], []), init=False, repr=False)
    _times: dict[int, float] = field(default_factory=dict, init=False, repr=False)  # n -> t(n), refit with _fit
    # observations taken so far: whatever was computed from the model at one version holds until
    # the next (the portfolio prices its members once a step with it)
    version: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if min(self.draft_cost_prior, self.target_a_prior, self.slope_prior_ratio) < 0:
            raise ValueError("cost priors must be >= 0")
        if self.draft_cost_ratio_prior is not None and self.draft_cost_ratio_prior < 0:
            raise ValueError("draft_cost_ratio_prior must be >= 0")
        if any(r < 0 for r in self.draft_cost_ratio_priors.values()):
            raise ValueError("draft_cost_ratio_priors must be >= 0")
        if self.intercept_prior_weight <= 0 or self.slope_prior_weight <= 0 or self.window < 2 or self.min_points < 1:
            raise ValueError("prior weights must be > 0, window >= 2 and min_points >= 1")
        if not 0.0 < self.draft_ewma <= 1.0:
            raise ValueError("draft_ewma must be in (0, 1]")
        self._draft_cost = self.draft_cost_prior
        self._obs = _Window(self.window)

    def observe_draft(self, rounds: int, seconds: float, drafter: str = "", catch_up: int = 0) -> None:
        """``rounds`` draft rounds took ``seconds``: of the engine's drafter as a whole (""), or of
        one named drafter (a portfolio member, timed inside the portfolio), after it first ran
        ``catch_up`` committed positions it had not run (its catch-up, priced apart: averaged
        into the round cost, an EAGLE head's catch-up over a prompt after a plain stretch priced
        its rounds several times dearer)."""
        if rounds <= 0 or seconds < 0:
            return
        self.version += 1
        if drafter:
            prior = self.draft_cost_of(drafter) if drafter in self.draft_cost_ratio_priors else None
            self._by_drafter.setdefault(drafter, _DraftCost()).observe(rounds, seconds, max(0, catch_up),
                                                                       self.draft_ewma, prior)
            return
        seconds = self._catch_up.rounds_share(rounds, seconds, catch_up, self.draft_cost, self.draft_ewma)
        if self._draft_n == 0 and self.draft_cost_ratio_prior is not None:
            self._draft_cost = seconds / rounds  # the ratio prior served until now; trust data
        self._draft_n += 1
        beta = max(self.draft_ewma, 1.0 / (self._draft_n + 1))
        self._draft_cost += beta * (seconds / rounds - self._draft_cost)

    def observe_target(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds < 0:
            return
        self._obs.add(int(num_tokens), float(seconds))
        self._fit = None
        self.version += 1

    @property
    def draft_cost(self) -> float:
        if self._draft_n == 0 and self.draft_cost_ratio_prior is not None:
            return self.draft_cost_ratio_prior * self.target_time(1)
        return self._draft_cost

    def observe_sampling(self, speculative: bool, seconds: float) -> None:
        """A step picked its tokens in ``seconds``: rejection sampling over its verification rows
        (speculative) or sampling one token per sequence (plain)."""
        if seconds >= 0:
            self._sampling.setdefault(speculative, _Mean()).observe(seconds, self.draft_ewma)
            self.version += 1

    @property
    def verify_overhead(self) -> float:
        """Seconds a speculative step spends picking its tokens beyond what a plain step spends
        (0 until both kinds of step were measured)."""
        spec, plain = self._sampling.get(True), self._sampling.get(False)
        return 0.0 if spec is None or plain is None else max(0.0, spec.seconds - plain.seconds)

    def draft_cost_of(self, drafter: str) -> float:
        """Seconds per draft round of a named drafter: measured, else its ratio prior times the
        decode step, else the engine-wide cost."""
        measured = self._by_drafter.get(drafter)
        if measured is not None:
            return measured.per_round.seconds
        if drafter in self.draft_cost_ratio_priors:
            return self.draft_cost_ratio_priors[drafter] * self.target_time(1)
        return self.draft_cost

    def catch_up_cost_of(self, drafter: str) -> float:
        """Seconds per position a drafter (named, or "" the engine's) catches up before drafting
        (0 until measured)."""
        if not drafter:
            return self._catch_up.per_position.seconds
        measured = self._by_drafter.get(drafter)
        return 0.0 if measured is None else measured.catch_up.per_position.seconds

    @property
    def coefficients(self) -> tuple[float, float]:
        """(a, b) of t(n) = a + b·n, both >= 0."""
        if self._fit is None:
            self._fit = self._solve()
            window = self._obs
            for n in window.changed:
                ts = window.by_count.get(n, ())
                if len(ts) >= self.min_points:
                    self._medians[n] = statistics.median(ts)
                else:
                    self._medians.pop(n, None)
            window.changed.clear()
            # the floor under t(n): the dearest of t(1) and the medians at m <= n (noise must
            # never make more tokens look cheaper than fewer: that would make α = 0 "pay")
            a, b = self._fit
            keys = sorted({1, *self._medians})
            floors, top = [], 0.0
            for n in keys:
                top = max(top, self._medians.get(n, a + b * n))
                floors.append(top)
            self._floor = (keys, floors)
            self._times = {}
        return self._fit

    def target_time(self, num_tokens: int) -> float:
        """Seconds of a forward over ``num_tokens`` batch tokens: the median of the window's
        forwards of exactly that many (``min_points`` of them at least), else the line — never
        below the estimate for fewer tokens (t(1) or a median at a smaller count). Kept per n until
        the next observation (planning asks for the same few counts dozens of times a step)."""
        if self._fit is not None and num_tokens in self._times:
            return self._times[num_tokens]
        a, b = self.coefficients
        median = self._medians.get(num_tokens)
        own = a + b * num_tokens if median is None else median
        keys, floors = self._floor
        i = bisect.bisect_right(keys, num_tokens) - 1
        t = self._times[num_tokens] = own if i < 0 else max(own, floors[i])
        return t

    def _solve(self) -> tuple[float, float]:
        # Minimize sum (a + b·n_i - t_i)^2 + wa·(a - a0)^2 + wb·(b - rho·a)^2: linear in (a, b).
        wa, wb, rho = self.intercept_prior_weight, self.slope_prior_weight, self.slope_prior_ratio
        sum_n, sum_nn, sum_t, sum_nt = self._obs.sums
        s1 = len(self._obs.obs) + wa + wb * rho * rho
        sn = sum_n - wb * rho
        snn = sum_nn + wb
        st = sum_t + wa * self.target_a_prior
        snt = sum_nt
        det = s1 * snn - sn * sn  # > 0: the priors make the quadratic form positive definite
        a = (st * snn - sn * snt) / det
        b = (s1 * snt - sn * st) / det
        if b < 0:  # more tokens never make a forward cheaper
            b = 0.0
            a = st / s1
        if a < 0:
            a = 0.0
            b = max(snt / snn, 0.0)
        return a, b

    def to_dict(self) -> dict:
        a, b = self.coefficients
        out = {"draft_cost_s": self.draft_cost, "target_a_s": a, "target_b_s_per_token": b,
               "target_observations": len(self._obs.obs), "verify_overhead_s": self.verify_overhead}
        named = sorted({*self.draft_cost_ratio_priors, *self._by_drafter})
        if named:
            out["draft_cost_s_by_drafter"] = {d: self.draft_cost_of(d) for d in named}
            out["catch_up_s_per_position_by_drafter"] = {d: self.catch_up_cost_of(d) for d in named}
        if self._catch_up.per_position.n:
            out["catch_up_s_per_position"] = self.catch_up_cost_of("")
        return out


def _rounds(other_draft_rounds: int | Mapping[str, int], drafter: str) -> dict[str, int]:
    """The other sequences' draft rounds per drafter (an int: all of them ``drafter``'s)."""
    if isinstance(other_draft_rounds, Mapping):
        return dict(other_draft_rounds)
    return {drafter: other_draft_rounds}


def step_rate(alpha: Alpha, k: int, costs: CostModel, batch_tokens_other: int,
              other_committed: float = 0.0, other_draft_rounds: int | Mapping[str, int] = 0,
              drafter: str = "") -> float:
    """Committed tokens per second of one step in which this sequence drafts k tokens with
    ``drafter`` (its rounds overlap the other sequences' rounds of the same drafter)."""
    rounds = _rounds(other_draft_rounds, drafter)
    rounds[drafter] = max(k, rounds.get(drafter, 0))
    seconds = (draft_seconds(rounds, costs) + costs.target_time(batch_tokens_other + k + 1)
               + verify_overhead(costs, rounds))
    return (other_committed + expected_committed(alpha, k)) / max(seconds, 1e-9)


def choose_k(alpha: Alpha, max_draft_tokens: int, costs: CostModel, batch_tokens_other: int = 0,
             other_committed: float = 0.0, other_draft_rounds: int | Mapping[str, int] = 0,
             min_gain: float = 0.05, drafter: str = "") -> int:
    """K in [0, max_draft_tokens] maximizing committed tokens per second; 0 unless the best K gains more
    than ``min_gain`` of one plain token per plain step time (for a lone sequence: beats plain
    by more than min_gain relative), which absorbs unmodelled overhead and noise.

    With the defaults (other_committed = 0) this is one sequence's own rate: E(K) tokens per
    (K·c_draft + t(batch_tokens_other + K + 1)) versus 1 per t(batch_tokens_other + 1). Passing
    the tokens the other sequences of the forward commit turns it into the batch's rate, which
    charges this sequence for slowing everyone else down (why large batches go plain)."""
    if max_draft_tokens <= 0:
        return 0
    rates = [step_rate(alpha, k, costs, batch_tokens_other, other_committed, other_draft_rounds, drafter)
             for k in range(max_draft_tokens + 1)]
    others = _rounds(other_draft_rounds, drafter)
    plain_step = (draft_seconds(others, costs) + costs.target_time(batch_tokens_other + 1)
                  + verify_overhead(costs, others))
    best = max(range(1, max_draft_tokens + 1), key=lambda k: (rates[k], -k))
    return best if rates[best] > rates[0] + min_gain / max(plain_step, 1e-9) else 0


def break_even_alpha(costs: CostModel, max_draft_tokens: int, min_gain: float = 0.05, tol: float = 1e-3) -> float:
    """The lowest per-position α at which a lone sequence speculates at all (``choose_k`` > 0)
    under these costs: below it, the verification of even one draft token costs more than it
    commits; at it and above, speculating pays (``choose_k`` is monotone in α, and the value
    returned is the upper end of the bisection, so it is itself on the paying side). 1.0 when
    no α pays (e.g. a draft step dearer than a target step)."""
    if max_draft_tokens <= 0 or choose_k(1.0 - tol, max_draft_tokens, costs, min_gain=min_gain) == 0:
        return 1.0
    lo, hi = 0.0, 1.0 - tol  # choose_k(hi) > 0; choose_k is monotone in α
    if choose_k(lo, max_draft_tokens, costs, min_gain=min_gain) > 0:
        return 0.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if choose_k(mid, max_draft_tokens, costs, min_gain=min_gain) > 0:
            hi = mid
        else:
            lo = mid
    return hi


def rounds_by_drafter(num_draft_tokens: list[int], drafters: list[str] | None, skip: int = -1) -> dict[str, int]:
    """Draft rounds each drafter runs in a step (the most any of its sequences asked), sequence
    ``skip`` left out; ``drafters`` None: one drafter ("") for all."""
    rounds: dict[str, int] = {}
    for i, k in enumerate(num_draft_tokens):
        if i != skip:
            d = drafters[i] if drafters is not None else ""
            rounds[d] = max(rounds.get(d, 0), k)
    return rounds


def batch_rate(alphas: list[Alpha], num_draft_tokens: list[int], costs: CostModel, extra_tokens: int = 0,
               extra_committed: float = 0.0, drafters: list[str] | None = None) -> float:
    """Committed tokens per second of a step in which sequence i drafts num_draft_tokens[i] tokens
    (with ``drafters[i]``, default one drafter for all), sharing the forward with ``extra_tokens``
    tokens of sequences that do not speculate (e.g. prefill chunks) that commit ``extra_committed`` tokens."""
    if not num_draft_tokens:
        return 0.0
    rounds = rounds_by_drafter(num_draft_tokens, drafters)
    seconds = (draft_seconds(rounds, costs) + costs.target_time(extra_tokens + sum(k + 1 for k in num_draft_tokens))
               + verify_overhead(costs, rounds))
    committed = extra_committed + sum(expected_committed(a, k) for a, k in zip(alphas, num_draft_tokens))
    return committed / max(seconds, 1e-9)


@dataclass(slots=True)
class AdaptiveK:
    """Per-step K for a batch. All sequences share one target forward (their K_i + 1 tokens add
    up) and the draft phase lasts max K_i rounds, so the objective is the batch's committed
    tokens per second (``batch_rate``). Search: the best uniform K (every sequence drafting the
    same number, which is how a shared draft phase pays off) against all-plain, then coordinate
    ascent — each sequence in turn takes its best K given the others (``choose_k`` with the
    others' tokens and rounds), for up to ``passes`` sweeps or until nothing changes. A local
    optimum, cheap for B up to a few dozen.

    Exploration: a sequence that has been at K = 0 for its segment's probe interval (initially
    ``explore_every``) consecutive steps gets K = min(explore_k, max_draft_tokens) once (deterministic
    schedule), so its α can recover. A probe that commits none of its draft tokens doubles the
    segment's interval (up to ``explore_max_every``); one that commits any resets it (it about
    paid for itself: requiring all of them backed an EAGLE head accepted at 0.42 off on chat,
    where it pays, as surely as a hopeless drafter). Probes cost about one extra verification
    each, so fixed-interval probing alone kept hopeless segments (α ≈ 0 for an untrained
    layer-skip draft) several percent slower than plain. A segment not yet probed starts from
    the interval its pool (same draft context, any segment) last reached, at most
    ``explore_inherit_max``: a head hopeless on other languages reached 256 there, longer than a
    chat answer, and was never tried on chat again. A drafter that catches up before drafting
    (an EAGLE head: all the positions since its last draft for the sequence) is probed no sooner
    than that catch-up costs ``probe_budget`` of the plain steps in between (``catch_up_wait``;
    the portfolio's rule): probes of new requests on multilingual, where the head is hopeless,
    each ran the whole prompt first, and eagle auto ran 4-16% slower than plain there.

    A segment with fewer than ``explore_min_trials`` tested positions of its own is explored
    first: its parked sequences draft one token at once — no interval, no catch-up wait — as many
    of them per step as positions are still missing, until the segment has its own evidence. Its
    estimate starts from the pool's (other segments', shrunk), and where that sat under the
    break-even α — which moves with the measured costs by ±0.1 on a noisy 2-core machine — a
    segment of short answers was never probed at all (json: ~30 tokens against an inherited
    interval of 64; the EAGLE head, at α 0.6 there, never drafted in one run of three). One token,
    not ``explore_k``: the first position decides whether anything pays, and a probe of one
    token costs one draft round and the cheapest verification — when this was chosen a 2-token
    verification cost ~1.1 plain steps and a 3-token one ~1.3 on 2 cores, so exploring a segment
    where the drafter is hopeless (the head on summarize: 7-8 probes, each after catching up on a
    long prompt) cost about a quarter as much; since the GEMM passes over a weight tile once for
    up to 6 rows both cost ~1.1, and the one-token probe saves the extra draft rounds. Sequences
    planned with their drafter's own rates (``alphas``) are its to explore."""

    estimator: AcceptanceEstimator = field(default_factory=AcceptanceEstimator)
    costs: StepCostModel = field(default_factory=StepCostModel)
    explore_every: int = 16
    explore_k: int = 2
    min_gain: float = 0.05
    passes: int = 2
    explore_max_every: int = 256
    explore_inherit_max: int = 64
    probe_budget: float = 0.02  # a probe's catch-up takes at most this share of the plain steps before it
    explore_min_trials: float = 8.0  # tested positions a segment needs before it is parked like the others
    _plain_streak: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _probe_every: dict[str, int] = field(default_factory=dict, init=False, repr=False)  # per segment
    _pool_probe_every: dict[str, int] = field(default_factory=dict, init=False, repr=False)  # per pool
    _probing: set[str] = field(default_factory=set, init=False, repr=False)  # seq ids probed last step

    def __post_init__(self) -> None:
        if self.explore_every < 1 or self.explore_k < 1 or self.passes < 1:
            raise ValueError("explore_every, explore_k and passes must be >= 1")
        if not 0.0 < self.probe_budget <= 1.0:
            raise ValueError("probe_budget must be in (0, 1]")
        if self.explore_min_trials < 0:
            raise ValueError("explore_min_trials must be >= 0")

    def choose(self, seqs: list[tuple[str, str]], max_draft_tokens: int, extra_tokens: int = 0,
               extra_committed: float = 0.0, drafters: list[str] | None = None,
               alphas: list[Alpha | None] | None = None, behind: list[int] | None = None) -> list[int]:
        """seqs: (seq_id, segment) of every sequence that may speculate this step -> K each.
        extra_tokens / extra_committed: the rest of the same forward (sequences that cannot
        speculate, prefill chunks) — they make verification tokens dearer, as in a big batch.
        drafters: which drafter drafts for each (a portfolio's member: each has its own round
        cost); None: one drafter for all. alphas: the drafter's own acceptance for a sequence
        (the portfolio's rates for the member it chose), used instead of this estimator's.
        behind: the positions the (one) drafter would catch up on for each before drafting —
        a probe waits until that is cheap (``catch_up_wait``)."""
        n = len(seqs)
        given = alphas if alphas is not None else [None] * n
        alphas = [self.estimator.estimate(s, seg) if a is None else a for (s, seg), a in zip(seqs, given)]
        num_draft_tokens = [0] * n
        if max_draft_tokens > 0 and n:
            def rate(ks_: list[int]) -> float:
                return batch_rate(alphas, ks_, self.costs, extra_tokens, extra_committed, drafters)

            if n > 1:  # a lone sequence's best K is its coordinate ascent's, whatever it starts from
                uniform = max(range(1, max_draft_tokens + 1), key=lambda r: rate([r] * n))
                if rate([uniform] * n) > rate(num_draft_tokens) * (1.0 + self.min_gain):
                    num_draft_tokens = [uniform] * n
            self._coordinate_ascent(alphas, num_draft_tokens, max_draft_tokens, extra_tokens, extra_committed,
                                    drafters)
        missing: dict[str, float] = {}  # segment -> positions its exploration still lacks this step
        for i, (seq_id, segment) in enumerate(seqs):
            self._probing.discard(seq_id)
            if num_draft_tokens[i] > 0 or max_draft_tokens <= 0:
                self._plain_streak[seq_id] = 0
                continue
            streak = self._plain_streak.get(seq_id, 0) + 1
            unexplored = False
            if given[i] is None:
                if segment not in missing:
                    missing[segment] = self.explore_min_trials - self.estimator.segment_trials(segment)
                if missing[segment] > 0:
                    unexplored = True
                    missing[segment] -= 1  # its probe tests one position
            if unexplored:
                wait = 0  # probe now
            else:
                wait = self.probe_interval(segment)
                if behind is not None:
                    wait = max(wait, catch_up_wait(self.costs, "", behind[i], self.probe_budget))
            if streak >= wait:
                num_draft_tokens[i] = 1 if unexplored else min(self.explore_k, max_draft_tokens)
                self._probing.add(seq_id)
                streak = 0
            self._plain_streak[seq_id] = streak
        return num_draft_tokens

    def _coordinate_ascent(self, alphas: list[Alpha], num_draft_tokens: list[int], max_draft_tokens: int,
                           extra_tokens: int, extra_committed: float, drafters: list[str] | None = None) -> None:
        committed = [expected_committed(a, k) for a, k in zip(alphas, num_draft_tokens)]
        for _ in range(self.passes):
            changed = False
            for i in range(len(num_draft_tokens)):
                others_tokens = extra_tokens + sum(num_draft_tokens) + len(num_draft_tokens) - (num_draft_tokens[i] + 1)
                others_committed = extra_committed + sum(committed) - committed[i]
                others_rounds = rounds_by_drafter(num_draft_tokens, drafters, skip=i)
                best = choose_k(alphas[i], max_draft_tokens, self.costs, others_tokens, others_committed,
                                others_rounds, self.min_gain, drafters[i] if drafters is not None else "")
                if best != num_draft_tokens[i]:
                    changed = True
                    num_draft_tokens[i] = best
                    committed[i] = expected_committed(alphas[i], best)
            if not changed:
                return

    def break_even_alpha(self, max_draft_tokens: int) -> float:
        return break_even_alpha(self.costs, max_draft_tokens, self.min_gain)

    def probe_interval(self, segment: str) -> int:
        """The segment's own probe interval, else its pool's (the last one any segment of the
        same draft context reached), else ``explore_every``: a drafter that failed its probes
        elsewhere does not start over on every new segment."""
        every = self._probe_every.get(segment)
        if every is None:
            inherited = self._pool_probe_every.get(self.estimator.pool_of(segment), self.explore_every)
            every = min(inherited, max(self.explore_inherit_max, self.explore_every))
        return every

    def observe(self, seq_id: str, segment: str, k: int, num_accepted: int) -> None:
        self.estimator.update(seq_id, segment, k, num_accepted)
        if k > 0 and seq_id in self._probing:
            self._probing.discard(seq_id)
            every = self.probe_interval(segment)
            every = (self.explore_every if num_accepted >= 1
                     else min(2 * every, max(self.explore_max_every, self.explore_every)))
            self._probe_every[segment] = every
            self._pool_probe_every[self.estimator.pool_of(segment)] = every

    def release(self, seq_id: str) -> None:
        self.estimator.release(seq_id)
        self._plain_streak.pop(seq_id, None)
        self._probing.discard(seq_id)

    def to_dict(self) -> dict:
        return {"segments": self.estimator.to_dict(), "costs": self.costs.to_dict()}
