"""`specserve bench confidence`: the step model counts what a floor drafts and commits (hand-made
chains), the report's calibration and α by position, refusals before any model loads, and one
end-to-end run with the shipped head on the default model."""
from __future__ import annotations

import json
import math

import pytest

from cluster.bench.confidence import segment_report, step_model
from cluster.cli import main as cli_main
from tests.reference import WORKLOADS

# two anchors: drafts 1-3 right with probabilities .9 .5 .9; draft 1 wrong (p .3) then "right" ones
ANCHORS = [[(0.9, True), (0.5, True), (0.9, True)], [(0.3, False), (0.9, True), (0.9, True)]]


def test_step_model_counts_drafts_and_commits_under_a_floor():
    c, v = 0.1, 0.05
    k1 = step_model(ANCHORS, 1, 0.0, c, v)
    assert k1["tokens_per_step"] == 1.5 and k1["drafts_per_step"] == 1  # (2 + 1) / 2
    assert math.isclose(k1["tokens_per_cost"], 3 / (2 * 1.15), rel_tol=1e-3)
    k3 = step_model(ANCHORS, 3, 0.0, c, v)
    assert k3["tokens_per_step"] == 2.5 and k3["drafts_per_step"] == 3  # a rejected first draft commits 1
    # running products: anchor 1 .9, .45, .405; anchor 2 .3 — a draft stops after the token that crosses
    f = step_model(ANCHORS, 3, 0.42, c, v)  # anchor 1: all 3 drafted (.405 crosses at the last); anchor 2: 1
    assert f["drafts_per_step"] == 2 and f["tokens_per_step"] == 2.5
    f = step_model(ANCHORS, 3, 0.5, c, v)  # .45 < .5: anchor 1 stops after draft 2
    assert f["drafts_per_step"] == 1.5 and f["tokens_per_step"] == 2.0
    assert math.isclose(f["tokens_per_cost"], 4 / (2 + 3 * (c + v)), rel_tol=1e-3)


def test_segment_report_calibration_and_alpha():
    rep = segment_report(ANCHORS, 3, [0.42, 0.5], 0.1, 0.05)
    bins = {tuple(b["p"]): (b["anchors"], b["accepted"]) for b in rep["calibration"]}
    assert bins[(0.9, 1.0)] == (1, 1.0) and bins[(0.3, 0.4)] == (1, 0.0)
    assert sum(n for n, _ in bins.values()) == rep["anchors"] == 2
    assert rep["alpha_by_position"] == [0.5, 1.0, 1.0]  # position 2 asked only where draft 1 was right
    assert rep["best_fixed_k"] in (1, 2, 3) and rep["best_floor"] in (0.42, 0.5)
    assert rep["best_floor_over_best_fixed_k"] > 0


@pytest.mark.parametrize("args,needle", [(["--floors", "0,0.2"], "--floors must be"),
                                         (["--floors", "x"], "--floors must be"),
                                         (["--steps", "0"], "must be >= 1"),
                                         (["--c", "1.5"], "--c and --v"),
                                         (["--head", "ngram"], "--head must be eagle")])
def test_bad_arguments_are_refused(tmp_path, capsys, args, needle):
    assert cli_main(["bench", "confidence", "--json", str(tmp_path / "c.json"), *args]) == 2
    assert needle in capsys.readouterr().err and not (tmp_path / "c.json").exists()


def test_the_shipped_head_on_the_default_model(tmp_path, default_model, capsys):
    out = tmp_path / "c.json"
    assert cli_main(["bench", "confidence", "--workloads", str(WORKLOADS), "--segments", "json",
                     "--prompts-per-segment", "1", "--max-tokens", "24", "--steps", "3", "--floors", "0.2",
                     "--json", str(out), "--threads", "2"]) == 0
    rep = json.loads(out.read_text())["segments"]["json"]
    assert rep["anchors"] >= 20 and len(rep["alpha_by_position"]) == 3
    assert set(rep["fixed_k"]) == {"1", "2", "3"} and set(rep["floors"]) == {"0.2"}
    assert 0.0 < rep["alpha_by_position"][0] <= 1.0  # the shipped head drafts json well (~0.6 at position 1)
    assert "tokens per unit cost" in capsys.readouterr().out
