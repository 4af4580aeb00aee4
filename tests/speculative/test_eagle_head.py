"""The EAGLE head's files and identity: a saved head loads to the same function and config, the
feature layers follow EAGLE-3 (inputs of layers 2, N/2, N-3), the identity changes with the
target's shapes, a head for another target is refused, and a head trimmed to part of its draft
vocabulary scores the kept tokens exactly as before."""
from __future__ import annotations

import pytest
import torch

from cluster.models.llama import LlamaModel
from cluster.speculative.eagle_head import (
    WEIGHTS_FILE, EagleConfig, EagleHead, EagleTargetMismatch, default_feature_layers, load_head, save_head,
    target_identity, trim_vocabulary,
)
from tests.conftest import make_tiny_model_dir


def test_feature_layers_follow_eagle3():
    assert default_feature_layers(30) == (2, 15, 27)  # SmolLM2-135M: HF hidden_states 2, 15, 27
    assert all(0 <= i < 2 for i in default_feature_layers(2))


def test_saved_head_round_trips_and_is_refused_for_another_target(tmp_path):
    a = LlamaModel.load(make_tiny_model_dir(tmp_path / "a", "llama", num_hidden_layers=4), torch.float32)
    b = LlamaModel.load(make_tiny_model_dir(tmp_path / "b", "llama", num_hidden_layers=4, intermediate_size=96),
                        torch.float32)
    assert target_identity(a) != target_identity(b)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(a, 64))
    head.draft_to_target.copy_(torch.arange(0, 128, 2))
    with torch.no_grad():  # weights are stored in bfloat16: compare against the rounded head
        for t in head.parameters():
            t.copy_(t.to(torch.bfloat16).float())
    save_head(head, tmp_path / "head", extra={"training": {"step": 3}})
    assert (tmp_path / "head" / WEIGHTS_FILE).stat().st_size < 2.2 * sum(t.numel() for t in head.parameters())
    loaded = load_head(tmp_path / "head", a)
    assert loaded.cfg == head.cfg and loaded.cfg.feature_layers == (2, 2, 1)
    assert all(t.dtype == torch.float32 for t in loaded.parameters())
    hidden, emb = torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    mask = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        want = head.to_target_logits(head.draft_logits(head.layer(hidden, emb, torch.arange(3)[None], None, None, mask)[0][0]))
        got = loaded.to_target_logits(loaded.draft_logits(loaded.layer(hidden, emb, torch.arange(3)[None], None, None, mask)[0][0]))
    torch.testing.assert_close(got, want)
    assert torch.isneginf(got[:, 1::2]).all() and torch.isfinite(got[:, 0:128:2]).all()
    with pytest.raises(EagleTargetMismatch, match="trained for another target"):
        load_head(tmp_path / "head", b)


def test_packed_projections_match_the_modules_and_stay_out_of_training(tmp_path):
    """pack_for_inference: with autograd off the skinny-GEMM copies give the modules' outputs (to
    float rounding); with autograd on the modules run (gradients reach the parameters)."""
    a = LlamaModel.load(make_tiny_model_dir(tmp_path / "a", "llama", num_hidden_layers=4), torch.float32)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(a, 64))
    hidden, emb = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    mask = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    pos = torch.arange(3).expand(2, 3)

    def run():
        out, k, v = head.layer(hidden, emb, pos, None, None, mask)
        return head.draft_logits(out), k, v

    with torch.no_grad():
        want = run()
        fused_want = head.fuse(torch.ones(2, 3 * 64))
    head.pack_for_inference()
    assert set(head._packed) == set(EagleHead._PROJECTIONS)
    with torch.inference_mode():
        got = run()
        fused_got = head.fuse(torch.ones(2, 3 * 64))
    for g, w in zip((*got, fused_got), (*want, fused_want)):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # the packed copies are what inference uses: changing the modules changes nothing there
        head.lm_head.weight.zero_()
    with torch.inference_mode():
        torch.testing.assert_close(run()[0], want[0], rtol=1e-4, atol=1e-5)
    logits, _, _ = run()  # autograd on: the modules (zeroed LM head), so training trains the parameters
    assert torch.equal(logits, torch.zeros_like(logits))
    logits.sum().backward()
    assert head.lm_head.weight.grad is not None and head.qkv.weight.grad is not None


