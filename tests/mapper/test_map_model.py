"""`specserve map --quick` on the real default model, bounded to a few minutes: phase 1 with the
real engine (per-step timing, n-gram drafter), phase 2 through a local service of ProcessEngine
replicas, phase 3 and every file."""
from __future__ import annotations

import argparse
import json
import pytest

from cluster.cli import main
from deployments.local import load_config
from deployments.app_config import AppConfig

ARTICLE = ("The city council met on Tuesday to discuss the new library. The library will open in "
           "March and will have a reading room, a children's corner and a small cafe. The council "
           "said the library will be free for every resident of the city.")
ROWS = [
    {"segment": "summarize", "chat": True, "max_tokens": 12, "prompt": f"Summarize: {ARTICLE}"},
    {"segment": "summarize", "chat": True, "max_tokens": 12, "prompt": f"Repeat the first sentence: {ARTICLE}"},
    {"segment": "chat", "chat": True, "max_tokens": 12, "prompt": "Invent a new board game."},
    {"segment": "chat", "chat": True, "max_tokens": 12, "prompt": "What is a good name for a cat?"},
]

pytestmark = [pytest.mark.model, pytest.mark.ray]


def test_map_quick_on_the_default_model(tmp_path):
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "map"
    rc = main(["map", "--traffic", str(traffic), "--out", str(out), "--quick", "--drafters", "ngram",
               "--max-tokens", "12", "--concurrency", "1,2", "--requests", "2", "--rows-per-segment", "2",
               "--max-minutes", "6", "--no-progress"])
    assert rc == 0
    m = json.loads((out / "map.json").read_text())
    prof = m["profile"]["segments"]
    assert set(prof) == {"summarize", "chat"}
    for seg, p in prof.items():
        row = p["drafters"]["ngram"]
        assert 0.0 <= row["acceptance_rate"] <= 1.0 and row["outputs_equal_plain"] == 2  # greedy: lossless
        assert row["v"] > 0 and row["c"] >= 0 and row["speedup"] > 0 and row["predicted_speedup"] > 0
        assert p["plain_step_ms"] > 0
    if not m["sweep"].get("stopped"):
        assert {(c["segment"], c["concurrency"], c["policy"]) for c in m["sweep"]["cells"]} == {
            (s, c, p) for s in prof for c in (1, 2) for p in ("fixed_spec", "fixed_plain")}
        assert all(not c["errors"] and c["tokens"] > 0 for c in m["sweep"]["cells"])
        # two rows a segment: level 1 answers both, level 2 sends them again, but in a draft scope
        # of its own (a new one each pass over the sample), so the shipped config's portfolio,
        # which learns from traffic, never drafts a row from its earlier answer: no repeats
        assert all(c["repeated_rows"] == 0 for c in m["sweep"]["cells"])
        assert m["sweep"]["repeated_rows"] == {"speculative_requests": 8, "repeated": 0, "drafter": "portfolio",
                                               "drafter_learns_from_traffic": True}
        assert "WARNING" not in (out / "report.md").read_text()
    cfg = load_config(argparse.Namespace(config=out / "serve_config.yaml", model=None, drafter=None,
                                         placement=None, port=None))
    AppConfig(**cfg["applications"][0]["args"])
    for name in ("values-mapped.yaml", "report.md", "alpha_by_position.png"):
        assert (out / name).is_file()
