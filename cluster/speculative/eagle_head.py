"""EAGLE-3 style draft head: what it computes, its configuration, and its files.

Owns: ``EagleConfig`` (dimensions, the target layers whose features it fuses, the draft
vocabulary size, the target's identity), ``EagleHead`` (an ``nn.Module``: fc fusing the
low/middle/high target features [3H -> H]; one Llama decoder layer whose q/k/v read the
RMS-normed embedding of the next token concatenated with the RMS-normed hidden, and whose residual
carries the hidden; a final norm and an LM head over the trimmed draft vocabulary with its
draft -> target id map), ``target_identity`` (architecture + a hash of the target's config and
weight shapes), ``trim_vocabulary`` (the same head over a subset of its draft vocabulary), and
``save_head`` / ``load_head`` (safetensors weights + ``eagle_config.json``),
which refuse a head trained for another target with an ``EagleTargetMismatch``. Weights are
stored in bfloat16 and computed in float32.
The variants published heads use (``cluster.speculative.head_formats`` reads them into this
module) are options of the same head, all off in the heads ``train-draft`` makes: the head's own
RoPE θ and scaling, a residual that carries the normed hidden (``norm_before_residual``), one norm
over the concatenated features or one per feature before ``fc`` (``FusionNorm``), the normed
output fed back between draft steps (``norm_output``) and per-head q/k norms (a Qwen3 layer).
Ignores: where the hidden comes from (catch-up vs draft steps: ``cluster.speculative.eagle``;
training-time test: ``cluster.training.eagle_trainer``), the token embedding (the target's, frozen,
passed in), KV bookkeeping (callers pass past K/V and the mask).

Conventions: the pair (feature of position t, embedding of token t+1) sits at position t + 1 (RoPE)
and its output predicts token t + 2; an "anchor" is such a t.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cluster.common.errors import ModelLoadError
from cluster.kernels import rms_norm
from cluster.models.linear import Linear
from cluster.models.llama import rope_inv_freq

CONFIG_FILE = "eagle_config.json"
WEIGHTS_FILE = "eagle_head.safetensors"
FORMAT_VERSION = 2  # 2: the variant fields below; a head without them (version 1) is the plain head
READ_VERSIONS = (1, 2)


class EagleTargetMismatch(ModelLoadError):
    """The head was trained for another target model."""


@dataclass(slots=True, frozen=True)
class TargetIdentity:
    model_type: str
    fingerprint: str  # sha256 of the target's architecture fields and weight shapes


def target_identity(model) -> TargetIdentity:
    """Identity of a loaded ``LlamaModel``: its architecture plus every weight shape, hashed.
    Two checkpoints of one architecture with the same shapes (a fine-tune) share it; the head
    is refused for anything else."""
    arch = dataclasses.asdict(model.arch)
    shapes = [list(model.embed.shape)] + [[k, list(getattr(v, "shape", ()))] for layer in model.layers
                                          for k, v in sorted(layer.items()) if v is not None]
    blob = json.dumps({"arch": arch, "shapes": shapes}, sort_keys=True, default=str)
    return TargetIdentity(model.arch.model_type, hashlib.sha256(blob.encode()).hexdigest()[:32])


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """Low / middle / high: the inputs of layers 2, N/2 and N-3 (EAGLE-3), clamped into the model."""
    top = num_layers - 1
    return (min(2, top), min(num_layers // 2, top), max(0, min(num_layers - 3, top)))


class FusionNorm(str, enum.Enum):
    """The RMSNorm applied to the target features before ``fc``."""

    NONE = "none"
    CONCAT = "concat"  # one norm over the concatenated [n * H] features (speculators' norm_before_fc)
    PER_FEATURE = "per_feature"  # one norm per captured layer's [H] feature (EAGLE 3.1, speculators' fc_norm)


@dataclass(slots=True, frozen=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    feature_layers: tuple[int, ...]
    draft_vocab_size: int
    target_vocab_size: int
    target: TargetIdentity
    rope_scaling: dict | None = None  # None, or a linear / llama3 rope_scaling dict (the head's own)
    norm_before_residual: bool = False  # the layer's residual is the normed hidden, not the raw one
    fusion_norm: FusionNorm = FusionNorm.NONE
    norm_output: bool = False  # feed the final-normed output back between draft steps (and to lm_head as is)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (a Qwen3 decoder layer)

    def __post_init__(self) -> None:
        if len(self.feature_layers) < 1:
            raise ValueError("an EAGLE head needs at least one target feature layer")
        if not 1 <= self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(f"draft vocabulary {self.draft_vocab_size} must be in [1, {self.target_vocab_size}]")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if not isinstance(self.fusion_norm, FusionNorm):
            raise ValueError(f"fusion_norm must be a FusionNorm, got {self.fusion_norm!r}")

    @classmethod
    def for_target(cls, model, draft_vocab_size: int,
                   feature_layers: tuple[int, ...] | None = None) -> "EagleConfig":
        a = model.arch
        return cls(hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, num_heads=a.num_heads,
                   num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps,
                   rope_theta=a.rope_theta,
                   feature_layers=tuple(feature_layers or default_feature_layers(a.num_layers)),
                   draft_vocab_size=min(draft_vocab_size, a.vocab_size), target_vocab_size=a.vocab_size,
                   target=target_identity(model))

    @property
    def plain(self) -> bool:
        """No variant on: the head version 1 of this file describes."""
        return (self.rope_scaling, self.norm_before_residual, self.fusion_norm, self.norm_output,
                self.qk_norm) == (None, False, FusionNorm.NONE, False, False)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        d["fusion_norm"] = self.fusion_norm.value
        if self.plain:  # readable by code that knows only version 1
            for name in _VARIANT_FIELDS:
                del d[name]
        return {"format_version": 1 if self.plain else FORMAT_VERSION, "architecture": "eagle3-llama-layer", **d}

    @classmethod
    def from_json(cls, d: dict) -> "EagleConfig":
        if d.get("format_version") not in READ_VERSIONS:
            raise ModelLoadError(f"EAGLE head format {d.get('format_version')!r} is not one of {READ_VERSIONS}")
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["feature_layers"] = tuple(kw["feature_layers"])
        kw["target"] = TargetIdentity(**kw["target"])
        if "fusion_norm" in kw:
            kw["fusion_norm"] = FusionNorm(kw["fusion_norm"])
        return cls(**kw)


_VARIANT_FIELDS = ("rope_scaling", "norm_before_residual", "fusion_norm", "norm_output", "qk_norm")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class EagleHead(nn.Module):
    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, D = cfg.hidden_size, cfg.head_dim
        q_out, kv_out = cfg.num_heads * D, cfg.num_kv_heads * D
        n = len(cfg.feature_layers)
        self.fc = nn.Linear(n * H, H, bias=False)
        if cfg.fusion_norm is FusionNorm.CONCAT:
            self.fc_norm = nn.Parameter(torch.ones(n * H))  # [n*H]
        elif cfg.fusion_norm is FusionNorm.PER_FEATURE:
            self.fc_norm = nn.Parameter(torch.ones(n, H))  # [n, H] one norm per captured layer
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(D))
            self.k_norm = nn.Parameter(torch.ones(D))
        self.embed_norm = nn.Parameter(torch.ones(H))
        self.hidden_norm = nn.Parameter(torch.ones(H))
        self.qkv = nn.Linear(2 * H, q_out + 2 * kv_out, bias=False)
        self.o = nn.Linear(q_out, H, bias=False)
        self.post_norm = nn.Parameter(torch.ones(H))
        self.gate_up = nn.Linear(H, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, H, bias=False)
        self.final_norm = nn.Parameter(torch.ones(H))
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        # draft id -> target id (absolute ids, sorted); a buffer so it travels with the weights
        self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("inv_freq", rope_inv_freq(D, cfg.rope_theta, cfg.rope_scaling), persistent=False)
        self._packed: dict[str, Linear] = {}  # inference copies of the projections (pack_for_inference)

    _PROJECTIONS = ("fc", "qkv", "o", "gate_up", "down", "lm_head")

    def pack_for_inference(self) -> None:
        """Copy the projections into the engine's skinny-GEMM ``Linear`` (weights streamed once per
        call: a draft step reads them at the target's bandwidth, ~2x faster than ``nn.Linear`` at one
        row), with a bfloat16 copy for draft rounds where the weights are bfloat16 values (a saved
        head is: ``save_head``): the same results, a round 1.19 -> 0.93 ms in the engine (the
        default model's head, 2 cores; 33 MB of float32 weights do not stay in a 32 MB L3 between
        target forwards). Used only with autograd off; a head trained further must be packed again."""
        self._packed = {name: Linear(getattr(self, name).weight.detach().t().float().contiguous(),
                                     narrow_copy=True) for name in self._PROJECTIONS}

    def _project(self, name: str, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        packed = self._packed.get(name)
        if packed is None or torch.is_grad_enabled():
            return getattr(self, name)(x)
        return packed(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], packed.out_features)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self._packed and not torch.is_grad_enabled() and rms_norm.applies(x, w):  # drafting: one native call
            return rms_norm.rms_norm(x, w.detach(), self.cfg.rms_norm_eps)
        return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:  # [..., 3H] -> [..., H]
        fusion = self.cfg.fusion_norm
        if fusion is FusionNorm.CONCAT:
            features = self._norm(features, self.fc_norm)
        elif fusion is FusionNorm.PER_FEATURE:
            n, H = self.fc_norm.shape
            per = features.reshape(*features.shape[:-1], n, H)  # [..., n, H]
            features = F.rms_norm(per, (H,), None, self.cfg.rms_norm_eps).mul(self.fc_norm).reshape(features.shape)
        return self._project("fc", features)

    def layer(self, hidden: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor,
              past_k: torch.Tensor | None, past_v: torch.Tensor | None,
              mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoder layer over B rows of Q new pairs.

        hidden [B, Q, H] (fused target feature or the head's previous output), emb [B, Q, H]
        (target embedding of the next token), positions [B, Q] int64, past_k / past_v
        [B, Hkv, L, D] or None, mask [B or 1, 1, Q, L + Q] bool (True = attend; keys are past
        then new) or None (every query attends to every key: one new pair). Returns (output
        [B, Q, H] pre-norm — final-normed under ``norm_output`` —, new k, new v [B, Hkv, Q, D]).
        """
        c = self.cfg
        B, Q, _ = hidden.shape
        Hq, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        normed = self._norm(hidden, self.hidden_norm)
        residual = normed if c.norm_before_residual else hidden
        x = torch.cat([self._norm(emb, self.embed_norm), normed], dim=-1)  # [B, Q, 2H]
        qkv = self._project("qkv", x)
        q = qkv[..., : Hq * D].view(B, Q, Hq, D)  # [B, Q, Hq, D]
        k = qkv[..., Hq * D : (Hq + Hkv) * D].view(B, Q, Hkv, D)  # [B, Q, Hkv, D]
        if c.qk_norm:  # per head, before RoPE
            q = F.rms_norm(q, (D,), self.q_norm, c.rms_norm_eps)
            k = F.rms_norm(k, (D,), self.k_norm, c.rms_norm_eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, Hq, Q, D], [B, Hkv, Q, D]
        v = qkv[..., (Hq + Hkv) * D :].view(B, Q, Hkv, D).transpose(1, 2)
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [B, Q, D/2]
        emb_f = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)  # [B, 1, Q, D]
        cos, sin = emb_f.cos(), emb_f.sin()
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)  # [B, Hkv, L + Q, D]
        values = v if past_v is None else torch.cat([past_v, v], dim=2)
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=Hq != Hkv)
        out = residual + self._project("o", attn.transpose(1, 2).reshape(B, Q, Hq * D))  # [B, Q, H]
        gate, up = self._project("gate_up", self._norm(out, self.post_norm)).chunk(2, dim=-1)
        out = out + self._project("down", F.silu(gate) * up)
        if c.norm_output:  # the normed output is what goes on (next step's hidden, and lm_head as is)
            out = self._norm(out, self.final_norm)
        return out, k, v

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., Vd]
        """``out``: what ``layer`` returned (already final-normed under ``norm_output``)."""
        return self._project("lm_head", out if self.cfg.norm_output else self._norm(out, self.final_norm))

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:  # [N, Vd] -> [N, V] float32
        """Scatter into the target vocabulary; ids outside the draft vocabulary get -inf (so q
        is zero there and greedy never picks them)."""
        full = logits.new_full((logits.shape[0], self.cfg.target_vocab_size), float("-inf"), dtype=torch.float32)
        full[:, self.draft_to_target] = logits.float()
        return full


