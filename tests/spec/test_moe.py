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

from cluster.spec.moe import MoeGate, is_moe_config

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
        "reason": "MoE target: measured alpha 0.350 < 0.5"}
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
