"""`bench spec` end to end on the default model at the smallest size (1 prompt of 1 segment,
8 tokens, every drafter with fixed and auto K, the HF peers): the JSON has every segment ->
drafter -> field with finite numbers, the goals summary, and the derived draft model is a real
HF directory. Speed goals are not asserted here (that is the bench's job on a quiet machine)."""
from __future__ import annotations

import argparse
import json
import math

from cluster.bench import spec as bench_spec
from cluster.speculative.suffix_corpus import SHIPPED_SUFFIX_CORPUS
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


def test_spec_bench_refuses_no_rounds(tmp_path, capsys):
    assert _bench(["--json", str(tmp_path / "spec.json"), "--rounds", "0"]) == 2
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err and not (tmp_path / "spec.json").exists()


def test_spec_bench_refuses_a_bad_draft_confidence_floor(tmp_path, capsys):
    for args, needle in ((["--draft-stop-confidence", "1"], "--draft-stop-confidence must be in [0, 1), got 1.0"),
                         (["--compare-stop-confidence", "-0.5"], "--compare-stop-confidence must be in [0, 1)"),
                         (["--drafters", "ngram", "--compare-stop-confidence", "0"], "ask for eagle or portfolio")):
        assert _bench(["--json", str(tmp_path / "spec.json"), *args]) == 2
        assert needle in capsys.readouterr().err and not (tmp_path / "spec.json").exists()


def test_spec_bench_refuses_portfolio_settings_it_cannot_run(tmp_path, capsys):
    """``--compare-portfolio``: a field outside the portfolio's choosing settings, a value of the
    wrong type, one the portfolio itself refuses, no portfolio to compare with, or the same
    settings twice are refused before any model loads, saying which."""
    assert bench_spec.portfolio_variant("explore_every=64, probe_budget=0.005") == {
        "explore_every": 64, "probe_budget": 0.005}
    assert bench_spec.variant_name({"explore_every": 64, "probe_budget": 0.005}) == \
        "portfolio[explore_every=64,probe_budget=0.005]/auto"
    assert bench_spec.variant_name({"explore_every": 1000000}) == "portfolio[explore_every=1000000]/auto"
    assert bench_spec.portfolio_variant("suffix_corpus=cold") == {"suffix_corpus": "cold"}
    assert bench_spec.variant_name({"suffix_corpus": "cold"}) == "portfolio[suffix_corpus=cold]/auto"
    shipped = str(SHIPPED_SUFFIX_CORPUS)
    assert bench_spec.portfolio_variant(f"suffix_corpus={shipped}") == {"suffix_corpus": shipped}
    assert bench_spec.variant_name({"suffix_corpus": shipped}) == "portfolio[suffix_corpus=smollm2-135m-instruct]/auto"
    assert bench_spec.suffix_corpus_rows(["suffix", "suffix:cold", f"suffix:{shipped}"]) == {
        f"suffix:{shipped}": "suffix:smollm2-135m-instruct"}
    twins = [tmp_path / "a" / "c.npz", tmp_path / "b" / "c.npz"]  # two corpus files of one name
    for twin in twins:
        twin.parent.mkdir()
        twin.write_bytes(SHIPPED_SUFFIX_CORPUS.read_bytes())
    for args, needle in ((["--compare-portfolio", "members=1"], "FIELD one of explore_every"),
                         (["--compare-portfolio", "explore_every"], "expected FIELD=VALUE"),
                         (["--compare-portfolio", "explore_every=1.5"], "explore_every takes a int"),
                         (["--compare-portfolio", "suffix_corpus=warm"], "suffix_corpus takes a 'cold'"),
                         (["--drafters", "suffix:/no/such.npz"], "suffix:FILE needs a corpus file that exists"),
                         (["--drafters", f"suffix:{twins[0]},suffix:{twins[1]}"], "corpora with distinct file names"),
                         (["--compare-portfolio", "probe_budget=0"], "probe_budget in (0, 1]"),
                         (["--compare-portfolio", ","], "no FIELD=VALUE"),
                         (["--drafters", "ngram", "--compare-portfolio", "explore_every=64"], "ask for portfolio"),
                         (["--drafters", "portfolio", "--compare-portfolio", "explore_every=64",
                           "--compare-portfolio", "explore_every=64"], "the same settings twice")):
        assert _bench(["--json", str(tmp_path / "spec.json"), "--drafters", "portfolio", *args]) == 2, args
        assert needle in capsys.readouterr().err and not (tmp_path / "spec.json").exists()


