"""`specserve bench confidence`: the step model steps through an output as a greedy engine does and
counts what a floor drafts and commits (hand-made chains), the report's calibration and α by
position (at every anchor and at the engine's steps), refusals before any model loads, and one
end-to-end run with the shipped head on the default model."""
from __future__ import annotations

import json
import math

import pytest

from cluster.bench.confidence import SampleChains, first_draft_top, segment_report, step_model
from cluster.cli import main as cli_main
from tests.reference import WORKLOADS

# one output, anchors 0..4 (draft k: probability, right); anchor 5 has no draft inside the output
SAMPLE = SampleChains(0, [[(0.9, True), (0.5, True), (0.9, True)], [(0.3, False), (0.9, True), (0.9, True)],
                          [(0.8, True), (0.8, False), (0.9, True)], [(0.3, False), (0.9, True)], [(0.6, True)], []],
                      first_rank=[0, 1, 0, 1, 0, 4])  # the target's token: the head's 2nd choice at 1 and 3


def test_step_model_steps_through_the_output_as_the_engine_does():
    c, v = 0.1, 0.05
    k1 = step_model([SAMPLE], 1, 0.0, c, v)  # steps at 0, 2, 4: each accepts its one draft
    assert (k1["steps"], k1["tokens_per_step"], k1["drafts_per_step"]) == (3, 2.0, 1.0)
    assert k1["alpha_by_position"] == [1.0] and math.isclose(k1["tokens_per_cost"], 6 / (3 * 1.15), rel_tol=1e-3)
    k2 = step_model([SAMPLE], 2, 0.0, c, v)  # 0 (2 accepted) -> 3 (first rejected) -> 4 (1 of 1)
    assert (k2["steps"], k2["tokens_per_step"], k2["drafts_per_step"]) == (3, 2.0, round(5 / 3, 4))
    assert k2["alpha_by_position"] == [round(2 / 3, 4), 1.0]  # position 2 asked only where 1 was right
    k3 = step_model([SAMPLE], 3, 0.0, c, v)  # 0 (3 accepted) -> 4 (its chain holds 1 draft)
    assert (k3["steps"], k3["tokens_per_step"], k3["drafts_per_step"]) == (2, 3.0, 2.0)
    # running products at 0: .9, .45 — a draft stops after the token that crosses the floor: 0 drafts
    # 2 (both right) -> 3: .3 crosses at once (rejected) -> 4: 1 of 1
    f = step_model([SAMPLE], 3, 0.5, c, v)
    assert (f["steps"], f["drafts_per_step"], f["tokens_per_step"]) == (3, round(4 / 3, 4), 2.0)
    assert math.isclose(f["tokens_per_cost"], 6 / (3 + 4 * (c + v)), rel_tol=1e-3)
    assert step_model([SampleChains(3, SAMPLE.by_anchor)], 1, 0.0, c, v)["steps"] == 2  # a later first step


def test_first_draft_top_choices_at_the_engine_steps():
    assert first_draft_top([SAMPLE], 2) == [round(2 / 3, 4), 1.0, 1.0, 1.0]  # steps 0, 3, 4: ranks 0, 1, 0
    assert first_draft_top([SAMPLE], 3) == [1.0, 1.0, 1.0, 1.0]  # steps 0, 4
    assert first_draft_top([SampleChains(0, SAMPLE.by_anchor)], 3) == [None] * 4  # no ranks recorded


def test_segment_report_calibration_and_alpha():
    rep = segment_report([SAMPLE], 3, [0.42, 0.5], 0.1, 0.05)
    bins = {tuple(b["p"]): (b["anchors"], b["accepted"]) for b in rep["calibration"]}
    assert bins[(0.9, 1.0)] == (1, 1.0) and bins[(0.3, 0.4)] == (2, 0.0) and bins[(0.6, 0.7)] == (1, 1.0)
    assert sum(n for n, _ in bins.values()) == rep["anchors"] == 5
    assert rep["alpha_by_position"] == [0.6, 0.5, 1.0]  # at every anchor; position 2 where draft 1 was right
    assert rep["step_alpha_by_position"] == [1.0, 1.0, 1.0]  # at the K = 3 engine's two steps
    assert rep["step_first_draft_top"] == [1.0, 1.0, 1.0, 1.0]
    assert rep["best_fixed_k"] == 3 and rep["best_floor"] in (0.42, 0.5)
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
    assert 0 < rep["fixed_k"]["3"]["steps"] <= rep["anchors"] and len(rep["step_alpha_by_position"]) == 3
    top = rep["step_first_draft_top"]  # the best choice is the chain's first draft; more choices catch more
    assert top[0] == rep["step_alpha_by_position"][0] and top == sorted(top) and len(top) == 4
    assert "tokens per unit cost" in capsys.readouterr().out
