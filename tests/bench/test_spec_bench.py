"""`bench spec` end to end on the default model at the smallest size (1 prompt of 1 segment,
8 tokens, every drafter with fixed and auto K, the HF peers): the JSON has every segment ->
drafter -> field with finite numbers, the goals summary, and the derived draft model is a real
HF directory. Speed goals are not asserted here (that is the bench's job on a quiet machine)."""
from __future__ import annotations

import argparse
import json
import math

from cluster.bench import spec as bench_spec
from tests.reference import WORKLOADS

ROW_FIELDS = ("acceptance_rate", "mean_acceptance_length", "speedup", "predicted_speedup", "hf_speedup",
              "k", "c", "v", "ms_per_token", "hf_ms_per_token")


def test_spec_bench_json_structure(tmp_path, default_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    p = argparse.ArgumentParser()
    bench_spec.add_arguments(p)
    out = tmp_path / "spec.json"
    args = p.parse_args(["--model", "default", "--workloads", str(WORKLOADS), "--json", str(out),
                         "--segments", "summarize", "--prompts-per-segment", "1", "--max-tokens", "8",
                         "--self-layers", "8", "--threads", "2"])
    assert bench_spec.run(args) == 0
    report = json.loads(out.read_text())
    rows = report["segments"]["summarize"]
    assert set(rows) == {"ngram/k4", "ngram/auto", "self:8/k3", "self:8/auto", "draft-l8/k3", "draft-l8/auto"}
    for name, row in rows.items():
        for f in ROW_FIELDS:
            assert f in row, (name, f)
        for f in ("acceptance_rate", "mean_acceptance_length", "speedup", "predicted_speedup", "c", "v", "ms_per_token"):
            assert isinstance(row[f], (int, float)) and math.isfinite(row[f]), (name, f, row[f])
        assert 0.0 <= row["acceptance_rate"] <= 1.0
        assert 1.0 <= row["mean_acceptance_length"] <= 5.0
        assert row["k"] == "auto" or isinstance(row["k"], int)
        assert row["outputs_equal_plain"] == 1, name  # greedy speculation is lossless
        # fixed-K rows have an HF peer of the same method
        if row["k"] != "auto":
            assert math.isfinite(row["hf_speedup"]) and math.isfinite(row["hf_ms_per_token"]), name
    for goal in ("ngram_summarize_edit_2x", "measured_vs_predicted", "faster_than_hf_same_method",
                 "auto_k_never_3pct_slower"):
        assert isinstance(report["summary"][goal]["pass"], bool)
    draft_dir = tmp_path / "cache" / "derived"
    (d,) = list(draft_dir.iterdir())
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 8 and (d / "model.safetensors").is_file() and (d / "tokenizer.json").is_file()
    assert "summarize" in capsys.readouterr().out  # the table was printed
