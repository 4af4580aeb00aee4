"""The original EAGLE-3 / SpecForge layout: a head written in it (``midlayer.*``, a Llama config
with ``draft_vocab_size``) loads into the same head as the speculators-format copy of it (which
tests/speculative/head_formats/test_speculators.py checks against the speculators package);
SpecForge's layer ids count layer outputs; a tied LM head is the embedding's draft rows; options
our head lacks are refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.models.llama import LlamaModel
from cluster.speculative.eagle_head import EagleConfig, EagleHead, FusionNorm
from cluster.speculative.head_formats import HeadFormat, detect_format, load_any_head
from cluster.speculative.head_formats.common import HeadFormatError
from cluster.speculative.head_formats.speculators import write_speculators_head
from tests.conftest import make_tiny_model_dir


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> LlamaModel:
    return LlamaModel.load(make_tiny_model_dir(tmp_path_factory.mktemp("e3-target"), "llama", num_hidden_layers=6),
                           torch.float32)


def random_head(target: LlamaModel, draft_vocab: int = 64, seed: int = 0, **variant) -> EagleHead:
    torch.manual_seed(seed)
    cfg = EagleConfig.for_target(target, draft_vocab)
    head = EagleHead(EagleConfig(**{**{f: getattr(cfg, f) for f in cfg.__slots__}, **variant}))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
        head.draft_to_target.copy_(torch.randperm(target.arch.vocab_size)[:draft_vocab].sort().values)
    return head


def as_eagle3(head: EagleHead, target: LlamaModel, out: Path, specforge: bool = False) -> Path:
    """The head in the original layout, made from its speculators-format copy by the renaming the
    speculators converter undoes (``layers.0.`` -> ``midlayer.``), with the original's config."""
    write_speculators_head(head, target, out / "spec", dtype=torch.float32)
    tensors = load_file(str(out / "spec" / "model.safetensors"))
    layer = json.loads((out / "spec" / "config.json").read_text())["transformer_layer_config"]
    renamed = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}
    if not specforge:
        del renamed["embed_tokens.weight"]  # the original leaves the frozen embedding out
    c = head.cfg
    cfg = {**{k: v for k, v in layer.items() if k not in ("rope_parameters", "dtype")},
           "rope_theta": c.rope_theta, "torch_dtype": "float32", "draft_vocab_size": c.draft_vocab_size,
           "architectures": ["LlamaForCausalLMEagle3" if specforge else "LlamaForCausalLM"]}
    if specforge:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in c.feature_layers]}  # outputs of
        if c.fusion_norm is FusionNorm.PER_FEATURE:
            cfg["fc_norm"] = True
    path = out / ("specforge" if specforge else "eagle3")
    path.mkdir()
    save_file(renamed, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def same_head(a: EagleHead, b: EagleHead) -> None:
    assert a.cfg == b.cfg
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_the_original_layout_loads_the_head_its_speculators_copy_does(target, tmp_path):
    head = random_head(target)  # feature layers 2, 3, 3 for six layers: the original's default [2, N/2, N-3]
    path = as_eagle3(head, target, tmp_path)
    assert detect_format(path) is HeadFormat.EAGLE3
    loaded = load_any_head(path, target)
    same_head(loaded, load_any_head(tmp_path / "spec", target))
    same_head(loaded, head)
    assert loaded.cfg.feature_layers == (2, 3, 3) and not loaded.cfg.norm_before_residual


def test_specforge_layer_ids_count_layer_outputs_and_its_embedding_is_checked(target, tmp_path):
    head = random_head(target, feature_layers=(1, 3, 5), fusion_norm=FusionNorm.PER_FEATURE)
    path = as_eagle3(head, target, tmp_path, specforge=True)
    assert json.loads((path / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    loaded = load_any_head(path, target)
    same_head(loaded, head)  # ids 0, 2, 4 (outputs) are the inputs of layers 1, 3, 5


def test_a_tied_lm_head_is_the_embeddings_draft_rows(target, tmp_path):
    head = random_head(target)
    path = as_eagle3(head, target, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    loaded = load_any_head(path, target)
    assert torch.equal(loaded.lm_head.weight, target.embed[head.draft_to_target])
    (path / "config.json").write_text(json.dumps(cfg))  # not tied, and no LM head: refused
    with pytest.raises(HeadFormatError, match="missing tensor lm_head.weight"):
        load_any_head(path, target)


@pytest.mark.parametrize("edit, message", [
    ({"norm_output": False}, "norm_output false"),
    ({"bias": True}, "biased fc"),
    ({"num_hidden_layers": 2}, "only one-layer"),
    ({"layer_types": ["sliding_attention"]}, "sliding-window"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"draft_vocab_size": "64"}, "draft_vocab_size must be an integer"),
])
def test_options_our_head_lacks_are_refused(target, tmp_path, edit, message):
    path = as_eagle3(random_head(target), target, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(HeadFormatError, match=message):
        load_any_head(path, target)
