"""Our forward pass for the Llama family (Llama / SmolLM, Mistral, Qwen2, Qwen3) over the block
KV cache.

Owns: weights (fused QKV and gate/up projections), RoPE, RMSNorm, grouped-query attention over a
ragged batch whose K/V live in flat paged storage, logits for the positions asked for, the
layer-skip entry (run the first L layers + LM head) used by self-speculation, and the feature
entry (``forward_features``: the same pass also returning the residual stream entering chosen
layers at every fed position, what an EAGLE head drafts from), and the device the weights, the
rotary tables and the KV storage live on (``cpu`` unless asked: the native kernels are CPU float32
ones, every other device or dtype takes the torch operators).
Ignores: which sequences are in the batch and where their blocks are (``ForwardBatch`` is built
by ``cluster.models.runner``), sampling, and architectures outside the family (HF fallback).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cluster.common.errors import ModelLoadError
from cluster.kernels import paged_attention, rms_norm, rope_cache
from cluster.models.linear import Linear

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


@dataclass(slots=True, frozen=True)
class LlamaArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "LlamaArch":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(f"model_type {model_type!r} is not in our Llama family {sorted(SUPPORTED_MODEL_TYPES)}")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ModelLoadError(f"rope type {rope_type!r} is not supported by the native runner")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope if rope_type != "default" else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
        )


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended together with padding (decode/verify rows, or one long prefill)."""

    q_index: torch.Tensor  # [G, Qmax] int64 rows of the flat [T+1] query (T = padding row)
    kv_slots: torch.Tensor  # [G, Lmax] int64 flat KV slots (0 where padded)
    mask: torch.Tensor | None  # [G, 1, Qmax, Lmax] bool, True = attend; None = attend to all
    out_rows: torch.Tensor  # [Tg] int64 rows of the flat [T] output these queries fill
    out_src: torch.Tensor  # [Tg] int64 rows of the flattened [G*Qmax] padded output
    # (first row, G, Q) when the group's queries are the contiguous rows [first, first + G*Q) with
    # Q queries each: no padding, so queries and outputs are views instead of gathers/scatters.
    dense: tuple[int, int, int] | None = None
    # Decode / verification groups, for the paged-attention kernel: per query (in out_rows' order)
    # its sequence's row of kv_slots and how many of those keys it sees. None for a prefill group.
    q_seq: torch.Tensor | None = None  # [Tg] int64
    q_keys: torch.Tensor | None = None  # [Tg] int64

    def to(self, device: torch.device) -> "AttentionGroup":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return AttentionGroup(move(self.q_index), move(self.kv_slots), move(self.mask), move(self.out_rows),
                              move(self.out_src), self.dense, move(self.q_seq), move(self.q_keys))


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64 flat KV slot each new token is written to
    groups: list[AttentionGroup]
    logits_index: torch.Tensor  # [N] int64 rows of [T] whose logits are returned

    def to(self, device: torch.device) -> "ForwardBatch":
        """The same batch with every tensor on ``device`` (built on the CPU, run where the model is)."""
        return ForwardBatch(self.input_ids.to(device, non_blocking=True), self.positions.to(device, non_blocking=True),
                            self.slot_mapping.to(device, non_blocking=True), [g.to(device) for g in self.groups],
                            self.logits_index.to(device, non_blocking=True))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if rms_norm.applies(x, weight):  # float32 rows on CPU: one native call (torch's costs ~60 us a row)
        return rms_norm.rms_norm(x, weight, eps)
    if x.dtype == torch.float32:  # one fused kernel; same formula as below
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()  # reduced precision: normalise in fp32 like the reference implementation
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention. x [T, N, D]; cos, sin_signed [T, 1, D] where
    sin_signed = (-sin, sin) over the two halves, so that rotate_half(x) * sin becomes
    swap_halves(x) * sin_signed (one flip instead of slice/negate/concatenate)."""
    T, N, D = x.shape
    swapped = x.view(T, N, 2, D // 2).flip(2).view(T, N, D)
    return x * cos + swapped * sin_signed


def _inv_freq(arch: LlamaArch) -> torch.Tensor:
    return rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)


def rope_inv_freq(d: int, theta: float, sc: dict | None) -> torch.Tensor:
    """Rotary inverse frequencies [d/2] for head dim ``d``, base ``theta`` and a ``rope_scaling``
    dict (None, linear or llama3, as ``LlamaArch`` accepts); an EAGLE head's own RoPE uses it too."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if not sc:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        return inv / float(sc["factor"])
    # llama3: smooth interpolation between low and high frequency bands
    factor, low, high = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_len = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, mid, scaled)