def test_spec_bench_names_each_eagle_head_apart_and_refuses_two_of_one_name(tmp_path, capsys):
    """Heads side by side: the first's rows are eagle/..., the others' eagle:<directory name>/...;
    two heads whose rows would share names are refused before any model loads."""
    assert bench_spec.head_rows(["eagle", "eagle:/runs/trim4096", "eagle:/x/v5"]) == {
        "eagle": "eagle", "eagle:/runs/trim4096": "eagle:trim4096", "eagle:/x/v5": "eagle:v5"}
    assert _bench(["--json", str(tmp_path / "spec.json"), "--drafters", "ngram,eagle,eagle:/a/h,eagle:/b/h"]) == 2
    assert "need distinct directory names" in capsys.readouterr().err
    assert not (tmp_path / "spec.json").exists()
    # portfolio:DIR rows: portfolio:<directory name>; two of one name, or no directory, refused
    assert bench_spec.portfolio_head_rows(["ngram", "portfolio", "portfolio:/runs/v4"]) == {
        "portfolio:/runs/v4": "portfolio:v4"}
    for drafters, needle in (("portfolio:/a/h,portfolio:/b/h", "heads in distinct directory names"),
                             ("portfolio:", "portfolio:DIR needs the head's directory"),
                             ("portfolios", "unknown drafters ['portfolios']")):
        assert _bench(["--json", str(tmp_path / "spec.json"), "--drafters", drafters]) == 2, drafters
        assert needle in capsys.readouterr().err and not (tmp_path / "spec.json").exists()


def test_spec_bench_eagle_rows(tmp_path, default_model, capsys):
    """An ``eagle:DIR`` head (untrained: the target's own LM-head rows, random layer) gets fixed
    and auto K rows on the default model, lossless, with its draft cost c measured; a second head
    (the same one trimmed to a quarter of its draft vocabulary) runs beside it in its own rows."""
    import torch

    from cluster.speculative.eagle_head import EagleConfig, EagleHead, save_head, trim_vocabulary

    target = default_model.runner.model
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target, 8192))
    with torch.no_grad():
        head.lm_head.weight.copy_(target.lm_head.weight()[:, :8192].t())
    save_head(head, tmp_path / "head")
    save_head(trim_vocabulary(head, head.draft_to_target[:2048]), tmp_path / "small")
    out = tmp_path / "spec.json"
    assert _bench(["--model", "default", "--workloads", str(WORKLOADS), "--json", str(out),
                  "--segments", "chat", "--prompts-per-segment", "1", "--max-tokens", "12",
                  "--drafters", f"eagle:{tmp_path / 'head'},eagle:{tmp_path / 'small'}", "--no-hf", "--threads", "2"]) == 0
    rows = json.loads(out.read_text())["segments"]["chat"]
    assert set(rows) == {"eagle/k3", "eagle/auto", "eagle:small/k3", "eagle:small/auto"}
    for name, row in rows.items():
        assert row["outputs_equal_plain"] == 1, name
        # a fixed K drafts every step, so its draft cost is measured; auto K may give an untrained
        # head K = 0 throughout (nothing drafted, c = 0)
        assert math.isfinite(row["c"]) and (row["c"] > 0 if name.endswith("/k3") else row["c"] >= 0), (name, row["c"])
    print(f"untrained eagle head on the default model: c = {rows['eagle/k3']['c']} of a decode step per draft round")


