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