def test_a_saved_head_drafts_through_bfloat16_copies_with_the_same_results(tmp_path):
    """A saved head's weights are bfloat16 values: packed for inference, its draft rounds stream
    bfloat16 copies (half the bytes) and give the float32 packing's results bit for bit; a
    catch-up over many positions stays on float32 tiles, with the same results too."""
    from cluster.kernels import skinny_gemm
    from cluster.models.linear import Linear

    a = LlamaModel.load(make_tiny_model_dir(tmp_path / "a", "llama", num_hidden_layers=4), torch.float32)
    torch.manual_seed(0)
    save_head(EagleHead(EagleConfig.for_target(a, 64)), tmp_path / "head")
    head = load_head(tmp_path / "head", a)
    head.pack_for_inference()
    assert all(p.narrow for p in head._packed.values()) == skinny_gemm.available()
    narrow = dict(head._packed)
    wide = {name: Linear(p.weight()) for name, p in narrow.items()}  # float32 tiles only

    def run(packed, q):
        head._packed = packed
        hidden, emb = torch.randn(1, q, 64, generator=torch.Generator().manual_seed(q)), torch.ones(1, q, 64)
        mask = torch.ones(q, q, dtype=torch.bool).tril()[None, None]
        with torch.inference_mode():
            out = head.layer(hidden, emb, torch.arange(q)[None], None, None, mask)[0]
            return head.draft_logits(out), head.fuse(torch.ones(q, 3 * 64))

    for q in (1, 3, 20):  # a draft round, a short and a long catch-up
        for got, want in zip(run(narrow, q), run(wide, q)):
            assert torch.equal(got, want)


def test_a_trimmed_head_scores_its_kept_tokens_as_before_and_only_those(tmp_path):
    model = LlamaModel.load(make_tiny_model_dir(tmp_path / "m", "llama", num_hidden_layers=4), torch.float32)
    torch.manual_seed(1)
    head = EagleHead(EagleConfig.for_target(model, 64))
    head.draft_to_target.copy_(torch.arange(0, 128, 2))
    keep = torch.tensor([40, 2, 100, 6])  # any order: kept sorted, as draft_to_target is
    small = trim_vocabulary(head, keep)
    assert small.cfg.draft_vocab_size == 4 and small.draft_to_target.tolist() == [2, 6, 40, 100]
    assert small.cfg.target == head.cfg.target and small.training == head.training
    hidden, emb = torch.randn(1, 2, 64), torch.randn(1, 2, 64)
    mask = torch.ones(2, 2, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        out = head.layer(hidden, emb, torch.arange(2)[None], None, None, mask)[0][0]
        torch.testing.assert_close(small.layer(hidden, emb, torch.arange(2)[None], None, None, mask)[0][0], out)
        full, part = head.to_target_logits(head.draft_logits(out)), small.to_target_logits(small.draft_logits(out))
    ids = small.draft_to_target
    torch.testing.assert_close(part[:, ids], full[:, ids])  # the kept tokens' scores are unchanged
    assert torch.isneginf(part).sum() == part.numel() - 2 * 4  # every other id: q is zero there
    probs = torch.softmax(part, dim=-1)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))  # renormalised over the kept tokens
    for bad in (torch.tensor([3]), torch.tensor([], dtype=torch.int64), torch.tensor([200])):  # not the head's, none
        with pytest.raises(ValueError, match="subset of the head's draft vocabulary"):
            trim_vocabulary(head, bad)


def test_a_head_with_the_published_variants_saves_as_version_2_and_loads_back(tmp_path):
    """The options read from published heads (own RoPE scaling, normed residual, fc norms, normed
    output, q/k norms) travel in eagle_config.json (version 2); a plain head still writes version 1."""
    import dataclasses
    import json

    from cluster.speculative.eagle_head import CONFIG_FILE, FusionNorm

    a = LlamaModel.load(make_tiny_model_dir(tmp_path / "a", "llama", num_hidden_layers=4), torch.float32)
    plain = EagleConfig.for_target(a, 64)
    save_head(EagleHead(plain), tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / CONFIG_FILE).read_text())["format_version"] == 1
    cfg = dataclasses.replace(plain, rope_scaling={"rope_type": "linear", "factor": 2.0}, norm_before_residual=True,
                              fusion_norm=FusionNorm.PER_FEATURE, norm_output=True, qk_norm=True)
    torch.manual_seed(0)
    head = EagleHead(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2).copy_(p.to(torch.bfloat16).float())
    save_head(head, tmp_path / "variant")
    assert json.loads((tmp_path / "variant" / CONFIG_FILE).read_text())["format_version"] == 2
    loaded = load_head(tmp_path / "variant", a)
    assert loaded.cfg == cfg and loaded.fc_norm.shape == (3, 64) and loaded.q_norm.shape == (16,)
    torch.testing.assert_close(loaded.inv_freq, head.inv_freq)
    feats, emb = torch.randn(1, 3, 192), torch.randn(1, 3, 64)
    mask = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        want, got = (h.draft_logits(h.layer(h.fuse(feats), emb, torch.arange(3)[None], None, None, mask)[0])
                     for h in (head, loaded))
    torch.testing.assert_close(got, want)
