"""The field's own code as the oracle: tiny random EAGLE-3 heads made and run by the
``speculators`` package (0.9.0, a test dependency: ``make setup`` installs it without its
dependencies), and the same computation through our ``EagleHead``.

``speculators_head`` writes a genuine speculators checkpoint (the package's config and model
classes, every parameter from a seeded generator, the embedding copied from the target as trained
heads save it, the vocabulary map set through ``load_vocab_mappings``, ``save_pretrained``).
``reference_logits`` loads a directory with ``Eagle3DraftModel.from_pretrained`` (eager attention
on the CPU) and returns the per-step draft logits of its training-time forward (teacher-forced
chains: step k at position i is the k-th draft after anchor i); ``our_logits`` computes the same
with our head; ``reference_drafts`` runs the package's forward once per draft token to get its
greedy chain from one anchor.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.speculative.eagle_head import EagleHead


def speculators():
    return pytest.importorskip("speculators", reason="the speculators package (make setup) is the oracle")


def speculators_head(out: Path, target_dir: Path, target, *, layer_type: str = "llama", draft_vocab: int = 96,
                     layer_ids=(1, 2, 4), seed: int = 0, **flags) -> Path:
    """A random speculators-format head for ``target`` (a loaded ``LlamaModel`` of ``target_dir``)."""
    speculators()
    import transformers
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    a = target.arch
    layer_cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[layer_type]
    layer = layer_cls(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                      max_position_embeddings=512, rope_theta=50000.0)
    layer._attn_implementation = "eager"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab, eagle_aux_hidden_state_layer_ids=list(layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(target_dir), architectures=["LlamaForCausalLM"])),
        **flags)
    model = Eagle3DraftModel(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name or "fc_norm" in name or "input_norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))  # norms around 1, not 1: a swapped one shows
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
        model.embed_tokens.weight.copy_(target.embed.float())
    ids = torch.randperm(a.vocab_size, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(a.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    model.load_vocab_mappings(t2d, ids - torch.arange(draft_vocab))
    model.save_pretrained(str(out))
    return out


def load_reference(head_dir: Path):
    speculators()
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    cfg = Eagle3SpeculatorConfig.from_pretrained(str(head_dir))
    cfg.transformer_layer_config._attn_implementation = "eager"  # float masks on the CPU, no flex attention
    return Eagle3DraftModel.from_pretrained(str(head_dir), config=cfg).eval()


def reference_logits(model, feats: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """feats [L, n*H] target features of anchors 0..L-1, tokens [L] (token t + 1 of anchor t):
    per step k, the draft logits [L, V] in the target vocabulary (-inf outside the draft one)."""
    captured = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
    try:
        with torch.no_grad():
            model(hidden_states=feats[None].float(), input_ids=tokens[None], document_ids=torch.zeros_like(tokens)[None],
                  ttt_steps=steps)
    finally:
        hook.remove()
    ids = torch.arange(model.draft_vocab_size) + model.d2t if model.d2t is not None else torch.arange(model.draft_vocab_size)
    out = []
    for logits in captured:  # [1, L, Vd]
        full = torch.full((logits.shape[1], model.verifier_vocab_size), float("-inf"))
        full[:, ids] = logits[0].float()
        out.append(full)
    return out


def reference_drafts(model, feats: torch.Tensor, tokens: list[int], k: int) -> list[int]:
    """The package's greedy chain from the last anchor of feats [L, n*H] / tokens [L]: draft j is
    step j - 1 of a forward whose teacher tokens after the anchor are drafts 1..j-1 (rows after
    the anchor see only their own diagonal, so their features do not matter: zeros)."""
    L, drafts = feats.shape[0], []
    for j in range(1, k + 1):
        f = torch.cat([feats, feats.new_zeros(j - 1, feats.shape[1])])
        t = torch.tensor(tokens + drafts)
        logits = reference_logits(model, f, t, j)[j - 1]  # [L + j - 1, V]
        drafts.append(int(logits[L - 1].argmax()))
    return drafts


def our_logits(head: EagleHead, embed: torch.Tensor, feats: torch.Tensor, tokens: torch.Tensor,
               steps: int) -> list[torch.Tensor]:
    """The same chains through our head: step 0 over all anchors (causal), step k with the
    tokens shifted by k, attending to step 0's keys up to its anchor and to its own earlier steps."""
    L = feats.shape[0]
    hidden = head.fuse(feats.float())[None]  # [1, L, H]
    positions = torch.arange(1, L + 1)[None]  # the pair of anchor t sits at position t + 1
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    diag = torch.eye(L, dtype=torch.bool)
    keys = values = None
    out = []
    with torch.no_grad():
        for k in range(steps):
            shifted = torch.cat([tokens[k:], tokens.new_zeros(k)])
            emb = embed[shifted][None].float()  # [1, L, H]
            mask = torch.cat([causal] + [diag] * k, dim=1)[None, None]  # [1, 1, L, (k+1) L]
            hidden, nk, nv = head.layer(hidden, emb, positions + k, keys, values, mask)
            keys = nk if keys is None else torch.cat([keys, nk], dim=2)
            values = nv if values is None else torch.cat([values, nv], dim=2)
            out.append(head.to_target_logits(head.draft_logits(hidden[0])))  # [L, V]
    return out