def test_spec_bench_portfolio_rows_show_what_each_member_drafted(tmp_path, default_model, monkeypatch):
    """The portfolio row of a segment carries each member's counts on that segment (warm-up and
    other segments excluded): the members of the default model's portfolio, steps adding up to
    the row's drafting steps. Beside it, the same portfolio without the draft confidence floor,
    one with a choosing setting changed (its engines' portfolios hold the setting), one whose suffix
    member has no corpus (``suffix_corpus=cold``), the suffix rows with and without it, and one holding
    the head of another directory (``portfolio:DIR``, here a copy of the shipped head)."""
    import shutil

    from cluster.speculative.portfolio import PortfolioProposer
    from cluster.speculative.proposer import SHIPPED_EAGLE_HEAD
    from cluster.speculative.suffix import SuffixProposer

    built = []
    real = bench_spec.engine_for

    def recording(*a, **kw):
        built.append(real(*a, **kw))
        return built[-1]

    monkeypatch.setattr(bench_spec, "engine_for", recording)
    out = tmp_path / "spec.json"
    head = shutil.copytree(SHIPPED_EAGLE_HEAD, tmp_path / "v4")
    assert _bench(["--model", "default", "--workloads", str(WORKLOADS), "--json", str(out),
                  "--segments", "summarize,chat", "--prompts-per-segment", "1", "--max-tokens", "16",
                  "--drafters", f"portfolio,portfolio:{head},suffix,suffix:cold", "--no-hf", "--threads", "2",
                  "--compare-stop-confidence", "0", "--compare-portfolio", "explore_every=1000",
                  "--compare-portfolio", "suffix_corpus=cold"]) == 0
    report = json.loads(out.read_text())
    segments = report["segments"]
    assert report["config"]["draft_stop_confidence"] == 0.2 and report["config"]["compare_stop_confidence"] == 0
    assert report["config"]["compare_portfolio"] == [{"explore_every": 1000}, {"suffix_corpus": "cold"}]
    portfolios = [e.spec.proposer for e in built if e.spec is not None and isinstance(e.spec.proposer, PortfolioProposer)]
    assert sorted(p.explore_every for p in portfolios) == [16, 16, 16, 16, 1000]  # the five rows
    # every portfolio's suffix member drafts from the corpus shipped for the default model but the
    # suffix_corpus=cold row's; the suffix rows likewise
    corpora = [next(m for m in p.members if m.name == "suffix").proposer.corpus for p in portfolios]
    assert sum(c is None for c in corpora) == 1
    suffixes = [e.spec.proposer for e in built if e.spec is not None and isinstance(e.spec.proposer, SuffixProposer)]
    assert sorted(p.corpus is None for p in suffixes) == [False, True]
    heads = {str(next(m for m in p.members if m.name == "eagle").proposer.head_dir) for p in portfolios}
    assert heads == {str(SHIPPED_EAGLE_HEAD), str(head)}  # portfolio:DIR holds DIR's head
    for seg in ("summarize", "chat"):
        # the same portfolio beside it with a head that drafts the K planned (no confidence floor)
        assert set(segments[seg]) == {"portfolio/auto", "portfolio@stop0/auto", "portfolio[explore_every=1000]/auto",
                                      "portfolio[suffix_corpus=cold]/auto", "portfolio:v4/auto", "suffix/auto",
                                      "suffix:cold/auto"}
        assert segments[seg]["suffix/auto"]["outputs_equal_plain"] == segments[seg]["suffix:cold/auto"]["outputs_equal_plain"] == 1
        for other in ("portfolio@stop0/auto", "portfolio[explore_every=1000]/auto", "portfolio[suffix_corpus=cold]/auto",
                      "portfolio:v4/auto"):
            assert segments[seg][other]["outputs_equal_plain"] == 1
            assert set(segments[seg][other]["members"]) == {"ngram", "suffix", "eagle"}
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
    assert bench_spec.runs_per_prompt("portfolio[explore_every=64]/auto", 3) == 1
    assert bench_spec.runs_per_prompt("portfolio@stop0/auto", 3) == 1
    assert bench_spec.runs_per_prompt("portfolio:v4/auto", 3) == 1
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
    real_engine = bench_spec.engine_for

    def counting(target, spec_cfg=None, proposer=None, kv_mb=128):
        built.append("plain" if spec_cfg is None else f"{spec_cfg.drafter}/{spec_cfg.num_draft_tokens}")
        return real_engine(target, spec_cfg, proposer, kv_mb)

    monkeypatch.setattr(bench_spec, "engine_for", counting)
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
