"""α, the acceptance of draft tokens: what it means and how it is estimated, in one place.

Two quantities carry two names everywhere (engine stats, metrics, traces, API, bench, mapper):

- ``alpha`` (α): the per-position probability that the target accepts a draft token whose
  predecessors were all accepted (arXiv 2211.17192). The cost model is in this unit — a step
  with K drafts commits ``expected_committed(α, K) = (1 - α^(K+1)) / (1 - α)`` tokens on average —
  and so are everything derived from it: adaptive K, the break-even α, the Router's gate
  (live α per segment against break-even), the MoE gate, ``bench spec``'s prediction.
  Estimated from verification steps: a step with K drafts of which ``a`` were accepted tested
  a + [a < K] positions — a acceptances and, when a < K, one rejection (the positions after it
  were never tested) — so α̂ = accepted / (accepted + rejections).
- ``acceptance_rate``: accepted_tokens / draft_tokens, the share of the drafter's tokens the
  target kept. Descriptive only: as an estimate of α it is biased low, since the untested
  positions after a rejection count as drafted (α = 0.8, K = 5: ~0.6). Nothing gates on it.

A drafter that keeps its own estimates (the portfolio: a member's first-token rate apart from its
later one, per draft context, segment and sequence) may hand adaptive K the pair (α1, α) for a
sequence instead (``Alpha``).

Owns: ``expected_committed``; the decayed counts every α estimate is made of (``AlphaCounts``);
adaptive K's estimator (``AcceptanceEstimator``: sequence, segment and draft-context pool, each
shrunk towards the level above); the live per-segment α the Router gates on (``LiveAlpha``:
raw, decayed by draft tokens, with its sample count). Ignores: step costs and the choice of K
(``cluster.speculative.adaptive_k``), per-request lifetime counters (``SpecStats`` in
``cluster.common.request``, whose ``alpha`` follows the same rule), and who feeds the counts
(``cluster.engine.speculation``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

CONTEXT_SEP = "|"  # "<segment or sequence id>|<draft context>", e.g. "chat|n2"
LIVE_ALPHA_HALF_LIFE = 512  # draft tokens after which an observation weighs half (the Router's α)


Alpha = float | tuple[float, float]  # one α for every position, or (the first draft token's, each later one's)


def expected_committed(alpha: Alpha, k: float) -> float:
    """Mean tokens committed by a step with k draft tokens at per-position acceptance alpha; with
    (α1, α) the first token is accepted at α1 and each later one (after an accepted one) at α:
    1 + α1·(1 + α + … + α^(k-1))."""
    first, later = alpha if isinstance(alpha, tuple) else (alpha, alpha)
    first, later = min(max(first, 0.0), 1.0), min(max(later, 0.0), 1.0)
    if k <= 0:
        return 1.0
    run = float(k) if later >= 1.0 else (1.0 - later ** k) / (1.0 - later)  # 1 + α + … + α^(k-1)
    return 1.0 + first * run


def with_context(name: str, context: str) -> str:
    """A segment (or sequence id) refined by a drafter's draft context: pools under the context."""
    return f"{name}{CONTEXT_SEP}{context}"


