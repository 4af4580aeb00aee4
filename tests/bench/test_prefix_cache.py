"""`specserve bench prefix_cache` on the real default model, one prompt, one round: turn 2 is the
same with and without the cache, the warm engine found turn 1's blocks, the JSON has the table;
on the plain path and on the speculative one (the default drafter, whose EAGLE head reads features)."""
import json

import pytest

from cluster.cli import main


@pytest.mark.model
@pytest.mark.parametrize("path", ["plain", "spec"])
def test_bench_prefix_cache_reports_cached_turns_and_equal_tokens(tmp_path, capsys, path):
    out = tmp_path / "prefix.json"
    rc = main(["bench", "prefix_cache", "--segments", "chat", "--prompts-per-segment", "1", "--rounds", "1",
               "--max-tokens", "12", "--turn2-tokens", "4", "--threads", "2", "--path", path, "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert report["lossless"] and run["cold_cached"] == 0
    assert 0 < run["cached_tokens"] < run["prompt_tokens"]  # turn 1 came from the cache, the follow-up did not
    assert report["table"]["chat"]["runs"] == 1 and report["table"]["chat"]["ttft_warm_vs_cold"] > 0
    assert report["path"] == path and (report["drafter"] == "portfolio") == (path == "spec")
    assert f"bench prefix_cache: 1 round(s), {path}" in capsys.readouterr().out


@pytest.mark.model
def test_bench_prefix_cache_burst_shares_the_system_prompt_within_the_burst(tmp_path, capsys):
    """Four requests added at once under one system prompt, on a fresh engine: the first prefills
    it, the other three take its full blocks (written in the same step), the tokens equal cold's."""
    out = tmp_path / "burst.json"
    rc = main(["bench", "prefix_cache", "--burst", "4", "--segments", "json", "--prompts-per-segment", "1",
               "--rounds", "2", "--turn2-tokens", "3", "--threads", "2", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["lossless"] and report["burst"] == 4 and len(report["runs"]) == 2
    for run in report["runs"]:
        full_blocks = run["shared_prefix_tokens"] // 16 * 16
        assert full_blocks > 0 and run["cold_cached"] == 0
        assert run["cached_tokens"] == 3 * full_blocks  # every round from an empty cache: the first shares nothing
    assert "bursts of 4 requests under one system prompt" in capsys.readouterr().out


def test_bench_prefix_cache_refuses_a_burst_of_one(tmp_path):
    assert main(["bench", "prefix_cache", "--burst", "1", "--json", str(tmp_path / "x.json")]) == 2


@pytest.mark.model
def test_bench_prefix_cache_burst_with_the_head_in_a_draft_server(tmp_path, capsys):
    """Placement separate: the shipped head in a DraftServer on 127.0.0.1, each engine its KVSync
    client; the burst shares the system prompt on the target and the head still drafts for every
    request (the engine's feature buffer gives the DraftServer the shared prefix's features)."""
    out = tmp_path / "burst.json"
    rc = main(["bench", "prefix_cache", "--burst", "3", "--path", "spec", "--placement", "separate",
               "--drafter", "eagle", "--segments", "json", "--prompts-per-segment", "1", "--rounds", "1",
               "--turn2-tokens", "6", "--threads", "2", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert report["lossless"] and report["placement"] == "separate"
    assert run["cached_tokens"] == 2 * (run["shared_prefix_tokens"] // 16 * 16) > 0
    assert run["warm_drafted"] > 0 and run["cold_drafted"] > 0  # (fallbacks on the deadline: reported, not judged)
    assert "spec (eagle) in a DraftServer path" in capsys.readouterr().out


def test_bench_prefix_cache_refuses_a_separate_placement_without_a_drafter(tmp_path):
    assert main(["bench", "prefix_cache", "--placement", "separate", "--json", str(tmp_path / "x.json")]) == 2
