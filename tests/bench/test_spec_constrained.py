"""`bench spec --constrained`: option checks, output validation, the goals, and one run on the
default model at the smallest size (1 json prompt): the JSON has every method's fields, every
constrained output validates, constrained speculation is lossless against constrained plain, and
the grammar path was timed. Speed goals are not asserted (the bench reports them)."""
from __future__ import annotations

import argparse
import json
import math

import pytest

from cluster.bench import spec as bench_spec
from cluster.bench import spec_constrained as bench
from tests.reference import WORKLOADS

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
FIELDS = ("speedup", "tokens_per_s", "ms_per_token", "acceptance_rate", "alpha_without_forced", "forced_tokens",
          "mask_share", "grammar_us_per_token", "grammar_ms_by_operation", "valid_outputs", "invalid_outputs",
          "outputs_equal_constrained_plain", "per_prompt")


def _args(*argv):
    p = argparse.ArgumentParser()
    bench_spec.add_arguments(p)
    return p.parse_args(["--json", "unused.json", "--constrained", *argv])


def test_options_it_cannot_honour_are_refused():
    assert bench.check_options(_args()) is None  # the default drafter list means n-gram here
    assert bench.check_options(_args("--drafters", "ngram")) is None
    assert "n-gram drafter only" in bench.check_options(_args("--drafters", "self"))
    assert "--self-layers" in bench.check_options(_args("--self-layers", "4"))
    assert "--hf-auto" in bench.check_options(_args("--hf-auto"))


def test_validate_output():
    assert bench.validate_output('{"a": 1}', SCHEMA) is None
    assert bench.validate_output('{"a": "x"}', SCHEMA).startswith("invalid")
    assert bench.validate_output('{"a": 1', SCHEMA).startswith("not JSON")


def test_goals_judge_constrained_rows_only():
    def row(constrained, speedup, share, invalid=None):
        return {"constrained": constrained, "speedup": speedup, "mask_share": share, "invalid_outputs": invalid or {}}

    rows = {"plain": row(False, 0.5, None), "plain+grammar": row(True, 1.0, 0.02),
            "ngram/k4+grammar": row(True, 1.6, 0.04), "ngram/auto+grammar": row(True, 1.2, 0.03)}
    g = bench.goals(rows)
    assert g["constrained_spec_1_5x"]["pass"] and g["constrained_spec_1_5x"]["best"] == ("ngram/k4+grammar", 1.6)
    assert g["mask_share_5pct"]["pass"] and g["no_invalid_outputs"]["pass"]
    rows["plain+grammar"] = row(True, 1.0, 0.08, {"json-000": "not JSON"})
    g = bench.goals(rows)
    assert not g["mask_share_5pct"]["pass"] and not g["no_invalid_outputs"]["pass"]


@pytest.mark.model  # the real default model: ~7 min on the loaded 2-core machine, far less on a quiet one
def test_constrained_bench_json(tmp_path, default_model_dir, capsys):
    out = tmp_path / "c.json"
    p = argparse.ArgumentParser()
    bench_spec.add_arguments(p)
    args = p.parse_args(["--constrained", "--workloads", str(WORKLOADS), "--json", str(out),
                         "--prompts-per-segment", "1", "--max-tokens", "48", "--threads", "1"])
    assert bench_spec.run(args) == 0
    report = json.loads(out.read_text())
    assert report["config"]["segments"] == ["json"] and report["config"]["constrained"]
    rows = report["segments"]["json"]
    assert set(rows) == {"plain", "ngram/k4", "plain+grammar", "ngram/k4+grammar", "ngram/auto+grammar"}
    for name, row in rows.items():
        for f in FIELDS:
            assert f in row, (name, f)
        assert math.isfinite(row["speedup"]) and row["tokens_per_s"] > 0
    for name in ("plain+grammar", "ngram/k4+grammar", "ngram/auto+grammar"):
        row = rows[name]
        assert row["valid_outputs"] == 1 and not row["invalid_outputs"], (name, row["invalid_outputs"])
        assert row["outputs_equal_constrained_plain"] == 1, name  # lossless under the grammar
        assert 0 < row["mask_share"] < 1 and row["grammar_ms_by_operation"]["mask"] > 0
    assert rows["plain"]["grammar_us_per_token"] == 0 and rows["plain"]["outputs_equal_constrained_plain"] is None
    spec = rows["ngram/k4+grammar"]
    assert spec["draft_tokens"] > 0 and spec["forced_tokens"] > 0  # the schema's keys are forced
    assert spec["grammar_ms_by_operation"]["forced"] > 0
    json.loads(report["constrained_plain_outputs"]["json"]["json-000"])
    for goal in ("constrained_spec_1_5x", "mask_share_5pct", "no_invalid_outputs"):
        assert isinstance(report["summary"]["json"][goal]["pass"], bool)
    assert "ngram/k4+grammar" in capsys.readouterr().out
