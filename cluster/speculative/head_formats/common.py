"""What the published EAGLE-3 head formats share, read into our ``EagleHead``.

Owns: reading a head directory's JSON and safetensors (one file, or shards through their index:
every name resolved through the map, never by file order), the decoder-layer config every format
carries (a Hugging Face Llama / Qwen3 config of one layer) turned into ``EagleConfig`` dimensions
and RoPE, the checks that the head fits the target it is loaded for (hidden size, vocabulary,
feature layers, embedding), the draft vocabulary map (``d2t`` offsets and ``t2d`` mask -> our
sorted absolute ``draft_to_target``), the LM head (own rows, or tied to an embedding), the
declared dtype against the tensors', and the weight names of the decoder layer
(``q/k/v`` -> ``qkv``, ``gate/up`` -> ``gate_up``, ``input_layernorm`` -> ``embed_norm``, ...).
Every input is used or refused: a tensor the head does not use is an error, as is a missing one.
Ignores: which format a directory is (``cluster.speculative.head_formats``), each format's own
config keys (``speculators``, ``eagle3``), training-only fields.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.common.errors import ModelLoadError
from cluster.models.llama import LlamaArch
from cluster.speculative.eagle_head import EagleConfig, EagleHead, EagleTargetMismatch, FusionNorm, target_identity

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# HF class names of the targets our native runner serves, by model_type
TARGET_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
HEAD_LAYER_TYPES = ("llama", "qwen3")  # the decoder layers an EAGLE-3 head is built from


class HeadFormatError(ModelLoadError):
    """A head directory that cannot be read: malformed config, missing or unexpected tensors."""


def read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HeadFormatError(f"{path}: not a readable JSON config ({e})") from None
    if not isinstance(d, dict):
        raise HeadFormatError(f"{path}: a config must be a JSON object")
    return d


def read_tensors(head_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head: ``model.safetensors``, or the shards its index names."""
    from safetensors.torch import load_file

    index = head_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HeadFormatError(f"{index}: no weight_map")
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            if not (head_dir / shard).is_file():
                raise HeadFormatError(f"{head_dir}: shard {shard} named by {SAFETENSORS_INDEX} is missing")
            tensors = load_file(str(head_dir / shard))
            for name, t in tensors.items():
                if weight_map.get(name) != shard:
                    raise HeadFormatError(f"{head_dir}/{shard}: tensor {name} is not mapped to this shard by the index")
                out[name] = t
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise HeadFormatError(f"{head_dir}: tensors {missing} named by the index are in no shard")
        return out
    if (head_dir / SAFETENSORS).is_file():
        return load_file(str(head_dir / SAFETENSORS))
    if any(head_dir.glob("*.bin")):
        raise HeadFormatError(f"{head_dir}: only pickled weights (*.bin); convert them to safetensors first "
                              "(pickle files can run code when loaded)")
    raise HeadFormatError(f"{head_dir}: no {SAFETENSORS} or {SAFETENSORS_INDEX}")


def declared_dtype(cfg: dict, where: str) -> torch.dtype | None:
    """``dtype`` (transformers 5) or ``torch_dtype`` (4.x); None when neither is written."""
    name = cfg.get("dtype", cfg.get("torch_dtype"))
    if name is None:
        return None
    if name not in DTYPES:
        raise HeadFormatError(f"{where}: dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass(slots=True, frozen=True)
class LayerSpec:
    """The head's decoder layer, from the Hugging Face config it carries."""

    arch: LlamaArch  # of the head's one-layer "model": vocab_size is the target's vocabulary
    layer_type: str  # llama | qwen3


def layer_spec(cfg: dict, where: str) -> LayerSpec:
    """Parse and check a head's decoder-layer config: a Llama or Qwen3 layer of one decoder
    layer, no biases, no sliding window, RoPE default / linear / llama3."""
    layer_type = cfg.get("model_type")
    if layer_type not in HEAD_LAYER_TYPES:
        raise HeadFormatError(f"{where}: decoder layer model_type {layer_type!r} is not one of {list(HEAD_LAYER_TYPES)}")
    need = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing = [k for k in need if cfg.get(k) is None]
    if missing:
        raise HeadFormatError(f"{where}: decoder layer config lacks {missing}")
    try:
        # the values a key left out means are the config class's (speculators writes a diff against them)
        full = _full_layer_config(cfg)
        arch = LlamaArch.from_hf_config(full)
    except (KeyError, TypeError, ValueError, ModelLoadError) as e:
        raise HeadFormatError(f"{where}: decoder layer config: {e}") from None
    cfg = full
    if arch.num_layers != 1:
        raise HeadFormatError(f"{where}: num_hidden_layers {arch.num_layers}: only one-layer EAGLE-3 heads are supported")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise HeadFormatError(f"{where}: attention_bias / mlp_bias heads are not supported")
    types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in types) or cfg.get("use_sliding_window"):
        raise HeadFormatError(f"{where}: sliding-window draft layers ({types or 'use_sliding_window'}) are not "
                              "supported: the drafter attends to the whole sequence")
    return LayerSpec(arch, layer_type)


