"""The speculators format against the speculators package's own code: heads the package writes
(each option our head has) load into our ``EagleHead`` and give the package's draft logits for the
same target features and tokens, at every draft step (fp32); the engine's drafter drafts the
package's greedy tokens; a head we export loads in the package's config and model classes with
the same logits, and loads back into ours unchanged."""
from __future__ import annotations

import json

import pytest
import torch

from cluster.common.request import SamplingParams
from cluster.models.llama import LlamaModel
from cluster.models.runner import ModelRunner, SeqChunk
from cluster.speculative.eagle import EagleProposer
from cluster.speculative.eagle_head import EagleConfig, EagleHead, FusionNorm
from cluster.speculative.head_formats import HeadFormat, detect_format, load_any_head
from cluster.speculative.head_formats.speculators import write_speculators_head
from cluster.speculative.types import ProposeInput
from tests.conftest import make_tiny_model_dir
from tests.speculative.head_formats.oracle import (
    load_reference, our_logits, reference_drafts, reference_logits, speculators, speculators_head,
)

STEPS = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Llama target (5 layers, vocabulary 512) and its directory (the heads' verifier)."""
    speculators()
    path = make_tiny_model_dir(tmp_path_factory.mktemp("spec-target"), "llama", num_hidden_layers=5)
    return path, LlamaModel.load(path, torch.float32)


def _features(target_model, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 3 * target_model.arch.hidden_size, generator=g),
            torch.randint(0, target_model.arch.vocab_size, (n,), generator=g))


VARIANTS = {  # the options our head implements, as the package spells them
    "plain": dict(layer_type="llama", norm_before_residual=False),
    "normed": dict(layer_type="llama", norm_before_residual=True, norm_before_fc=True, norm_output=True),
    "qwen3-fc-norm": dict(layer_type="qwen3", norm_before_residual=True, fc_norm=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_our_draft_logits_equal_the_packages(target, tmp_path, variant):
    path, llama = target
    head_dir = speculators_head(tmp_path / "head", path, llama, **VARIANTS[variant])
    assert detect_format(head_dir) is HeadFormat.SPECULATORS
    ours = load_any_head(head_dir, llama)
    flags = VARIANTS[variant]
    assert ours.cfg.feature_layers == (1, 2, 4) and ours.cfg.rope_theta == 50000.0
    assert ours.cfg.norm_before_residual == flags["norm_before_residual"]
    assert ours.cfg.norm_output == flags.get("norm_output", False) and ours.cfg.qk_norm == (variant == "qwen3-fc-norm")
    assert ours.cfg.fusion_norm is (FusionNorm.CONCAT if flags.get("norm_before_fc") else
                                    FusionNorm.PER_FEATURE if flags.get("fc_norm") else FusionNorm.NONE)
    feats, tokens = _features(llama, 12, seed=1)
    want = reference_logits(load_reference(head_dir), feats, tokens, STEPS)
    got = our_logits(ours, llama.embed, feats, tokens, STEPS)
    for k, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(torch.isfinite(g), torch.isfinite(w)), k  # the same draft vocabulary
        finite = torch.isfinite(w)
        torch.testing.assert_close(g[finite], w[finite], rtol=1e-4, atol=2e-5, msg=f"step {k}")
        assert torch.equal(g.argmax(-1), w.argmax(-1)), k


def test_the_engines_drafts_are_the_packages_greedy_chain(target, tmp_path):
    """The drafter in the engine (features from the target's own forward, catch-up, draft
    rounds) drafts exactly the tokens the package's forward gives from the same features."""
    path, llama = target
    head_dir = speculators_head(tmp_path / "head", path, llama, seed=3, **VARIANTS["normed"])
    runner = ModelRunner(llama, 16, 16)
    prop = EagleProposer.from_dir(head_dir, runner)
    raw: dict[str, torch.Tensor] = {}
    record = prop.record

    def keep(chunks, features):  # the target features the runner hands the drafter
        row = 0
        for c in chunks:
            raw[c.seq_id] = features[row : row + len(c.token_ids)].clone()
            row += len(c.token_ids)
        record(chunks, features)

    prop.record = keep
    g = torch.Generator().manual_seed(7)
    seqs = {"a": torch.randint(0, 512, (14,), generator=g).tolist(), "b": torch.randint(0, 512, (6,), generator=g).tolist()}
    runner.forward([SeqChunk(s, ids, 0, 1) for s, ids in seqs.items()])
    got = prop.propose([ProposeInput(s, ids, 3, SamplingParams(max_tokens=8)) for s, ids in seqs.items()])
    reference = load_reference(head_dir)
    for (s, ids), drafts in zip(seqs.items(), got.draft_token_ids):
        n = len(ids)
        want = reference_drafts(reference, raw[s][: n - 1], ids[1:], 3)  # anchors 0..n-2, tokens 1..n-1
        assert list(drafts) == want, s


def test_an_exported_head_loads_in_the_package_and_back_in_ours(target, tmp_path):
    path, llama = target
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(llama, 80, feature_layers=(1, 2, 4)))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2).copy_(p.to(torch.bfloat16).float())  # bfloat16 values: exported in bfloat16 exactly
        head.draft_to_target.copy_(torch.randperm(llama.arch.vocab_size)[:80].sort().values)
    exported = tmp_path / "exported"  # bfloat16, as it ships: loads back into ours unchanged
    write_speculators_head(head, llama, exported, verifier_name_or_path=str(path))
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["dtype"] == "bfloat16"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4] and cfg["draft_vocab_size"] == 80
    back = load_any_head(exported, llama)
    assert back.cfg == head.cfg
    for (name, a), b in zip(head.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name

    wide = tmp_path / "exported-fp32"  # float32: the package computes with the target's exact embedding, as we do
    write_speculators_head(head, llama, wide, verifier_name_or_path=str(path), dtype=torch.float32)
    reference = load_reference(wide)  # the package's own config and model classes
    assert reference.config.draft_vocab_size == 80 and reference.config.norm_before_residual is False
    assert reference.config.eagle_aux_hidden_state_layer_ids == [1, 2, 4]
    assert torch.equal(reference.embed_tokens.weight, llama.embed)
    feats, tokens = _features(llama, 10, seed=2)
    want = reference_logits(reference, feats, tokens, STEPS)
    got = our_logits(head, llama.embed, feats, tokens, STEPS)
    for k, (g, w) in enumerate(zip(got, want)):
        finite = torch.isfinite(w)
        assert torch.equal(finite, torch.isfinite(g))
        torch.testing.assert_close(g[finite], w[finite], rtol=1e-4, atol=2e-5, msg=f"step {k}")
