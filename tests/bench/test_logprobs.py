"""`specserve bench logprobs`: one tiny run on the real default model through the CLI."""
import json

import pytest


@pytest.mark.model
def test_a_tiny_run_changes_no_token_and_reports_every_path_and_ask(tmp_path):
    from cluster.cli import build_parser

    out = tmp_path / "l.json"
    args = build_parser().parse_args(["bench", "logprobs", "--segments", "code", "--prompts-per-segment", "1",
                                      "--max-tokens", "12", "--rounds", "1", "--threads", "1", "--json", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["lossless"] and not report["mismatches"] and len(report["runs"]) == 6
    for seg in ("code", "all"):
        for path in ("plain", "spec"):
            cells = report["table"][seg][path]
            assert cells["none"]["vs_none"] == 1.0
            assert all(c["vs_none"] > 0 and c["pooled_tok_per_s"] > 0 for c in cells.values())
