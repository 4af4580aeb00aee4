"""`specserve bench shaping`: one tiny run on the real default model through the CLI."""
import json

import pytest


@pytest.mark.model
def test_a_tiny_run_is_lossless_under_every_shaping_and_reports_each(tmp_path):
    from cluster.cli import build_parser

    out = tmp_path / "s.json"
    args = build_parser().parse_args(["bench", "shaping", "--segments", "code", "--prompts-per-segment", "1",
                                      "--max-tokens", "12", "--rounds", "1", "--threads", "1", "--json", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["lossless"] and not report["mismatches"] and len(report["runs"]) == 14
    for seg in ("code", "all"):
        cells = report["table"][seg]
        assert list(cells) == ["none", "penalties", "bias", "min_tokens", "repetition", "temp_0.7", "temp_1"]
        assert cells["none"]["plain"]["vs_none"] == cells["none"]["spec"]["vs_none"] == 1.0
        assert all(c[p]["vs_none"] > 0 and c[p]["pooled_tok_per_s"] > 0 and c["spec_over_plain"] > 0
                   for c in cells.values() for p in ("plain", "spec"))
    by_shaping = {r["shaping"]: r for r in report["runs"] if r["path"] == "plain"}
    assert by_shaping["min_tokens"]["tokens"] >= 6  # half the budget at least
    spec = [r for r in report["runs"] if r["path"] == "spec"]
    assert sum(r["draft_tokens"] for r in spec) > 0
    cell = report["table"]["code"]["none"]["spec"]
    drafted = sum(r["draft_tokens"] for r in spec if r["shaping"] == "none")
    assert cell["acceptance"] == (round(sum(r["accepted_tokens"] for r in spec if r["shaping"] == "none") / drafted, 3)
                                  if drafted else None)


def test_sampled_shapings_are_seeded_alike_on_both_paths_and_shapings_are_chosen():
    import argparse

    from cluster.bench.shaping import SHAPINGS, chosen_shapings, request_seed, shaped
    from cluster.common.request import SamplingParams

    a, b = shaped(SamplingParams(max_tokens=8), "temp_1", request_seed("chat-001", 1)), \
        shaped(SamplingParams(max_tokens=8), "temp_0.7", request_seed("chat-001", 1))
    assert (a.temperature, b.temperature) == (1.0, 0.7) and a.seed == b.seed == request_seed("chat-001", 1)
    assert request_seed("chat-001", 0) != a.seed and request_seed("chat-002", 1) != a.seed
    assert shaped(SamplingParams(max_tokens=8), "none", 5).greedy
    assert chosen_shapings("temp_1, none") == ("none", "temp_1") and chosen_shapings(",".join(SHAPINGS)) == SHAPINGS
    for bad in ("temp_1", "none,typo"):
        with pytest.raises(argparse.ArgumentTypeError, match="none"):
            chosen_shapings(bad)


@pytest.mark.model
def test_a_subset_of_shapings_runs_only_those(tmp_path):
    from cluster.cli import build_parser

    out = tmp_path / "s.json"
    args = build_parser().parse_args(["bench", "shaping", "--segments", "chat", "--prompts-per-segment", "1",
                                      "--max-tokens", "8", "--rounds", "1", "--threads", "1", "--shapings",
                                      "none,temp_1", "--json", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert list(report["table"]["chat"]) == ["none", "temp_1"] and len(report["runs"]) == 4
    assert report["lossless"]
