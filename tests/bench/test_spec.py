"""`bench spec` end to end on the default model at the smallest size (1 prompt of 1 segment,
8 tokens, every drafter with fixed and auto K, the HF peers): the JSON has every segment ->
drafter -> field with finite numbers, the goals summary, and the derived draft model is a real
HF directory. Speed goals are not asserted here (that is the bench's job on a quiet machine)."""
from __future__ import annotations

import argparse
import json
import math

import pytest

from cluster.bench import spec as bench_spec
from tests.reference import WORKLOADS

ROW_FIELDS = ("acceptance_rate", "mean_acceptance_length", "speedup", "predicted_speedup", "hf_speedup",
              "k", "c", "v", "host_ms_per_step", "ms_per_token", "hf_ms_per_token")


def _bench(argv: list[str]) -> int:
    """``specserve bench spec`` with these arguments, in process -> its exit code."""
    p = argparse.ArgumentParser()
    bench_spec.add_arguments(p)
    return bench_spec.run(p.parse_args(argv))


def test_spec_bench_json_structure(tmp_path, default_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "spec.json"
    assert _bench(["--model", "default", "--workloads", str(WORKLOADS), "--json", str(out),
                  "--segments", "summarize", "--prompts-per-segment", "1", "--max-tokens", "8",
                  "--self-layers", "8", "--threads", "2"]) == 0
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
        # the host's share of a step: more than nothing, less than the whole step
        assert 0.0 < row["host_ms_per_step"] < row["ms_per_token"] * row["mean_acceptance_length"], (name, row)
        # wall - forward by part: planning K runs every step, sampling / verifying too; the rest
        # of the engine is never negative (the parts are inside the step's wall)
        parts = row["step_ms_parts"]
        assert set(parts) == {"plan", "drafter", "sampling", "other"}, (name, parts)
        assert parts["plan"] > 0.0 and parts["sampling"] > 0.0 and parts["drafter"] >= 0.0, (name, parts)
        assert parts["other"] > 0.0, (name, parts)
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


def test_step_ms_parts_are_means_that_add_up_to_the_steps_outside_the_forward():
    a = bench_spec.Run(1.0, 4, [1, 2, 3, 4], step_parts=[(0.001, 0.002, 0.0005, 0.0015), (0.003, 0.0, 0.0005, 0.0005)])
    b = bench_spec.Run(1.0, 2, [1, 2], step_parts=[(0.002, 0.004, 0.002, 0.001)])
    parts = bench_spec.step_ms_parts([a, b])
    assert parts == {"plan": 2.0, "drafter": 2.0, "sampling": 1.0, "other": 1.0}
    assert bench_spec.step_ms_parts([bench_spec.Run(1.0, 0, [])]) is None  # no decode step: no parts


def test_prediction_uses_per_position_alpha():
    """A known per-position α: 0.5, K = 3, c = 0.1, v = 1.2 -> E = (1 - 0.5^4) / 0.5 = 1.875 tokens
    per verification step at 0.3 + 1.2 plain-step times: 1.25x. Plain steps of the spec run
    (nothing drafted) count 1 token per plain-step time; steps of other K by their own E."""
    assert bench_spec.predicted_speedup(0.5, [0, 0, 0, 10], 0.1, 1.2) == pytest.approx(1.25)
    assert bench_spec.predicted_speedup(0.5, [0, 0, 0, 10], 0.1, 1.2, plain_steps=15) == pytest.approx(
        (18.75 + 15) / (15 + 15))
    assert bench_spec.predicted_speedup(0.5, [0, 4, 0, 2], 0.0, 1.0) == pytest.approx((4 * 1.5 + 2 * 1.875) / 6)
    assert bench_spec.predicted_speedup(0.9, [], 0.1, 1.2) == 1.0  # nothing ran
    # the speculative engine's own plain steps at 1.1 plain-step times, 20 plain-step times of prefill
    assert bench_spec.predicted_speedup(0.5, [0, 0, 0, 10], 0.1, 1.2, plain_steps=15, plain_cost=1.1,
                                        prefill=20) == pytest.approx((20 + 18.75 + 15) / (20 + 15 * 1.1 + 15))


def test_the_prediction_is_of_the_pooled_speedup_with_mean_costs_and_the_prefills():
    """Half the decode time with speculation makes the prompts' forwards weigh twice as much: a
    prediction without them overstated the end-to-end speedup by 13-18% on long prompts. Two
    prompts, each 10 plain-step times of prefill and 40 decode tokens: the row predicts the pooled
    speedup from mean step costs (a skewed verification step counts at its mean) and matches it
    when the runs follow the model exactly."""
    t = 0.010
    plain = [bench_spec.Run(0.1 + 40 * t, 41, [], decode_steps=[t] * 40, prefill_s=0.1) for _ in range(2)]
    spec = []
    for _ in range(2):  # 20 verification steps at K = 1, every draft accepted: 2 tokens each
        r = bench_spec.Run(0.0, 41, [], verify_steps=[1.0 * t] * 10 + [1.4 * t] * 10, prefill_s=0.1)
        r.round_costs = [0.0] * 20
        r.steps_by_num_draft_tokens = [0, 20]
        r.drafts = r.draft_tokens = r.accepted_tokens = 20
        r.accepted_per_position, r.drafted_per_position = [20], [20]
        r.wall_s = r.prefill_s + sum(r.verify_steps)
        spec.append(r)
    row = bench_spec.summarize_row(plain, spec, None, None, 1)
    pooled = (2 * (0.1 + 0.4)) / (2 * (0.1 + 0.24))
    assert row["pooled_speedup"] == pytest.approx(pooled, rel=1e-3)
    assert row["predicted_speedup"] == pytest.approx(pooled, rel=1e-3)  # (10 + 40) / (10 + 20 x 1.2)
    assert row["v"] == pytest.approx(1.2, abs=0.21)  # the reported v stays the median step
    no_prefill = bench_spec.predicted_speedup(1.0, [0, 40], 0.0, 1.2)
    assert no_prefill == pytest.approx(80 / 48) and no_prefill > 1.1 * row["pooled_speedup"]


def test_summarize_row_predicts_from_alpha_not_acceptance_rate():
    """Runs whose steps follow a per-position α of 0.7 at K = 4: the row's α recovers it, the
    prediction is E(0.7, 4) / v, and accepted/drafted (reported as acceptance_rate, biased low)
    does not enter it — so "measured >= 0.9 x predicted" can fail when the cost model is wrong."""
    import random

    rng = random.Random(11)
    spec = bench_spec.Run(1.0, 0, [], verify_steps=[0.011] * 2000)
    spec.steps_by_num_draft_tokens = [0, 0, 0, 0, 2000]
    for _ in range(2000):
        a = 0
        while a < 4 and rng.random() < 0.7:
            a += 1
        spec.drafts, spec.draft_tokens, spec.accepted_tokens = spec.drafts + 1, spec.draft_tokens + 4, spec.accepted_tokens + a
        spec.rejections += a < 4
    plain = bench_spec.Run(2.0, 0, [], decode_steps=[0.010] * 50)
    row = bench_spec.summarize_row([plain], [spec], None, None, 4)
    assert row["alpha"] == pytest.approx(0.7, abs=0.02) and row["acceptance_rate"] < 0.62
    e = (1 - row["alpha"] ** 5) / (1 - row["alpha"])
    assert row["predicted_speedup"] == pytest.approx(e / 1.1, rel=1e-3)
    assert row["speedup"] == 2.0


def test_alpha_by_position_is_conditional_and_exact_only_where_every_draft_reaches_the_position():
    """Fixed K = 3, 10 drafts: 8 accept token 1, 4 of those token 2, 1 token 3 -> α = 0.8, 0.5,
    0.25. Auto K (drafts of mixed lengths) gives position 1 alone."""
    run = bench_spec.Run(1.0, 0, [])
    run.accepted_per_position, run.drafted_per_position = [8, 4, 1], [10, 10, 10]
    assert bench_spec.alpha_by_position([run], fixed=True) == [0.8, 0.5, 0.25]
    assert bench_spec.alpha_by_position([run], fixed=False) == [0.8]
    assert bench_spec.alpha_by_position([bench_spec.Run(1.0, 0, [])], fixed=True) == []


def test_drafter_goals_are_ratios_to_ngram_in_the_same_run():
    def row(speedup, alpha=None):
        return {"speedup": speedup, "alpha_by_position": alpha or []}

    segments = {
        "chat": {"ngram/auto": row(1.0), "portfolio/auto": row(1.3), "eagle/k3": row(1.2, [0.65, 0.5])},
        "json": {"ngram/auto": row(1.2), "portfolio/auto": row(1.44)},
        "code": {"ngram/auto": row(1.0), "portfolio/auto": row(1.05)},
        "edit": {"ngram/auto": row(2.0), "portfolio/auto": row(1.9)},
    }
    g = bench_spec.drafter_goals(segments)
    assert g["portfolio_over_ngram"]["measured"] == {"chat": 1.3, "json": 1.2, "code": 1.05, "edit": 0.95}
    assert set(g["portfolio_over_ngram"]["failing"]) == {"json", "code", "edit"}
    assert not g["portfolio_over_ngram"]["pass"]
    assert g["eagle_alpha_position_1_chat"] == {"goal": g["eagle_alpha_position_1_chat"]["goal"],
                                                "measured": {"eagle/k3": 0.65}, "pass": True}
    segments["chat"]["eagle/k3"] = row(1.2, [0.55])
    assert not bench_spec.drafter_goals(segments)["eagle_alpha_position_1_chat"]["pass"]
    assert bench_spec.drafter_goals({"chat": {"ngram/auto": row(1.0)}}) == {}  # rows not run: no goal
    assert "portfolio_over_ngram_paired" not in g  # rows without per-prompt walls: no paired ratio


def test_the_portfolio_is_also_compared_with_ngram_prompt_by_prompt():
    """Beside the goal (a ratio of the two rows' median speedups) the summary gives the median of
    the per-prompt ratios of the same two rows' wall-clocks (each prompt's runs back to back)."""
    segments = {"edit": {"ngram/auto": {"speedup": 2.0, "wall_s": [1.0, 3.0, 2.0]},
                         "portfolio/auto": {"speedup": 1.9, "wall_s": [0.5, 3.3, 2.0]}}}
    g = bench_spec.drafter_goals(segments)
    assert g["portfolio_over_ngram"]["measured"] == {"edit": 0.95}
    assert g["portfolio_over_ngram_paired"]["measured"] == {"edit": 1.0}  # ratios 2.0, 0.909, 1.0
    shown = bench_spec.format_table({"segments": {}, "plain": {}, "summary": g})
    assert "INFO  portfolio_over_ngram_paired" in shown and "FAIL  portfolio_over_ngram" in shown


def test_spec_bench_refuses_no_rounds(tmp_path, capsys):
    assert _bench(["--json", str(tmp_path / "spec.json"), "--rounds", "0"]) == 2
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err and not (tmp_path / "spec.json").exists()


def test_spec_bench_refuses_two_eagle_heads(tmp_path, capsys):
    """Two heads in one run would share the rows eagle/k3 and eagle/auto: refused before any model loads."""
    assert _bench(["--json", str(tmp_path / "spec.json"), "--drafters", f"ngram,eagle,eagle:{tmp_path}"]) == 2
    assert "one EAGLE head per run" in capsys.readouterr().err
    assert not (tmp_path / "spec.json").exists()


def test_spec_bench_eagle_rows(tmp_path, default_model, capsys):
    """An ``eagle:DIR`` head (untrained: the target's own LM-head rows, random layer) gets fixed
    and auto K rows on the default model, lossless, with its draft cost c measured."""
    import torch

    from cluster.speculative.eagle_head import EagleConfig, EagleHead, save_head

    target = default_model.runner.model
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target, 8192))
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight()[:, :8192].t())
    save_head(head, tmp_path / "head")
    out = tmp_path / "spec.json"
    assert _bench(["--model", "default", "--workloads", str(WORKLOADS), "--json", str(out),
                  "--segments", "chat", "--prompts-per-segment", "1", "--max-tokens", "12",
                  "--drafters", f"eagle:{tmp_path / 'head'}", "--no-hf", "--threads", "2"]) == 0
    rows = json.loads(out.read_text())["segments"]["chat"]
    assert set(rows) == {"eagle/k3", "eagle/auto"}
    for name, row in rows.items():
        assert row["outputs_equal_plain"] == 1, name
        # a fixed K drafts every step, so its draft cost is measured; auto K may give an untrained
        # head K = 0 throughout (nothing drafted, c = 0)
        assert math.isfinite(row["c"]) and (row["c"] > 0 if name == "eagle/k3" else row["c"] >= 0), (name, row["c"])
    print(f"untrained eagle head on the default model: c = {rows['eagle/k3']['c']} of a decode step per draft round")


