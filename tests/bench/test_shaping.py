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
    assert report["lossless"] and not report["mismatches"] and len(report["runs"]) == 10
    for seg in ("code", "all"):
        cells = report["table"][seg]
        assert list(cells) == ["none", "penalties", "bias", "min_tokens", "repetition"]
        assert cells["none"]["plain"]["vs_none"] == cells["none"]["spec"]["vs_none"] == 1.0
        assert all(c[p]["vs_none"] > 0 and c[p]["pooled_tok_per_s"] > 0 and c["spec_over_plain"] > 0
                   for c in cells.values() for p in ("plain", "spec"))
    by_shaping = {r["shaping"]: r for r in report["runs"] if r["path"] == "plain"}
    assert by_shaping["min_tokens"]["tokens"] >= 6  # half the budget at least
