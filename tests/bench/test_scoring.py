"""`specserve bench scoring`: one tiny run on the real default model through the CLI."""
import json

import pytest


@pytest.mark.model
def test_a_tiny_run_scores_the_answer_as_generation_reported_it(tmp_path):
    from cluster.cli import build_parser

    out = tmp_path / "s.json"
    args = build_parser().parse_args(["bench", "scoring", "--segments", "code,chat", "--prompts-per-segment", "1",
                                      "--max-tokens", "12", "--rounds", "1", "--threads", "1", "--json", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "scoring" and report["lossless"] and not report["mismatches"]
    assert len(report["runs"]) == 2 and all(r["answer_tokens"] > 0 for r in report["runs"])
    for seg in ("code", "chat", "all"):
        cells = report["table"][seg]
        assert cells["score0_vs_prefill"] > 0 and cells["score0_vs_generate"] > 0 and cells["scored_tok_per_s"] > 0
        assert 0 <= cells["answer_tokens_not_top1"] <= cells["answer_tokens"]