def _full_layer_config(cfg: dict) -> dict:
    """Every field of the head's decoder-layer config, with the Hugging Face config class's
    defaults for the keys it leaves out (as speculators, vLLM and SGLang read it)."""
    import transformers

    d = {k: v for k, v in cfg.items() if k not in ("architectures", "auto_map", "transformers_version")}
    d.setdefault("num_hidden_layers", 1)
    return transformers.AutoConfig.for_model(**d).to_dict()


def check_target(where: str, target, *, hidden_size: int, target_hidden_size: int | None, vocab_size: int,
                 feature_layers: tuple[int, ...], architectures: list[str] | None = None) -> None:
    """Refuse (``EagleTargetMismatch``, naming the field) a head written for another target."""
    a = target.arch
    if architectures:
        want = TARGET_ARCHITECTURES.get(a.model_type)
        if want not in architectures:
            raise EagleTargetMismatch(f"{where}: the head names verifier architectures {architectures}; "
                                      f"this target is {want}")
    feature_width = target_hidden_size or hidden_size
    if feature_width != a.hidden_size:
        field = "target_hidden_size" if target_hidden_size else "hidden_size"
        raise EagleTargetMismatch(f"{where}: {field} {feature_width} differs from the target's hidden_size {a.hidden_size}")
    if hidden_size != a.hidden_size:
        raise EagleTargetMismatch(f"{where}: hidden_size {hidden_size} differs from the target's {a.hidden_size}: "
                                  "heads narrower or wider than their target are not supported")
    if vocab_size != a.vocab_size:
        raise EagleTargetMismatch(f"{where}: vocab_size {vocab_size} differs from the target's vocab_size {a.vocab_size}")
    bad = [i for i in feature_layers if not 0 <= i < a.num_layers]
    if bad or not feature_layers:
        raise EagleTargetMismatch(f"{where}: feature layers {list(feature_layers)} are not inputs of the target's "
                                  f"{a.num_layers} layers (ids 0..{a.num_layers - 1})")


def draft_to_target(where: str, d2t: torch.Tensor | None, t2d: torch.Tensor | None, draft_vocab: int,
                    vocab: int) -> torch.Tensor:
    """The draft vocabulary as absolute target ids [Vd] (int64), in draft-row order. ``d2t`` holds
    offsets (target id = draft id + d2t[draft id]); ``t2d`` [V] bool, when given, must mark
    exactly those ids."""
    if d2t is None:
        if draft_vocab != vocab:
            raise HeadFormatError(f"{where}: draft vocabulary {draft_vocab} < target vocabulary {vocab} but no d2t map")
        ids = torch.arange(vocab, dtype=torch.int64)
    else:
        if d2t.dtype.is_floating_point or d2t.shape != (draft_vocab,):
            raise HeadFormatError(f"{where}: d2t must be an integer tensor [{draft_vocab}], got {d2t.dtype} {list(d2t.shape)}")
        ids = torch.arange(draft_vocab, dtype=torch.int64) + d2t.to(torch.int64)
        if bool((ids < 0).any()) or bool((ids >= vocab).any()):
            raise HeadFormatError(f"{where}: d2t maps draft ids outside the target vocabulary [0, {vocab})")
        if torch.unique(ids).numel() != draft_vocab:
            raise HeadFormatError(f"{where}: d2t maps two draft ids to one target id")
    if t2d is not None:
        if t2d.shape != (vocab,):
            raise HeadFormatError(f"{where}: t2d must be [{vocab}], got {list(t2d.shape)}")
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[ids] = True
        if not torch.equal(t2d.to(torch.bool), mask):
            raise HeadFormatError(f"{where}: t2d does not mark exactly the target ids d2t maps to")
    return ids


@dataclass(slots=True)
class HeadTensors:
    """A head's tensors under our names, before the vocabulary is sorted (rows follow ``ids``)."""

    state: dict[str, torch.Tensor]
    ids: torch.Tensor  # [Vd] absolute target id of each lm_head row