class LlamaModel:
    """Weights + forward. Not an nn.Module: inference only, no autograd, no hooks."""

    def __init__(self, arch: LlamaArch, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.arch = arch
        self.dtype = dtype
        self.device = torch.device(device)
        w = {k: v.to(device=self.device, dtype=dtype) for k, v in weights.items()}
        # Projections are ``Linear`` weights built from [in, out] and applied as x @ W (+ add):
        # packed for the skinny-GEMM kernel in float32 on CPU, plain tensors otherwise.
        self.embed = w["model.embed_tokens.weight"]  # [V, hidden], gathered by token id
        head = self.embed if arch.tie_word_embeddings or "lm_head.weight" not in w else w["lm_head.weight"]
        self.lm_head = Linear(head.t())  # [hidden, V]
        self.norm = w["model.norm.weight"]
        self.layers = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            layer = {
                "ln1": w[p + "input_layernorm.weight"],
                "ln2": w[p + "post_attention_layernorm.weight"],
                "wqkv": Linear(torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]).t()),
                "wo": Linear(w[p + "self_attn.o_proj.weight"].t()),
                "wgu": Linear(torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]).t()),
                "wd": Linear(w[p + "mlp.down_proj.weight"].t()),
                "bqkv": (torch.cat([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
                         if arch.qkv_bias else None),
                "qn": w.get(p + "self_attn.q_norm.weight"),
                "kn": w.get(p + "self_attn.k_norm.weight"),
            }
            self.layers.append(layer)
        max_pos = arch.max_position_embeddings
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), _inv_freq(arch))
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, D]
        self.cos = emb.cos().to(device=self.device, dtype=dtype)
        half = emb.shape[-1] // 2
        self.sin_signed = torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), dim=-1).to(device=self.device,
                                                                                             dtype=dtype)

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> "LlamaModel":
        from safetensors.torch import load_file

        arch = LlamaArch.from_hf_config(json.loads((model_dir / "config.json").read_text()))
        weights: dict[str, torch.Tensor] = {}
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{model_dir} has no *.safetensors weights")
        for f in files:
            weights.update(load_file(str(f)))
        missing = [k for k in ("model.embed_tokens.weight", "model.norm.weight") if k not in weights]
        if missing:
            raise ModelLoadError(f"{model_dir}: weights missing {missing}")
        return cls(arch, weights, dtype, device)

    def weight_bytes(self) -> int:
        """Bytes read per decode step: every weight once. The input embedding is only gathered
        (one row per token), so it does not count; the LM head (tied or not) is read whole."""
        tensors = [self.lm_head, self.norm] + [t for layer in self.layers for t in layer.values() if t is not None]
        unique = {t.data_ptr(): t for t in tensors}.values()
        return sum(t.nbytes if isinstance(t, Linear) else t.numel() * t.element_size() for t in unique)

    def new_kv_storage(self, num_slots: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        a = self.arch
        shape = (num_slots, a.num_kv_heads, a.head_dim)
        return ([torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(a.num_layers)],
                [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(a.num_layers)])

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        k_cache: list[torch.Tensor],  # per layer [S, Hkv, D]
        v_cache: list[torch.Tensor],
        num_layers: int | None = None,
    ) -> torch.Tensor:  # [N, V] float32
        return self._run(batch, k_cache, v_cache, num_layers, ())[0]

    @torch.inference_mode()
    def forward_features(
        self,
        batch: ForwardBatch,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [N, V] float32, [T, len(layers) * hidden] float32
        """The full forward plus, for every fed token, the residual stream entering each of
        ``layers`` (HF ``hidden_states[i]`` for i < num_layers: pre-norm), concatenated in the
        order given. No extra target work: the states are read on the way."""
        bad = [i for i in layers if not 0 <= i < self.arch.num_layers]
        if bad or not layers:
            raise ValueError(f"feature layers {list(layers)} must be non-empty and in [0, {self.arch.num_layers})")
        logits, feats = self._run(batch, k_cache, v_cache, None, tuple(layers))
        return logits, feats

    def _run(self, batch: ForwardBatch, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
             num_layers: int | None, capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        a = self.arch
        T = batch.input_ids.shape[0]
        assert batch.positions.shape == (T,) and batch.slot_mapping.shape == (T,), "ragged batch shapes disagree"
        H = a.num_heads
        x = F.embedding(batch.input_ids, self.embed)  # [T, hidden]
        cos2, sin2 = self.cos[batch.positions], self.sin_signed[batch.positions]  # [T, D]
        cos, sin = cos2.unsqueeze(1), sin2.unsqueeze(1)  # [T, 1, D]
        native_rope = not a.qk_norm and rope_cache.applies(x, k_cache[0])
        n_layers = a.num_layers if num_layers is None else num_layers
        captured: dict[int, torch.Tensor] = {}
        for li in range(n_layers):
            if li in capture:
                captured[li] = x.float()  # [T, hidden]
            L = self.layers[li]
            h = _rms_norm(x, L["ln1"], a.rms_norm_eps)
            qkv = L["wqkv"](h, L["bqkv"])  # [T, (H + 2Hkv) * D]
            kc, vc = k_cache[li], v_cache[li]
            if native_rope:  # rotate q and k, write k and v at their slots: one native call
                q = rope_cache.rope_qk_cache(qkv, cos2, sin2, kc, vc, batch.slot_mapping, H)  # [T, H, D]
            else:
                q = self._rope_and_cache(qkv, cos, sin, kc, vc, batch.slot_mapping, L)
            attn = self._attention(q, kc, vc, batch.groups, T)  # [T, H*D]
            x = L["wo"](attn, x)  # x + attn @ Wo in one kernel
            h = _rms_norm(x, L["ln2"], a.rms_norm_eps)
            gu = L["wgu"](h)  # [T, 2I]
            gate, up = gu.chunk(2, dim=-1)
            x = L["wd"](F.silu(gate) * up, x)
        x = x[batch.logits_index]  # [N, hidden]
        x = _rms_norm(x, self.norm, a.rms_norm_eps)
        feats = torch.cat([captured[i] for i in capture], dim=-1) if capture else None  # [T, |capture| * hidden]
        return self.lm_head(x).float(), feats  # [N, V]

    def _rope_and_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor,
                        vc: torch.Tensor, slot_mapping: torch.Tensor, L: dict) -> torch.Tensor:
        """The torch path of ``rope_cache.rope_qk_cache`` (and the one with per-head q/k norms):
        qkv [T, (H + 2Hkv) * D] -> rotated q [T, H, D]; rotated k and v written at their slots."""
        a = self.arch
        T = qkv.shape[0]
        H, Hkv, D = a.num_heads, a.num_kv_heads, a.head_dim
        v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
        if a.qk_norm:
            q = _rope(_rms_norm(qkv[:, : H * D].view(T, H, D), L["qn"], a.rms_norm_eps), cos, sin)
            k = _rope(_rms_norm(qkv[:, H * D : (H + Hkv) * D].view(T, Hkv, D), L["kn"], a.rms_norm_eps), cos, sin)
        else:  # q and k heads rotated together: one set of kernels
            qk = _rope(qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D), cos, sin)  # [T, H+Hkv, D]
            q, k = qk[:, :H], qk[:, H:]
        kc.index_copy_(0, slot_mapping, k)
        vc.index_copy_(0, slot_mapping, v)
        return q

    def _attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                   groups: list[AttentionGroup], T: int) -> torch.Tensor:
        H, D = self.arch.num_heads, self.arch.head_dim
        native = paged_attention.applies(q, kc)  # decode / verification groups straight from the paged cache

        def paged(g: AttentionGroup) -> torch.Tensor:  # [Tg, H*D] in out_rows' order
            return paged_attention.paged_attention(q, kc, vc, g.kv_slots, g.out_rows, g.q_seq, g.q_keys, D ** -0.5)

        if len(groups) == 1 and groups[0].dense == (0, groups[0].kv_slots.shape[0], T // groups[0].kv_slots.shape[0]):
            g = groups[0]  # its queries are the rows 0..T-1 in order: no scatter
            if native and g.q_seq is not None:
                return paged(g)
            _, G, Q = g.dense
            return self._group_attention(q.reshape(G, Q, H, D), kc, vc, g).reshape(T, H * D)
        out = q.new_empty(T, H * D)
        q_ext = None
        for g in groups:
            if native and g.q_seq is not None:
                out[g.out_rows] = paged(g)
                continue
            if q_ext is None:
                q_ext = torch.cat([q, q.new_zeros(1, H, D)])  # [T+1, H, D]; row T is padding
            og = self._group_attention(q_ext[g.q_index], kc, vc, g).reshape(-1, H * D)  # [G*Qmax, H*D]
            out[g.out_rows] = og[g.out_src]
        return out

    @staticmethod
    def _group_attention(qg: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                         g: AttentionGroup) -> torch.Tensor:
        """qg [G, Qmax, H, D] -> [G, Qmax, H, D] attention over each sequence's cached keys."""
        kg = kc[g.kv_slots].transpose(1, 2)  # [G, Hkv, Lmax, D]
        vg = vc[g.kv_slots].transpose(1, 2)
        og = F.scaled_dot_product_attention(qg.transpose(1, 2), kg, vg, attn_mask=g.mask, enable_gqa=True)
        return og.transpose(1, 2)
