"""MoE detection on real transformers config classes, and the validation gate."""
from __future__ import annotations

import pytest
from transformers import (
    DbrxConfig,
    Llama4Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from cluster.speculative.moe import MoeGate, is_moe_config

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128)


@pytest.mark.parametrize("config", [
    LlamaConfig(**TINY),
    Qwen2Config(**TINY),
    MistralConfig(**TINY),
    LlamaConfig(**TINY).to_dict(),  # the dict form (config.json) works too
], ids=["llama", "qwen2", "mistral", "llama-dict"])
def test_dense_configs(config):
    assert not is_moe_config(config)


@pytest.mark.parametrize("config", [
    MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
    Qwen2MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                   shared_expert_intermediate_size=32),
    Qwen3MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    OlmoeConfig(**TINY, num_experts=4, num_experts_per_tok=2),
    DbrxConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=128),  # experts in ffn_config
    Llama4Config(),  # experts in text_config
], ids=["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "dbrx", "llama4"])
def test_moe_configs(config):
    assert is_moe_config(config)


def test_detection_rules_on_plain_dicts():
    assert is_moe_config({"architectures": ["MixtralForCausalLM"]})
    assert is_moe_config({"architectures": ["SomeMoEForCausalLM"], "model_type": "x"})
    assert is_moe_config({"model_type": "granitemoe"})
    assert is_moe_config({"n_routed_experts": 64})
    assert is_moe_config({"moe_intermediate_size": 128})
    # An explicit count of one expert is a dense model whatever the name says.
    assert not is_moe_config({"architectures": ["MixtralForCausalLM"], "num_local_experts": 1})
    assert not is_moe_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def test_gate_dense_target_always_open():
    gate = MoeGate.for_config(LlamaConfig(**TINY))
    assert gate.speculation_allowed
    assert gate.to_dict()["reason"] == "dense target"


def test_gate_moe_target_opens_only_after_good_measurement():
    gate = MoeGate.for_config(MixtralConfig(**TINY, num_local_experts=4))
    assert gate.moe and not gate.speculation_allowed
    assert "not validated" in gate.reason
    # Too few samples: stays closed even with a high α.
    assert gate.validate(0.9, num_draft_tokens=10) is False
    assert "too small" in gate.reason
    # α below threshold: closed.
    assert gate.validate(0.35, threshold=0.5, num_draft_tokens=2000) is False
    assert gate.to_dict() == {
        "moe": True, "validated": False, "speculation_allowed": False, "measured_alpha": 0.35,
        "measured_draft_tokens": 2000, "threshold": 0.5,
        "reason": "MoE target: measured alpha 0.350 < 0.5", "segments": {}}
    # Enough samples and α at threshold: open.
    assert gate.validate(0.5, threshold=0.5, num_draft_tokens=2000) is True
    assert gate.speculation_allowed and gate.validated
    # A later bad measurement closes it again.
    assert gate.validate(0.2, num_draft_tokens=2000) is False
    assert not gate.speculation_allowed


def test_gate_preapproved_by_configuration():
    gate = MoeGate.for_config(Qwen2MoeConfig(**TINY, num_experts=4), validated=True)
    assert gate.speculation_allowed
    assert gate.reason == "MoE target validated by configuration"


def test_gate_validation_errors():
    gate = MoeGate(moe=True)
    with pytest.raises(ValueError):
        gate.validate(1.5)
    with pytest.raises(ValueError):
        MoeGate(moe=True, threshold=2.0)


# Live per-segment gate, min_draft_tokens=10. Each row: one probe verification recorded for the
# segment (drafted, accepted), the threshold decide() gets when the window is full, and then
# (window full?, segment open?, window draft tokens left, windows decided, last alpha). α is per
# position: accepted / (accepted + verifications that rejected a draft), not accepted / drafted.
LIVE_TABLE = [
    # a window below threshold is decided closed and discarded
    ("chat", 4, 0, 0.5, False, False, 4, 0, None),
    ("chat", 4, 1, 0.5, False, False, 8, 0, None),
    ("chat", 4, 1, 0.5, True, False, 0, 1, 2 / 5),      # 2 accepted, 3 rejections: 0.4 < 0.5
    # the next window starts afresh: an improved segment opens at threshold exactly
    ("chat", 6, 1, 0.5, False, False, 6, 1, 2 / 5),
    ("chat", 4, 1, 0.5, True, True, 0, 2, 0.5),          # 2 accepted, 2 rejections: 0.5 >= 0.5
    # once open it is no longer measured here (rules 6-9 watch its α from then on)
    ("chat", 5, 0, 0.5, False, True, 0, 2, 0.5),
    # segments are independent: the threshold (the cost model's break-even) decides per window
    ("code", 10, 3, 0.25, True, True, 0, 1, 0.75),       # 3 accepted, 1 rejection (3 / 10 drafted)
    ("json", 10, 3, 0.8, True, False, 0, 1, 0.75),
]


def test_live_gate_per_segment_table():
    gate = MoeGate(moe=True, min_draft_tokens=10)
    for row in LIVE_TABLE:
        segment, drafted, accepted, threshold, full, is_open, left, windows, alpha = row
        assert gate.record(segment, drafted, accepted) is full, row
        if full:
            assert gate.decide(segment, threshold) is is_open, row
        assert gate.allows(segment) is is_open, row
        state = gate.to_dict()["segments"][segment]
        assert (state["window_draft_tokens"], state["windows"]) == (left, windows), row
        assert state["last_alpha"] == (None if alpha is None else pytest.approx(alpha)), row
    assert not gate.speculation_allowed  # the target as a whole stays gated
    assert not gate.allows("never-probed")
    assert gate.segment_reason("chat") == "MoE target: segment 'chat' open, probe alpha 0.500 >= 0.500"
    assert gate.segment_reason("json") == "MoE target: segment 'json' closed, probe alpha 0.750 < 0.800"
    assert gate.segment_reason("new") == "MoE target: segment 'new' measuring (0/10 probe draft tokens)"


def test_live_gate_decide_needs_a_full_window_and_dense_needs_nothing():
    gate = MoeGate(moe=True, min_draft_tokens=10)
    gate.record("a", 9, 9)
    assert gate.decide("a", 0.1) is False and gate.to_dict()["segments"]["a"]["windows"] == 0
    dense = MoeGate(moe=False, min_draft_tokens=10)
    assert dense.allows("a") and dense.record("a", 10, 10) is False and dense.segments == {}
    vouched = MoeGate(moe=True, validated=True)
    assert vouched.allows("a") and vouched.record("a", 500, 0) is False
    with pytest.raises(ValueError):
        gate.record("a", 2, 3)
    with pytest.raises(ValueError):
        gate.decide("a", 1.5)