def layer_tensors(where: str, tensors: dict[str, torch.Tensor], prefix: str, qk_norm: bool) -> dict[str, torch.Tensor]:
    """Our names for the decoder layer's tensors under ``prefix`` (``layers.0.`` or ``midlayer.``);
    each one taken out of ``tensors``."""
    def take(name: str) -> torch.Tensor:
        key = prefix + name
        if key not in tensors:
            raise HeadFormatError(f"{where}: missing tensor {key}")
        return tensors.pop(key)

    out = {
        "embed_norm": take("input_layernorm.weight"),
        "hidden_norm": take("hidden_norm.weight"),
        "post_norm": take("post_attention_layernorm.weight"),
        "qkv.weight": torch.cat([take(f"self_attn.{n}_proj.weight") for n in "qkv"]),
        "o.weight": take("self_attn.o_proj.weight"),
        "gate_up.weight": torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")]),
        "down.weight": take("mlp.down_proj.weight"),
    }
    if qk_norm:
        out["q_norm"], out["k_norm"] = take("self_attn.q_norm.weight"), take("self_attn.k_norm.weight")
    return out


def check_dtype(where: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> None:
    """Float tensors must be in the dtype the config declares (when it declares one)."""
    if dtype is None:
        return
    bad = sorted(k for k, t in tensors.items() if t.is_floating_point() and t.dtype != dtype)
    if bad:
        raise HeadFormatError(f"{where}: the config declares {dtype} but tensors {bad[:4]} are "
                              f"{tensors[bad[0]].dtype}")


def check_embedding(where: str, embed: torch.Tensor, target) -> None:
    """A head's saved embedding must be its target's (the drafter uses the target's)."""
    own = target.embed.detach().cpu()
    if embed.shape != own.shape:
        raise EagleTargetMismatch(f"{where}: embed_tokens {list(embed.shape)} differs from the target's {list(own.shape)}")
    if torch.equal(embed, own.to(embed.dtype)):  # the usual case: a copy in the head's dtype
        return
    diff = (embed.float() - own.float()).abs().max().item()
    scale = own.float().abs().max().item()
    if diff > 1e-2 * max(scale, 1e-6):  # a copy, up to a 16-bit rounding of either side
        raise EagleTargetMismatch(f"{where}: embed_tokens differs from the target's embedding (max |diff| {diff:.3g}): "
                                  "the head was trained for another target")


def lm_head_rows(where: str, tensors: dict[str, torch.Tensor], ids: torch.Tensor, tied: bool,
                 target) -> torch.Tensor:  # [Vd, H], rows following ids
    """The head's LM head: its own ``lm_head.weight``, or, for a head whose config ties it
    (``tie_word_embeddings``), the embedding's rows at the draft ids (the head's saved embedding,
    checked equal to the target's, else the target's)."""
    own = tensors.pop("lm_head.weight", None)
    if tied:
        if own is not None:
            raise HeadFormatError(f"{where}: tie_word_embeddings is set but the head also has its own lm_head.weight")
        return target.embed.detach().cpu()[ids].float()
    if own is None:
        raise HeadFormatError(f"{where}: missing tensor lm_head.weight (and the config does not tie it)")
    return own


def build_head(where: str, cfg: EagleConfig, state: dict[str, torch.Tensor], ids: torch.Tensor,
               leftover: dict[str, torch.Tensor]) -> EagleHead:
    """An ``EagleHead`` from our-named tensors whose LM-head rows follow ``ids``; rows are sorted
    by target id (our map is sorted). ``leftover``: tensors of the file nobody took (an error)."""
    if leftover:
        raise HeadFormatError(f"{where}: tensors this head format does not use: {sorted(leftover)[:8]}")
    order = torch.argsort(ids)
    state = dict(state)
    state["lm_head.weight"] = state["lm_head.weight"][order]
    state["draft_to_target"] = ids[order]
    head = EagleHead(cfg)
    want = head.state_dict()
    for name, t in state.items():
        if name not in want:
            raise HeadFormatError(f"{where}: internal: {name} is not a head parameter")
        if t.shape != want[name].shape:
            raise HeadFormatError(f"{where}: tensor for {name} has shape {list(t.shape)}, the config implies "
                                  f"{list(want[name].shape)}")
    missing = sorted(set(want) - set(state))
    if missing:
        raise HeadFormatError(f"{where}: missing tensors for {missing}")
    head.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in state.items()})
    return head.eval()


def eagle_config(spec: LayerSpec, target, *, feature_layers: tuple[int, ...], draft_vocab: int,
                 norm_before_residual: bool, fusion_norm: FusionNorm, norm_output: bool) -> EagleConfig:
    a = spec.arch
    return EagleConfig(hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, num_heads=a.num_heads,
                       num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps,
                       rope_theta=a.rope_theta, feature_layers=feature_layers, draft_vocab_size=draft_vocab,
                       target_vocab_size=a.vocab_size, target=target_identity(target),
                       rope_scaling=a.rope_scaling, norm_before_residual=norm_before_residual,
                       fusion_norm=fusion_norm, norm_output=norm_output, qk_norm=spec.layer_type == "qwen3")