def trim_vocabulary(head: EagleHead, keep: torch.Tensor) -> EagleHead:
    """A copy of ``head`` whose draft vocabulary is ``keep`` (target ids, a subset of its own):
    the LM head keeps those rows, everything else is shared by value. Greedy drafts change only
    where the dropped tokens were the head's top choice; q is renormalised over the kept tokens
    (drafts stay lossless: verification uses the q a draft came with). A round reads fewer
    weights: the default model's 8k LM head is over half of a round's. keep [Vd'] int64."""
    keep = torch.unique(keep.to(torch.int64))  # sorted, as draft_to_target is
    own = head.draft_to_target
    rows = torch.searchsorted(own, keep)
    inside = bool((rows < own.numel()).all()) and torch.equal(own[rows.clamp(max=own.numel() - 1)], keep)
    if keep.numel() < 1 or not inside:
        raise ValueError("a trimmed vocabulary must be a non-empty subset of the head's draft vocabulary")
    cfg = dataclasses.replace(head.cfg, draft_vocab_size=int(keep.numel()))
    out = EagleHead(cfg)
    state = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "draft_to_target")}
    state["lm_head.weight"] = head.lm_head.weight.detach()[rows].clone()
    state["draft_to_target"] = keep
    out.load_state_dict(state)
    return out.train(head.training)


