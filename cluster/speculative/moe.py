"""The MoE gate: mixture-of-experts targets speculate only after acceptance was measured.

Owns: recognising an MoE target from its Hugging Face config (``is_moe_config``) and the gate
state (``MoeGate``): closed for MoE targets until a measurement with enough draft tokens shows
α >= threshold (α per position, the unit of the break-even α it is compared with:
``cluster.speculative.acceptance``), always open for dense targets. The gate is kept per segment from live probe
traffic (``record`` / ``decide``: each window of ``min_draft_tokens`` probe draft tokens either
opens the segment or is discarded, so a segment that improves opens on a later window), or for
the whole target at once (an operator's vouching, ``validate`` with an offline measurement).
Why: expert routing can differ between the drafter's view and the target's, so acceptance is
unpredictable and may sit below break-even; the only safe policy is to measure before enabling.
Ignores: which requests probe (the Router picks them, the SpecController lets them draft), the
threshold's source (the controller passes the cost model's break-even) and where the state is
shown (engine stats, route reasons).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Fields that count experts. Present with a value > 1 -> MoE; present and <= 1 -> dense.
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                       "num_moe_experts")
# Fields only MoE configs carry (checked when no expert count is given).
MOE_ONLY_FIELDS = ("moe_intermediate_size", "moe_layers", "moe_top_k", "moe_layer_freq")
NAME_MARKERS = ("moe", "mixtral")


def _as_dict(config: Any) -> dict:
    if isinstance(config, dict):
        return config
    to_dict = getattr(config, "to_dict", None)
    if to_dict is not None:
        return to_dict()
    return dict(vars(config))


def _expert_count(cfg: dict) -> int | None:
    counts = [cfg[f] for f in EXPERT_COUNT_FIELDS if isinstance(cfg.get(f), int)]
    if counts:
        return max(counts)
    for key, value in cfg.items():  # nested sub-configs: text_config (Llama 4), ffn_config (DBRX)
        if key.endswith("_config") and isinstance(value, dict):
            nested = _expert_count(value)
            if nested is not None:
                return nested
    return None


def _has_moe_fields(cfg: dict) -> bool:
    for f in MOE_ONLY_FIELDS:
        value = cfg.get(f)
        if (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0) or (
                isinstance(value, (list, tuple)) and len(value) > 0):
            return True
    return any(key.endswith("_config") and isinstance(value, dict) and _has_moe_fields(value)
               for key, value in cfg.items())


def _named_moe(cfg: dict) -> bool:
    names = list(cfg.get("architectures") or []) + [str(cfg.get("model_type") or "")]
    return any(marker in name.lower() for name in names for marker in NAME_MARKERS)


def is_moe_config(config: Any) -> bool:
    """True for a mixture-of-experts Hugging Face config (PretrainedConfig or its dict).

    An explicit expert count decides (> 1 experts); without one, MoE-only fields
    (moe_intermediate_size, moe_layers, ...) or an architecture / model_type naming MoE or
    Mixtral do."""
    cfg = _as_dict(config)
    count = _expert_count(cfg)
    if count is not None:
        return count > 1
    return _has_moe_fields(cfg) or _named_moe(cfg)


@dataclass(slots=True)
class SegmentGate:
    """One segment's live measurement: the current window's probe counters, and the last decision."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    rejections: int = 0  # probe verifications that rejected a draft token
    open: bool = False
    windows: int = 0  # windows decided so far
    last_alpha: float | None = None
    last_threshold: float | None = None

    def to_dict(self) -> dict:
        return {"open": self.open, "window_draft_tokens": self.draft_tokens,
                "window_accepted_tokens": self.accepted_tokens, "window_rejections": self.rejections,
                "windows": self.windows,
                "last_alpha": self.last_alpha, "last_threshold": self.last_threshold}


