"""The MoE gate: mixture-of-experts targets speculate only after acceptance was measured.

Owns: recognising an MoE target from its Hugging Face config (``is_moe_config``) and the gate
state (``MoeGate``): closed for MoE targets until a measurement with enough draft tokens shows
α >= threshold, always open for dense targets. Why: expert routing can differ between the
drafter's view and the target's, so acceptance is unpredictable and may sit below break-even;
the only safe policy is to measure before enabling. Ignores: running the measurement (the engine
or benchmark does it) and where the state is shown (router decision, metrics).
"""
from __future__ import annotations

from dataclasses import dataclass
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

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.min_draft_tokens < 1:
            raise ValueError("min_draft_tokens must be >= 1")

    @classmethod
    def for_config(cls, config: Any, validated: bool = False) -> "MoeGate":
        return cls(moe=is_moe_config(config), validated=validated)

    @property
    def speculation_allowed(self) -> bool:
        return not self.moe or self.validated

    def validate(self, measured_alpha: float, threshold: float = 0.5,
                 num_draft_tokens: int | None = None) -> bool:
        """Record an acceptance measurement; open the gate iff α >= threshold and the
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
        }
