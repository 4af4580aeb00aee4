"""The ``speculators`` format (vllm-project/speculators, what vLLM serves): EAGLE-3 heads, read
and written.

A head is a directory: ``config.json`` (``speculators_model_type: eagle3``, the decoder layer as
``transformer_layer_config``, ``draft_vocab_size``, the flags below, ``speculators_config`` with
the proposal method and the verifier) and ``model.safetensors`` (or shards with an index):
``fc.weight``, ``layers.0.*`` (q/k/v over [embedding, feature], ``hidden_norm``), ``norm.weight``,
``lm_head.weight`` over the draft vocabulary, ``d2t`` (offsets) / ``t2d`` (mask) when the draft
vocabulary is trimmed, ``embed_tokens.weight`` (a copy of the verifier's, optional),
``input_norm.weight`` (``norm_before_fc``) or ``fc_norm.{i}.weight`` (``fc_norm``).

Owns: ``read_speculators_head`` (config + tensors -> ``EagleHead`` for a loaded target, refusing
a head for another target or one whose options our head lacks) and ``write_speculators_head``
(our head -> a directory the ``speculators`` package's ``Eagle3SpeculatorConfig`` /
``Eagle3DraftModel`` load, and vLLM serves with the verifier it names).
Reads: ``eagle_aux_hidden_state_layer_ids`` as the inputs of those target layers (vLLM's and
speculators' convention: HF ``hidden_states[i]``), null = [2, N/2, N-3]; ``norm_before_residual``
(required: speculators defaults it to False, vLLM to True), ``norm_before_fc``, ``fc_norm``,
``norm_output`` (speculators' meaning: the normed output is fed back), ``target_hidden_size``,
the verifier's ``architectures``, ``dtype`` / ``torch_dtype``.
Ignores, by name: ``verifier_lm_head.weight`` / ``verifier_norm.weight`` (training-only tensors
older versions saved), ``embed_requires_grad``, the proposal methods (K is the engine's:
``--num-draft-tokens``), ``speculators_version`` and the other HF bookkeeping keys.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from cluster.speculative.eagle_head import EagleHead, FusionNorm, default_feature_layers
from cluster.speculative.head_formats.common import (
    SAFETENSORS, TARGET_ARCHITECTURES, HeadFormatError, build_head, check_dtype, check_embedding, check_target,
    declared_dtype, draft_to_target, eagle_config, layer_spec, layer_tensors, lm_head_rows, read_json, read_tensors,
)

MODEL_TYPE = "eagle3"
TRAINING_ONLY = ("verifier_lm_head.weight", "verifier_norm.weight")
SPECULATORS_VERSION = "0.9.0"  # the package version whose classes the written heads are checked against
DEFAULT_SPECULATIVE_TOKENS = 3


def is_speculators_config(cfg: dict) -> bool:
    return "speculators_model_type" in cfg


def read_speculators_head(head_dir: Path, target) -> EagleHead:
    where = str(head_dir)
    cfg = read_json(head_dir / "config.json")
    kind = cfg.get("speculators_model_type")
    if kind != MODEL_TYPE:
        raise HeadFormatError(f"{where}: speculators_model_type {kind!r}: only {MODEL_TYPE!r} heads are supported")
    layer_cfg = cfg.get("transformer_layer_config")
    if not isinstance(layer_cfg, dict):
        raise HeadFormatError(f"{where}: transformer_layer_config must be an object (the draft's decoder layer config)")
    spec = layer_spec(layer_cfg, f"{where} transformer_layer_config")
    for key in ("draft_vocab_size", "norm_before_residual"):
        if key not in cfg:
            raise HeadFormatError(f"{where}: config lacks {key}")
    flags = {}
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        value = cfg.get(key, False)
        if not isinstance(value, bool):
            raise HeadFormatError(f"{where}: {key} must be true or false, got {value!r}")
        flags[key] = value
    if flags["norm_before_fc"] and flags["fc_norm"]:
        raise HeadFormatError(f"{where}: norm_before_fc and fc_norm are mutually exclusive")
    draft_vocab = cfg["draft_vocab_size"]
    target_hidden = cfg.get("target_hidden_size")
    layers = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(draft_vocab, int) or (target_hidden is not None and not isinstance(target_hidden, int)):
        raise HeadFormatError(f"{where}: draft_vocab_size / target_hidden_size must be integers")
    if layers is not None and (not isinstance(layers, list) or not all(isinstance(i, int) for i in layers)):
        raise HeadFormatError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of integers or null")
    feature_layers = tuple(layers) if layers is not None else default_feature_layers(target.arch.num_layers)
    verifier = (cfg.get("speculators_config") or {}).get("verifier") or {}
    check_target(where, target, hidden_size=spec.arch.hidden_size, target_hidden_size=target_hidden,
                 vocab_size=spec.arch.vocab_size, feature_layers=feature_layers,
                 architectures=verifier.get("architectures"))

    tensors = read_tensors(head_dir)
    check_dtype(where, tensors, declared_dtype(cfg, where) or declared_dtype(layer_cfg, where))
    for name in TRAINING_ONLY:
        tensors.pop(name, None)
    ids = draft_to_target(where, tensors.pop("d2t", None), tensors.pop("t2d", None), draft_vocab,
                          spec.arch.vocab_size)
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is not None:
        check_embedding(where, embed, target)
    fusion = (FusionNorm.CONCAT if flags["norm_before_fc"] else
              FusionNorm.PER_FEATURE if flags["fc_norm"] else FusionNorm.NONE)
    state = layer_tensors(where, tensors, "layers.0.", spec.layer_type == "qwen3")
    state["fc.weight"] = _take(where, tensors, "fc.weight")
    state["final_norm"] = _take(where, tensors, "norm.weight")
    if fusion is FusionNorm.CONCAT:
        state["fc_norm"] = _take(where, tensors, "input_norm.weight")
    elif fusion is FusionNorm.PER_FEATURE:
        state["fc_norm"] = torch.stack([_take(where, tensors, f"fc_norm.{i}.weight") for i in range(len(feature_layers))])
    state["lm_head.weight"] = lm_head_rows(where, tensors, ids, False, target)
    ecfg = eagle_config(spec, target, feature_layers=feature_layers, draft_vocab=draft_vocab,
                        norm_before_residual=flags["norm_before_residual"], fusion_norm=fusion,
                        norm_output=flags["norm_output"])
    return build_head(where, ecfg, state, ids, tensors)


def _take(where: str, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise HeadFormatError(f"{where}: missing tensor {name}")
    return tensors.pop(name)


def write_speculators_head(head: EagleHead, target, out_dir: Path, *, verifier_name_or_path: str | None = None,
                           dtype: torch.dtype = torch.bfloat16,
                           speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS) -> None:
    """Write ``head`` (for ``target``, a loaded ``LlamaModel``) in the speculators format: the
    decoder layer as the target's own config kind (Llama layer; a q/k-normed head as a Qwen3
    layer), the target's embedding as ``embed_tokens`` (vLLM shares it when equal), ``d2t`` /
    ``t2d`` when the draft vocabulary is trimmed, float tensors in ``dtype``."""
    from safetensors.torch import save_file

    c, a = head.cfg, target.arch
    if a.vocab_size != c.target_vocab_size or a.hidden_size != c.hidden_size:
        raise HeadFormatError("the head does not fit this target (vocabulary or hidden size)")
    dtype_name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    sd = {k: v.detach().cpu() for k, v in head.state_dict().items()}
    D = c.head_dim
    q_out, kv_out = c.num_heads * D, c.num_kv_heads * D
    qkv, gate_up = sd["qkv.weight"], sd["gate_up.weight"]
    p = "layers.0."
    out = {
        "fc.weight": sd["fc.weight"],
        p + "input_layernorm.weight": sd["embed_norm"],
        p + "hidden_norm.weight": sd["hidden_norm"],
        p + "post_attention_layernorm.weight": sd["post_norm"],
        p + "self_attn.q_proj.weight": qkv[:q_out],
        p + "self_attn.k_proj.weight": qkv[q_out : q_out + kv_out],
        p + "self_attn.v_proj.weight": qkv[q_out + kv_out :],
        p + "self_attn.o_proj.weight": sd["o.weight"],
        p + "mlp.gate_proj.weight": gate_up[: c.intermediate_size],
        p + "mlp.up_proj.weight": gate_up[c.intermediate_size :],
        p + "mlp.down_proj.weight": sd["down.weight"],
        "norm.weight": sd["final_norm"],
        "lm_head.weight": sd["lm_head.weight"],
        "embed_tokens.weight": target.embed.detach().cpu(),
    }
    if c.qk_norm:
        out[p + "self_attn.q_norm.weight"], out[p + "self_attn.k_norm.weight"] = sd["q_norm"], sd["k_norm"]
    if c.fusion_norm is FusionNorm.CONCAT:
        out["input_norm.weight"] = sd["fc_norm"]
    elif c.fusion_norm is FusionNorm.PER_FEATURE:
        for i, row in enumerate(sd["fc_norm"]):
            out[f"fc_norm.{i}.weight"] = row
    ids = sd["draft_to_target"]
    if c.draft_vocab_size < c.target_vocab_size:
        out["d2t"] = ids - torch.arange(c.draft_vocab_size, dtype=torch.int64)  # offsets
        t2d = torch.zeros(c.target_vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
    elif not torch.equal(ids, torch.arange(c.target_vocab_size)):
        raise HeadFormatError("a head over the whole vocabulary must map draft id i to target id i")
    out = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in out.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_dir / SAFETENSORS), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(
        speculators_config(head, target, verifier_name_or_path, dtype_name, speculative_tokens), indent=2) + "\n")


def speculators_config(head: EagleHead, target, verifier_name_or_path: str | None, dtype_name: str,
                       speculative_tokens: int) -> dict:
    c, a = head.cfg, target.arch
    layer_type = "qwen3" if c.qk_norm else "llama"
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling:
        rope = {**c.rope_scaling, "rope_theta": c.rope_theta}
    layer = {
        "model_type": layer_type, "architectures": [TARGET_ARCHITECTURES[layer_type]],
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "rope_parameters": rope, "vocab_size": c.target_vocab_size,
        "max_position_embeddings": a.max_position_embeddings, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": False, "dtype": dtype_name,
    }
    if layer_type == "qwen3":
        layer["use_sliding_window"] = False
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": MODEL_TYPE,
        "speculators_version": SPECULATORS_VERSION,
        "dtype": dtype_name,
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.fusion_norm is FusionNorm.CONCAT,
        "fc_norm": c.fusion_norm is FusionNorm.PER_FEATURE,
        "norm_output": c.norm_output,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(c.feature_layers),
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": MODEL_TYPE,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": [TARGET_ARCHITECTURES[a.model_type]]},
        },
        "specserve": {"target": {"model_type": c.target.model_type, "fingerprint": c.target.fingerprint}},
    }