def test_spec_bench_portfolio_rows_show_what_each_member_drafted(tmp_path, default_model, capsys):
    """The portfolio row of a segment carries each member's counts on that segment (warm-up and
    other segments excluded): the members of the default model's portfolio, steps adding up to
    the row's drafting steps."""
    out = tmp_path / "spec.json"
    assert _bench(["--model", "default", "--workloads", str(WORKLOADS), "--json", str(out),
                  "--segments", "summarize,chat", "--prompts-per-segment", "1", "--max-tokens", "16",
                  "--drafters", "portfolio", "--no-hf", "--threads", "2"]) == 0
    segments = json.loads(out.read_text())["segments"]
    for seg in ("summarize", "chat"):
        row = segments[seg]["portfolio/auto"]
        assert row["outputs_equal_plain"] == 1
        members = row["members"]
        assert set(members) == {"ngram", "suffix", "eagle"}  # the shipped head fits the default model
        drafted = sum(m["draft_tokens"] for m in members.values())
        steps = sum(m["steps"] for m in members.values())
        assert drafted == round(row["k_mean"] * steps) and all(m["accepted_tokens"] <= m["draft_tokens"]
                                                                 for m in members.values())
    assert sum(m["steps"] for m in segments["summarize"]["portfolio/auto"]["members"].values()) > 0


