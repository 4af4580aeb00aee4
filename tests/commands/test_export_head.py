"""`specserve export-head`: the shipped head exported to the speculators format and loaded back is
the same head (config and every tensor) and drafts the same tokens from the default model's
features; the command exports a head in any format we read, and refuses a non-empty --out and a
head for another target, one error line each."""
from __future__ import annotations

import json

import torch

from cluster.cli import main
from cluster.common.config import EngineConfig
from cluster.common.request import SamplingParams
from cluster.models.runner import SeqChunk
from cluster.speculative.eagle import EagleProposer
from cluster.speculative.eagle_head import EagleConfig, EagleHead, load_head, save_head
from cluster.speculative.head_formats import HeadFormat, detect_format
from cluster.speculative.head_formats.speculators import write_speculators_head
from cluster.speculative.proposer import SHIPPED_EAGLE_HEAD
from cluster.speculative.types import ProposeInput
from tests.engine.helpers import greedy_requests
from tests.reference import workload_rows


def test_the_shipped_head_exported_and_loaded_back_is_the_same_head_and_drafts_the_same(default_model, tmp_path):
    """(Greedy output with the exported copy equals Hugging Face: tests/engine/test_speculation.py
    runs its lossless test on it, ``eagle:exported``.)"""
    out = tmp_path / "exported"
    model = default_model.runner.model
    write_speculators_head(load_head(SHIPPED_EAGLE_HEAD, model), model, out, verifier_name_or_path="x")
    assert detect_format(out) is HeadFormat.SPECULATORS
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27] and cfg["draft_vocab_size"] == 8192
    assert cfg["transformer_layer_config"]["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}

    m = default_model.with_fresh_kv(EngineConfig())
    shipped = EagleProposer.from_dir(SHIPPED_EAGLE_HEAD, m.runner)
    m.runner.feature_tap = None  # a second drafter on the same runner: both get the same features
    back = EagleProposer.from_dir(out, m.runner)
    assert back.head.cfg == shipped.head.cfg
    for (name, a), b in zip(shipped.head.state_dict().items(), back.head.state_dict().values()):
        assert torch.equal(a, b), name  # bfloat16 on both sides: exact

    class Both:  # the runner's feature tap, handing each forward's features to both drafters
        feature_layers = shipped.feature_layers

        def record(self, chunks, features):
            shipped.record(chunks, features)
            back.record(chunks, features.clone())

        def forget(self, seq_id):
            shipped.forget(seq_id)
            back.forget(seq_id)

    m.runner.feature_tap = Both()
    rows = workload_rows(per_segment=1)[:3]
    seqs = {r.request_id: r.prompt_token_ids[:40] for r in greedy_requests(default_model.tokenizer, rows, 8)}
    m.runner.forward([SeqChunk(s, ids, 0, 1) for s, ids in seqs.items()])
    inputs = [ProposeInput(s, ids, 4, SamplingParams(max_tokens=8)) for s, ids in seqs.items()]
    want = shipped.propose(inputs).draft_token_ids
    assert [list(d) for d in back.propose(inputs).draft_token_ids] == [list(d) for d in want]
    assert all(len(d) == 4 for d in want)


def test_the_command_exports_a_head_in_any_format_we_read(tiny_llama_dir, tmp_path, capsys):
    from cluster.models.llama import LlamaModel

    target = LlamaModel.load(tiny_llama_dir, torch.float32)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target, 64))
    save_head(head, tmp_path / "ours")
    out = tmp_path / "exported"
    assert main(["export-head", "--model", str(tiny_llama_dir), "--head", f"eagle:{tmp_path / 'ours'}",
                 "--out", str(out), "--dtype", "float32", "--speculative-tokens", "5"]) == 0
    assert f"vllm serve {out}" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tiny_llama_dir)
    again = tmp_path / "again"  # a speculators head exports too (the same files)
    assert main(["export-head", "--model", str(tiny_llama_dir), "--head", str(out), "--out", str(again),
                 "--dtype", "float32", "--speculative-tokens", "5"]) == 0
    assert json.loads((again / "config.json").read_text()) == cfg
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_train_draft_format_speculators_writes_the_runs_head_beside_it(tiny_llama_dir, tmp_path):
    """`train-draft --format speculators`: the finished run's head, also in OUT/speculators."""
    import argparse
    from types import SimpleNamespace

    from cluster.commands.train_draft import write_speculators
    from cluster.models.llama import LlamaModel
    from cluster.speculative.head_formats import load_any_head

    target = LlamaModel.load(tiny_llama_dir, torch.float32)
    torch.manual_seed(1)
    head = EagleHead(EagleConfig.for_target(target, 64))
    save_head(head, tmp_path / "run")
    write_speculators(argparse.Namespace(out=tmp_path / "run", model=str(tiny_llama_dir)),
                      SimpleNamespace(runner=SimpleNamespace(model=target)))
    assert detect_format(tmp_path / "run" / "speculators") is HeadFormat.SPECULATORS
    back = load_any_head(tmp_path / "run" / "speculators", target)
    assert back.cfg == load_head(tmp_path / "run").cfg


def test_refusals_are_one_error_line(tmp_path, tiny_llama_dir, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "x").write_text("")
    assert main(["export-head", "--model", str(tiny_llama_dir), "--head", "eagle", "--out", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["export-head", "--model", str(tiny_llama_dir), "--head", "eagle", "--out", str(tmp_path / "o")]) == 2
    assert "trained for another target" in capsys.readouterr().err
