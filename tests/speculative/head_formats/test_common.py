"""Refusals, one clear error each: a head for another target names the field that differs; a
malformed config, a missing, unused or mistyped tensor, a vocabulary map that does not add up —
each says what is wrong. Heads come from our speculators writer, then are edited."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.models.llama import LlamaModel
from cluster.speculative.eagle_head import EagleTargetMismatch
from cluster.speculative.head_formats import load_any_head
from cluster.speculative.head_formats.common import HeadFormatError
from cluster.speculative.head_formats.speculators import write_speculators_head
from tests.conftest import make_tiny_model_dir
from tests.speculative.head_formats.test_eagle3 import random_head


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    def load(name, **kw):
        return LlamaModel.load(make_tiny_model_dir(tmp_path_factory.mktemp(name), "llama", **kw), torch.float32)

    return {"a": load("a", num_hidden_layers=6), "vocab": load("v", num_hidden_layers=6, vocab_size=640),
            "hidden": load("h", num_hidden_layers=6, hidden_size=96),
            "shallow": load("s", num_hidden_layers=3)}


@pytest.fixture
def head_dir(targets, tmp_path):
    out = tmp_path / "head"
    write_speculators_head(random_head(targets["a"], feature_layers=(1, 3, 5)), targets["a"], out,
                           verifier_name_or_path="tiny", dtype=torch.float32)
    return out


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("layer__"):
            cfg["transformer_layer_config"][key[len("layer__"):]] = value
        elif value is None and key in cfg:
            del cfg[key]
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path, drop=(), **put):
    tensors = load_file(str(path / "model.safetensors"))
    for name in drop:
        del tensors[name]
    tensors.update(put)
    save_file(tensors, str(path / "model.safetensors"))


def test_the_unedited_head_loads(targets, head_dir):
    assert load_any_head(head_dir, targets["a"]).cfg.feature_layers == (1, 3, 5)


@pytest.mark.parametrize("other, message", [
    ("vocab", "vocab_size 512 differs from the target's vocab_size 640"),
    ("hidden", "hidden_size 64 differs from the target's hidden_size 96"),
    ("shallow", r"feature layers \[1, 3, 5\] are not inputs of the target's 3 layers"),
])
def test_a_head_for_another_target_is_refused_naming_the_field(targets, head_dir, other, message):
    with pytest.raises(EagleTargetMismatch, match=message):
        load_any_head(head_dir, targets[other])


def test_another_architecture_or_embedding_is_refused(targets, head_dir):
    cfg = json.loads((head_dir / "config.json").read_text())
    edit_config(head_dir, speculators_config={**cfg["speculators_config"],
                                              "verifier": {"name_or_path": "x", "architectures": ["Qwen3ForCausalLM"]}})
    with pytest.raises(EagleTargetMismatch, match=r"verifier architectures \['Qwen3ForCausalLM'\]; this target is LlamaForCausalLM"):
        load_any_head(head_dir, targets["a"])
    edit_config(head_dir, speculators_config=cfg["speculators_config"])
    edit_tensors(head_dir, **{"embed_tokens.weight": torch.randn(512, 64)})
    with pytest.raises(EagleTargetMismatch, match="embed_tokens differs from the target's embedding"):
        load_any_head(head_dir, targets["a"])


@pytest.mark.parametrize("changes, message", [
    ({"draft_vocab_size": None}, "config lacks draft_vocab_size"),
    ({"norm_before_residual": None}, "config lacks norm_before_residual"),
    ({"norm_output": "yes"}, "norm_output must be true or false"),
    ({"norm_before_fc": True, "fc_norm": True}, "mutually exclusive"),
    ({"speculators_model_type": "dflash"}, "only 'eagle3' heads"),
    ({"transformer_layer_config": [1]}, "transformer_layer_config must be an object"),
    ({"layer__model_type": "gpt2"}, "decoder layer model_type 'gpt2'"),
    ({"layer__hidden_size": None}, r"lacks \['hidden_size'\]"),
    ({"eagle_aux_hidden_state_layer_ids": "2,3"}, "must be a list of integers"),
    ({"dtype": "float8"}, "dtype 'float8' is not one of"),
    ({"dtype": "bfloat16"}, "declares torch.bfloat16 but tensors"),
])
def test_a_malformed_config_is_one_clear_error(targets, head_dir, changes, message):
    edit_config(head_dir, **changes)
    with pytest.raises(HeadFormatError, match=message):
        load_any_head(head_dir, targets["a"])


def test_unreadable_configs_and_directories(targets, head_dir, tmp_path):
    (head_dir / "config.json").write_text("{not json")
    with pytest.raises(HeadFormatError, match="not a readable JSON config"):
        load_any_head(head_dir, targets["a"])
    (head_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(HeadFormatError, match="neither a speculators head"):
        load_any_head(head_dir, targets["a"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(HeadFormatError, match="is not an EAGLE head directory"):
        load_any_head(tmp_path / "empty", targets["a"])


@pytest.mark.parametrize("drop, put, message", [
    (["fc.weight"], {}, "missing tensor fc.weight"),
    (["layers.0.hidden_norm.weight"], {}, "missing tensor layers.0.hidden_norm.weight"),
    (["d2t", "t2d"], {}, "no d2t map"),
    ([], {"extra.weight": torch.ones(3)}, r"tensors this head format does not use: \['extra.weight'\]"),
    ([], {"layers.1.mlp.down_proj.weight": torch.ones(3)}, "does not use"),
    ([], {"t2d": torch.ones(512, dtype=torch.bool)}, "t2d does not mark exactly"),
    ([], {"d2t": -torch.arange(64)}, "maps two draft ids to one target id"),
    ([], {"d2t": torch.full((64,), 600, dtype=torch.int64)}, "outside the target vocabulary"),
    ([], {"lm_head.weight": torch.ones(64, 32)}, r"shape \[64, 32\], the config implies \[64, 64\]"),
])
def test_missing_unused_or_wrong_tensors_are_one_clear_error(targets, head_dir, drop, put, message):
    edit_tensors(head_dir, drop, **put)
    with pytest.raises(HeadFormatError, match=message):
        load_any_head(head_dir, targets["a"])


def test_sharded_weights_load_through_their_index_only(targets, head_dir):
    tensors = load_file(str(head_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(head_dir / shard))
    (head_dir / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (head_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    assert load_any_head(head_dir, targets["a"]).cfg.feature_layers == (1, 3, 5)
    index["weight_map"]["fc.weight"] = "model-00002-of-00002.safetensors"  # the index and the shard disagree
    (head_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HeadFormatError, match="fc.weight is not mapped to this shard"):
        load_any_head(head_dir, targets["a"])