def test_learning_drafters_run_each_prompt_once_under_repeats(tmp_path, default_model, monkeypatch):
    """``--repeats 2``: every method runs each prompt twice except suffix and portfolio, which
    learn every finished request — their second run would draft the first run's answer back and
    be kept as the median-time run (a portfolio measured "3.7x" plain on chat that way)."""
    assert bench_spec.runs_per_prompt("suffix/auto", 3) == 1 and bench_spec.runs_per_prompt("portfolio/auto", 3) == 1
    assert bench_spec.runs_per_prompt("ngram/auto", 3) == 3 and bench_spec.runs_per_prompt("plain", 0) == 1
    seen: list[str] = []
    real = bench_spec.run_ours

    def counting(engine, request):
        seen.append(request.request_id)
        return real(engine, request)

    monkeypatch.setattr(bench_spec, "run_ours", counting)
    assert _bench(["--model", "default", "--workloads", str(WORKLOADS), "--json", str(tmp_path / "spec.json"),
                  "--segments", "chat", "--prompts-per-segment", "1", "--max-tokens", "8",
                  "--drafters", "ngram,suffix", "--no-hf", "--threads", "2", "--repeats", "2"]) == 0
    measured = [r for r in seen if not r.startswith("warm-")]
    assert sorted(r.split("-", 2)[-1] for r in measured) == sorted(
        [f"{m}-{rep}" for m in ("plain", "ngram/k4", "ngram/auto") for rep in (0, 1)] + ["suffix/auto-0"])


