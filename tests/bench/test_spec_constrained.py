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
          "outputs_equal_constrained_plain", "per_prompt", "target_passes", "alpha_by_position", "ms_by_phase")


def _args(*argv):
    p = argparse.ArgumentParser()
    bench_spec.add_arguments(p)
    return p.parse_args(["--json", "unused.json", "--constrained", *argv])


def test_options_it_cannot_honour_are_refused():
    assert bench.check_options(_args()) is None  # the default drafter list means the model-free ones here
    assert bench._kinds(_args()) == ["ngram", "suffix", "portfolio"]
    for drafters in ("ngram", "suffix,portfolio", "self", "ngram,draft"):
        assert bench.check_options(_args("--drafters", drafters)) is None, drafters
    assert "drafters ngram, suffix" in bench.check_options(_args("--drafters", "remote"))
    assert "--self-layers" in bench.check_options(_args("--self-layers", "4"))  # no model drafter named
    assert bench.check_options(_args("--drafters", "self", "--self-layers", "4")) is None
    assert "--draft-layers" in bench.check_options(_args("--drafters", "self", "--draft-layers", "4"))
    assert "--hf-auto" in bench.check_options(_args("--hf-auto"))


def test_methods_run_every_drafter_beside_constrained_plain_and_jump_forward():
    names = [m[0] for m in bench._methods(_args())]
    assert names == ["plain", "ngram/k4", "plain+grammar", "jump-forward+grammar", "ngram/k4+grammar",
                     "ngram/auto+grammar", "suffix/auto+grammar", "portfolio/auto+grammar"]
    assert [m[0] for m in bench._methods(_args("--drafters", "self"), {"self": 15})][-1] == "self:15/k3+grammar"
    jump = dict((m[0], m[1]) for m in bench._methods(_args()))["jump-forward+grammar"]
    assert jump.num_draft_tokens == 0  # no drafter: only the tokens the grammar forces


def test_validate_output():
    assert bench.validate_output('{"a": 1}', SCHEMA) is None
    assert bench.validate_output('{"a": "x"}', SCHEMA).startswith("invalid")
    assert bench.validate_output('{"a": 1', SCHEMA).startswith("not JSON")
    row = {"regex": r"[0-9]{2}:[0-9]{2}"}
    assert bench.validate_row_output("21:45", row) is None
    assert "does not match" in bench.validate_row_output("21:45 h", row)
    assert bench.validate_row_output('{"a": 1}', {"json_schema": SCHEMA}) is None


def test_committed_regex_prompts_carry_regexes_the_grammar_engine_accepts(tmp_path):
    from cluster.engine.grammar import check_grammar

    args = _args("--workloads", str(tmp_path), "--prompts-per-segment", "100")  # no regex.jsonl there
    rows, problem = bench.read_constrained_rows(args, "regex")
    assert problem is None and len(rows) >= 6
    kinds = {r["kind"] for r in rows}
    assert {"date", "phone", "enum", "csv"} <= kinds
    for r in rows:
        c = bench.row_constraint(r)
        assert c is not None and r["segment"] == "regex"
        check_grammar(c)  # syntax and features the grammar engine supports
    assert bench.read_constrained_rows(args, "nosuch")[1].startswith("no prompt file")


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


@pytest.mark.model  # the real default model: minutes on the loaded 2-core machine, far less on a quiet one
def test_constrained_bench_json(tmp_path, default_model_dir, capsys):
    out = tmp_path / "c.json"
    p = argparse.ArgumentParser()
    bench_spec.add_arguments(p)
    args = p.parse_args(["--constrained", "--workloads", str(WORKLOADS), "--json", str(out), "--segments", "json",
                         "--drafters", "ngram", "--prompts-per-segment", "1", "--max-tokens", "48", "--threads", "1"])
    assert bench_spec.run(args) == 0
    report = json.loads(out.read_text())
    assert report["config"]["segments"] == ["json"] and report["config"]["constrained"]
    rows = report["segments"]["json"]
    assert set(rows) == {"plain", "ngram/k4", "plain+grammar", "jump-forward+grammar", "ngram/k4+grammar",
                         "ngram/auto+grammar"}
    for name, row in rows.items():
        for f in FIELDS:
            assert f in row, (name, f)
        assert math.isfinite(row["speedup"]) and row["tokens_per_s"] > 0
    for name in ("plain+grammar", "jump-forward+grammar", "ngram/k4+grammar", "ngram/auto+grammar"):
        row = rows[name]
        assert row["valid_outputs"] == 1 and not row["invalid_outputs"], (name, row["invalid_outputs"])
        assert row["outputs_equal_constrained_plain"] == 1, name  # lossless under the grammar
        assert 0 < row["mask_share"] < 1 and row["grammar_ms_by_operation"]["mask"] > 0
    assert rows["plain"]["grammar_us_per_token"] == 0 and rows["plain"]["outputs_equal_constrained_plain"] is None
    spec = rows["ngram/k4+grammar"]
    assert spec["draft_tokens"] > 0 and spec["forced_tokens"] > 0  # the schema's keys are forced
    assert spec["grammar_ms_by_operation"]["forced"] > 0
    assert spec["target_passes"] < rows["plain+grammar"]["target_passes"]  # several tokens per pass
    phases = spec["ms_by_phase"]
    assert set(phases) == {"forward", "draft", "verify", "grammar", "other"} and phases["forward"] > 0
    assert rows["plain+grammar"]["ms_by_phase"] is None  # a plain engine does not time its forwards
    jump = rows["jump-forward+grammar"]
    assert jump["forced_tokens"] == jump["accepted_tokens"] > 0  # every draft token was a forced one
    json.loads(report["constrained_plain_outputs"]["json"]["json-000"])
    for goal in ("constrained_spec_1_5x", "mask_share_5pct", "no_invalid_outputs"):
        assert isinstance(report["summary"]["json"][goal]["pass"], bool)
    assert "ngram/k4+grammar" in capsys.readouterr().out
