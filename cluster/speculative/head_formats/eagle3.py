"""The original EAGLE-3 layout (SafeAILab/EAGLE, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B) and
SpecForge's (sgl-project/SpecForge, ``LlamaForCausalLMEagle3``, what SGLang serves), read.

A head is a directory: ``config.json``, a Llama config of one decoder layer plus
``draft_vocab_size`` (SpecForge may add ``target_hidden_size``, ``fc_norm``, ``norm_output`` and
``eagle_config.eagle_aux_hidden_state_layer_ids``), and ``model.safetensors`` (or shards with an
index): ``fc.weight``, ``midlayer.*`` (the same layer as speculators' ``layers.0.*``),
``norm.weight``, ``lm_head.weight``, ``d2t`` / ``t2d`` (absent when the vocabularies are equal),
``embed_tokens.weight`` (SpecForge exports carry the target's; the original leaves it out),
``fc_norm.{i}.weight`` with ``fc_norm``.

Owns: ``is_eagle3_config`` and ``read_eagle3_head`` (-> ``EagleHead`` for a loaded target).
Reads: the residual is the raw feature (both codebases); feature layers are the inputs of target
layers 2, N/2, N-3 (the original's capture points) unless ``eagle_config`` lists SpecForge's ids,
which count layer *outputs* (SGLang adds 1 to them), so we add 1; ``tie_word_embeddings`` (the LM
head is the embedding's draft rows); SpecForge's ``norm_output`` means "apply the final norm before
lm_head" (default true; the fed-back state is always pre-norm), so false is refused, not mapped to
speculators' flag of the same name; ``bias`` (a biased ``fc``) is refused; ``torch_dtype`` / ``dtype``.
Ignores: ``architectures`` (which class the codebase loads), the HF bookkeeping keys.
"""
from __future__ import annotations

from pathlib import Path

import torch

from cluster.speculative.eagle_head import EagleHead, FusionNorm, default_feature_layers
from cluster.speculative.head_formats.common import (
    HeadFormatError, build_head, check_dtype, check_embedding, check_target, declared_dtype, draft_to_target,
    eagle_config, layer_spec, layer_tensors, lm_head_rows, read_json, read_tensors,
)


def is_eagle3_config(cfg: dict) -> bool:
    return "draft_vocab_size" in cfg or any(str(a).endswith("Eagle3") for a in cfg.get("architectures") or ())


def read_eagle3_head(head_dir: Path, target) -> EagleHead:
    where = str(head_dir)
    cfg = read_json(head_dir / "config.json")
    spec = layer_spec(cfg, where)
    vocab = spec.arch.vocab_size
    draft_vocab = cfg.get("draft_vocab_size")
    if draft_vocab is None:  # SGLang: no draft vocabulary, the whole one
        draft_vocab = vocab
    if not isinstance(draft_vocab, int):
        raise HeadFormatError(f"{where}: draft_vocab_size must be an integer or null")
    if cfg.get("bias"):
        raise HeadFormatError(f"{where}: a biased fc (\"bias\": true) is not supported")
    if cfg.get("norm_output", True) is not True:
        raise HeadFormatError(f"{where}: norm_output false (logits from the un-normed output) is not supported")
    fc_norm = cfg.get("fc_norm", False)
    if not isinstance(fc_norm, bool):
        raise HeadFormatError(f"{where}: fc_norm must be true or false")
    eagle_cfg = cfg.get("eagle_config") or {}
    if not isinstance(eagle_cfg, dict):
        raise HeadFormatError(f"{where}: eagle_config must be an object")
    outputs_of = eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
    if outputs_of is None:
        feature_layers = default_feature_layers(target.arch.num_layers)
    elif isinstance(outputs_of, list) and all(isinstance(i, int) for i in outputs_of):
        feature_layers = tuple(i + 1 for i in outputs_of)  # output of layer i = input of layer i + 1
    else:
        raise HeadFormatError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids must be a list of integers")
    target_hidden = cfg.get("target_hidden_size")
    if target_hidden is not None and not isinstance(target_hidden, int):
        raise HeadFormatError(f"{where}: target_hidden_size must be an integer or null")
    check_target(where, target, hidden_size=spec.arch.hidden_size, target_hidden_size=target_hidden,
                 vocab_size=vocab, feature_layers=feature_layers)

    tensors = read_tensors(head_dir)
    check_dtype(where, tensors, declared_dtype(cfg, where))
    ids = draft_to_target(where, tensors.pop("d2t", None), tensors.pop("t2d", None), draft_vocab, vocab)
    embed = tensors.pop("embed_tokens.weight", None)
    if embed is not None:
        check_embedding(where, embed, target)
    state = layer_tensors(where, tensors, "midlayer.", spec.layer_type == "qwen3")
    for ours, theirs in (("fc.weight", "fc.weight"), ("final_norm", "norm.weight")):
        if theirs not in tensors:
            raise HeadFormatError(f"{where}: missing tensor {theirs}")
        state[ours] = tensors.pop(theirs)
    if fc_norm:
        names = [f"fc_norm.{i}.weight" for i in range(len(feature_layers))]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise HeadFormatError(f"{where}: missing tensors {missing}")
        state["fc_norm"] = torch.stack([tensors.pop(n) for n in names])
    if cfg.get("draft_vocab_size") is None and "lm_head.weight" not in tensors:  # SGLang: the target's LM head
        state["lm_head.weight"] = target.lm_head.weight().t().float().cpu()  # [V, H]
    else:
        state["lm_head.weight"] = lm_head_rows(where, tensors, ids, bool(cfg.get("tie_word_embeddings", False)), target)
    ecfg = eagle_config(spec, target, feature_layers=feature_layers, draft_vocab=draft_vocab,
                        norm_before_residual=False,
                        fusion_norm=FusionNorm.PER_FEATURE if fc_norm else FusionNorm.NONE, norm_output=False)
    return build_head(where, ecfg, state, ids, tensors)