@dataclass(slots=True)
class AlphaCounts:
    """Acceptances and rejections (and draft tokens, the Router's sample size) of verification
    steps, each multiplied by ``decay`` before the next step is added."""

    accepted: float = 0.0
    rejected: float = 0.0
    drafted: float = 0.0

    def add(self, decay: float, k: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= k:
            raise ValueError(f"num_accepted {num_accepted} outside [0, {k}]")
        self.accepted = self.accepted * decay + num_accepted
        self.rejected = self.rejected * decay + (1 if num_accepted < k else 0)
        self.drafted = self.drafted * decay + k

    @property
    def trials(self) -> float:
        """Positions tested: acceptances + rejections."""
        return self.accepted + self.rejected

    @property
    def alpha(self) -> float | None:
        """accepted / (accepted + rejections); None before any position was tested."""
        return self.accepted / self.trials if self.trials > 0 else None


@dataclass(slots=True)
class AcceptanceEstimator:
    """Adaptive K's α. Three levels, each shrunk towards the one above with pseudo trials:
    - pooled: every segment of one draft context together (a segment key "chat|n2" pools under
      "n2"; a plain segment name under "*"), ``prior_weight`` pseudo trials at ``prior_alpha`` —
      so a new segment starts from what this drafter achieves elsewhere, not from a fixed guess
      (a useless drafter stops wasting verification on every segment it meets);
    - segment: its counts plus ``prior_weight`` pseudo trials at the pooled estimate;
    - sequence: its counts plus ``seq_prior_weight`` pseudo trials at the segment estimate, so a
      sequence dominates once it has several times that many trials.
    Counts decay by ``decay`` per update (old behaviour fades; half-life ≈ 0.69 / (1 - decay))."""

    prior_alpha: float = 0.6
    prior_weight: float = 4.0
    seq_prior_weight: float = 8.0
    decay: float = 0.99
    _segments: dict[str, AlphaCounts] = field(default_factory=dict, init=False, repr=False)
    _seqs: dict[str, AlphaCounts] = field(default_factory=dict, init=False, repr=False)
    _pools: dict[str, AlphaCounts] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.prior_alpha <= 1.0:
            raise ValueError(f"prior_alpha must be in [0, 1], got {self.prior_alpha}")
        if self.prior_weight <= 0 or self.seq_prior_weight <= 0:
            raise ValueError("prior weights must be > 0")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")

    def update(self, seq_id: str, segment: str, k: int, num_accepted: int) -> None:
        if k <= 0:
            return  # a plain step tests no draft token
        if not 0 <= num_accepted <= k:
            raise ValueError(f"num_accepted {num_accepted} outside [0, {k}]")
        for counts, key in ((self._segments, segment), (self._pools, self.pool_of(segment)),
                            (self._seqs, seq_id)):
            counts.setdefault(key, AlphaCounts()).add(self.decay, k, num_accepted)

    @staticmethod
    def pool_of(segment: str) -> str:
        return segment.rpartition(CONTEXT_SEP)[2] if CONTEXT_SEP in segment else "*"

    def pooled_estimate(self, segment: str) -> float:
        c = self._pools.get(self.pool_of(segment), AlphaCounts())
        return (c.accepted + self.prior_weight * self.prior_alpha) / (c.trials + self.prior_weight)

    def segment_estimate(self, segment: str) -> float:
        c = self._segments.get(segment, AlphaCounts())
        return (c.accepted + self.prior_weight * self.pooled_estimate(segment)) / (c.trials + self.prior_weight)

    def estimate(self, seq_id: str, segment: str) -> float:
        seg = self.segment_estimate(segment)
        c = self._seqs.get(seq_id)
        if c is None:
            return seg
        return (c.accepted + self.seq_prior_weight * seg) / (c.trials + self.seq_prior_weight)

    def segment_trials(self, segment: str) -> float:
        """Positions the segment's own verification steps tested (decayed)."""
        c = self._segments.get(segment)
        return c.trials if c else 0.0

    def seq_trials(self, seq_id: str) -> float:
        c = self._seqs.get(seq_id)
        return c.trials if c else 0.0

    def release(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    def to_dict(self) -> dict:
        return {seg: {"alpha": round(self.segment_estimate(seg), 4), "trials": round(c.trials, 2)}
                for seg, c in self._segments.items()}


@dataclass(slots=True)
class LiveAlpha:
    """The Router's "live" α per traffic segment: raw counts (no prior: a segment is judged on
    what it measured), decayed by draft tokens so that each observation's weight halves after
    ``half_life`` more draft tokens of its segment — recent behaviour, not a lifetime average."""

    half_life: float = LIVE_ALPHA_HALF_LIFE
    _segments: dict[str, AlphaCounts] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.half_life <= 0:
            raise ValueError(f"half_life must be > 0, got {self.half_life}")

    def observe(self, segment: str, k: int, num_accepted: int) -> None:
        if k <= 0:
            return
        self._segments.setdefault(segment, AlphaCounts()).add(0.5 ** (k / self.half_life), k, num_accepted)

    def get(self, segment: str) -> AlphaCounts | None:
        return self._segments.get(segment)

    def segments(self) -> dict[str, AlphaCounts]:
        return dict(self._segments)