def save_head(head: EagleHead, out_dir: Path, extra: dict | None = None) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    # bfloat16 on disk (an 8k-vocabulary head for SmolLM2 is ~20 MB); loaded back into float32
    state = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).cpu().contiguous()
             for k, v in head.state_dict().items()}
    save_file(state, str(out_dir / WEIGHTS_FILE))
    (out_dir / CONFIG_FILE).write_text(json.dumps({**head.cfg.to_json(), **(extra or {})}, indent=1) + "\n")


def load_head(head_dir: Path, target_model=None) -> EagleHead:
    """Load a head; with ``target_model`` (a ``LlamaModel``), refuse one trained for another target."""
    from safetensors.torch import load_file

    head_dir = Path(head_dir)
    cfg_path = head_dir / CONFIG_FILE
    if not cfg_path.is_file():
        raise ModelLoadError(f"{head_dir} is not an EAGLE head directory (no {CONFIG_FILE}); "
                             "make one with `specserve train-draft`")
    cfg = EagleConfig.from_json(json.loads(cfg_path.read_text()))
    if target_model is not None:
        have = target_identity(target_model)
        if have != cfg.target:
            raise EagleTargetMismatch(
                f"EAGLE head {head_dir} was trained for another target ({cfg.target.model_type}, "
                f"fingerprint {cfg.target.fingerprint}); this target is {have.model_type}, fingerprint "
                f"{have.fingerprint}. Train one for it with `specserve train-draft`")
    head = EagleHead(cfg)
    head.load_state_dict(load_file(str(head_dir / WEIGHTS_FILE)))
    return head.eval()