def test_methods_run_in_a_rotated_order_prompt_by_prompt(tmp_path, default_model, monkeypatch):
    """No method always runs first or last of a prompt's runs: the order shifts by one per
    prompt (a fixed order put plain first and the EAGLE rows last on every prompt)."""
    assert bench_spec.method_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert bench_spec.method_order(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert bench_spec.method_order(["a", "b", "c"], 5) == ["c", "a", "b"] and bench_spec.method_order([], 3) == []
    seen: list[str] = []
    real = bench_spec.run_ours
    monkeypatch.setattr(bench_spec, "run_ours", lambda engine, request: seen.append(request.request_id) or real(engine, request))
    out = tmp_path / "spec.json"
    assert _bench(["--model", "default", "--workloads", str(WORKLOADS), "--json", str(out),
                  "--segments", "chat", "--prompts-per-segment", "2", "--max-tokens", "4",
                  "--drafters", "ngram", "--no-hf", "--threads", "2"]) == 0
    measured = [r.rsplit("-", 1)[0] for r in seen if not r.startswith("warm-")]
    first, second = measured[:3], measured[3:]
    assert [m.split("-")[-1] for m in first] == ["plain", "ngram/k4", "ngram/auto"]
    assert [m.split("-")[-1] for m in second] == ["ngram/k4", "ngram/auto", "plain"]
    assert json.loads(out.read_text())["config"]["method_order"].startswith("rotated")


def test_rounds_run_the_benchmark_again_on_fresh_engines(tmp_path, default_model, monkeypatch):
    """``--rounds 2``: every method is built afresh for each round (a portfolio's learning and
    adaptive K start over), every method runs every prompt once per round (the portfolio too),
    rows pool both rounds' runs and give each round's pooled ratio; the method order keeps
    rotating across rounds."""
    built: list[str] = []
    real_engine = bench_spec._engine

    def counting(target, spec_cfg=None, proposer=None, kv_mb=128):
        built.append("plain" if spec_cfg is None else f"{spec_cfg.drafter}/{spec_cfg.num_draft_tokens}")
        return real_engine(target, spec_cfg, proposer, kv_mb)

    monkeypatch.setattr(bench_spec, "_engine", counting)
    seen: list[str] = []
    portfolio_runs = []
    real_run = bench_spec.run_ours

    def running(engine, request):
        seen.append(request.request_id)
        run = real_run(engine, request)
        if "portfolio" in request.request_id and not request.request_id.startswith("warm-"):
            portfolio_runs.append(run)
        return run

    monkeypatch.setattr(bench_spec, "run_ours", running)
    out = tmp_path / "spec.json"
    assert _bench(["--model", "default", "--workloads", str(WORKLOADS), "--json", str(out),
                  "--segments", "chat", "--prompts-per-segment", "1", "--max-tokens", "6",
                  "--drafters", "ngram,portfolio", "--no-hf", "--threads", "2", "--rounds", "2"]) == 0
    assert built == ["plain", "ngram/4", "ngram/auto", "portfolio/auto"] * 2
    measured = [r.rsplit("-", 1)[0].split("-")[-1] for r in seen if not r.startswith("warm-")]
    assert measured == ["plain", "ngram/k4", "ngram/auto", "portfolio/auto",  # round 1, prompt 1
                        "ngram/k4", "ngram/auto", "portfolio/auto", "plain"]  # round 2: rotated on
    report = json.loads(out.read_text())
    assert report["config"]["rounds"] == 2
    for name, row in report["segments"]["chat"].items():
        assert len(row["wall_s"]) == 2 and row["outputs_equal_plain"] == 2, name
        by_round = row["pooled_speedup_by_round"]
        assert len(by_round) == 2 and all(x > 0 for x in by_round), name
        # the pooled ratio over both rounds lies between the rounds' own
        assert min(by_round) - 1e-3 <= row["pooled_speedup"] <= max(by_round) + 1e-3, (name, row)
    # the members' counts add both rounds up: their steps and draft tokens are both runs'
    members = report["segments"]["chat"]["portfolio/auto"]["members"].values()
    assert len(portfolio_runs) == 2 and all(r.drafts > 0 for r in portfolio_runs)
    assert sum(m["steps"] for m in members) == sum(r.drafts for r in portfolio_runs)
    assert sum(m["draft_tokens"] for m in members) == sum(r.draft_tokens for r in portfolio_runs)