@dataclass(slots=True)
class MoeGate:
    """Speculation is allowed iff the target is dense or its acceptance was validated.

    ``validated`` may start True when an operator vouches for a measurement made elsewhere
    (SpecConfig.moe_validated). ``validate`` re-decides from a fresh measurement, so a later
    measurement below threshold closes the gate again."""

    moe: bool
    validated: bool = False
    measured_alpha: float | None = None
    measured_draft_tokens: int | None = None
    threshold: float = 0.5
    min_draft_tokens: int = 256
    segments: dict[str, SegmentGate] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.min_draft_tokens < 1:
            raise ValueError("min_draft_tokens must be >= 1")

    @classmethod
    def for_config(cls, config: Any, validated: bool = False, min_draft_tokens: int = 256) -> "MoeGate":
        return cls(moe=is_moe_config(config), validated=validated, min_draft_tokens=min_draft_tokens)

    @property
    def speculation_allowed(self) -> bool:
        """Open for every segment (dense target, or validated as a whole)."""
        return not self.moe or self.validated

    def allows(self, segment: str) -> bool:
        """May requests of ``segment`` speculate without being probes?"""
        if self.speculation_allowed:
            return True
        gate = self.segments.get(segment)
        return gate is not None and gate.open

    def record(self, segment: str, k: int, num_accepted: int) -> bool:
        """Count one probe verification (k draft tokens, num_accepted of them accepted) of a
        closed segment; True once its window holds ``min_draft_tokens`` draft tokens (call
        ``decide``). Open segments are not measured here."""
        if not 0 <= num_accepted <= k:
            raise ValueError(f"need 0 <= accepted ({num_accepted}) <= drafted ({k})")
        if self.allows(segment):
            return False
        gate = self.segments.setdefault(segment, SegmentGate())
        gate.draft_tokens += k
        gate.accepted_tokens += num_accepted
        gate.rejections += 1 if num_accepted < k else 0
        return gate.draft_tokens >= self.min_draft_tokens

    def decide(self, segment: str, threshold: float) -> bool:
        """Close the segment's window: open iff it holds enough draft tokens with α >= threshold.
        A window below threshold is discarded, so the next one measures the segment afresh."""
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        gate = self.segments.setdefault(segment, SegmentGate())
        if gate.open or gate.draft_tokens < self.min_draft_tokens:
            return self.allows(segment)
        trials = gate.accepted_tokens + gate.rejections  # > 0: the window holds draft tokens
        gate.last_alpha = gate.accepted_tokens / trials
        gate.last_threshold = float(threshold)
        gate.windows += 1
        gate.open = gate.last_alpha >= threshold
        gate.draft_tokens = gate.accepted_tokens = gate.rejections = 0
        return gate.open

    def segment_reason(self, segment: str) -> str:
        if self.speculation_allowed:
            return self.reason
        gate = self.segments.get(segment)
        if gate is None or gate.last_alpha is None:
            measured = 0 if gate is None else gate.draft_tokens
            return (f"MoE target: segment {segment!r} measuring ({measured}/{self.min_draft_tokens} "
                    "probe draft tokens)")
        cmp = ">=" if gate.open else "<"
        state = "open" if gate.open else "closed"
        return (f"MoE target: segment {segment!r} {state}, probe alpha {gate.last_alpha:.3f} {cmp} "
                f"{gate.last_threshold:.3f}")

    def validate(self, measured_alpha: float, threshold: float = 0.5,
                 num_draft_tokens: int | None = None) -> bool:
        """Record an acceptance measurement (α per position); open the gate iff α >= threshold and the
        measurement covered at least ``min_draft_tokens`` draft tokens (when the count is
        given). Returns whether speculation is now allowed."""
        if not 0.0 <= measured_alpha <= 1.0:
            raise ValueError(f"measured_alpha must be in [0, 1], got {measured_alpha}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        self.measured_alpha = float(measured_alpha)
        self.measured_draft_tokens = num_draft_tokens
        self.threshold = threshold
        enough = num_draft_tokens is None or num_draft_tokens >= self.min_draft_tokens
        self.validated = enough and measured_alpha >= threshold
        return self.speculation_allowed

    @property
    def reason(self) -> str:
        if not self.moe:
            return "dense target"
        if self.validated:
            if self.measured_alpha is None:
                return "MoE target validated by configuration"
            return f"MoE target validated: measured alpha {self.measured_alpha:.3f} >= {self.threshold}"
        if self.measured_alpha is None:
            return "MoE target not validated yet: measure acceptance before speculating"
        if (self.measured_draft_tokens is not None
                and self.measured_draft_tokens < self.min_draft_tokens):
            return (f"MoE target: measurement too small ({self.measured_draft_tokens} draft tokens "
                    f"< {self.min_draft_tokens})")
        return f"MoE target: measured alpha {self.measured_alpha:.3f} < {self.threshold}"

    def to_dict(self) -> dict:
        return {
            "moe": self.moe,
            "validated": self.validated,
            "speculation_allowed": self.speculation_allowed,
            "measured_alpha": self.measured_alpha,
            "measured_draft_tokens": self.measured_draft_tokens,
            "threshold": self.threshold,
            "reason": self.reason,
            "segments": {name: gate.to_dict() for name, gate in sorted(self.segments.items())},
        }
