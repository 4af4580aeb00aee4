"""The local prompt corpus: deterministic, deduplicated, and disjoint from the benchmark workloads
(equal prompts and prompts sharing an 8-word run are dropped)."""
from __future__ import annotations

import json

from cluster.training.prompt_corpus import DEFAULT_WORKLOADS, build_prompts, workload_prompts


def test_corpus_is_deterministic_and_deduplicated():
    a = build_prompts(None, limit=200, seed=1)
    assert a == build_prompts(None, limit=200, seed=1) and len(a) == 200
    assert len(set(a)) == len(a)
    assert build_prompts(None, limit=200, seed=2) != a


def test_workload_prompts_are_excluded(tmp_path):
    base = build_prompts(None, limit=40)
    words = base[5].split()
    (tmp_path / "chat.jsonl").write_text(
        json.dumps({"id": "x", "prompt": "  " + base[3].upper() + " "}) + "\n"
        + json.dumps({"id": "y", "prompt": "Please: " + " ".join(words[-9:])}) + "\n")
    kept = build_prompts(tmp_path, limit=40)
    assert base[3] not in kept and base[5] not in kept
    assert len(kept) == 40


def test_real_workloads_are_held_out():
    held = workload_prompts(DEFAULT_WORKLOADS)
    assert held, "the shared workloads are where the benchmark prompts live"
    corpus = build_prompts(DEFAULT_WORKLOADS, limit=2000)
    low = {" ".join(p.lower().split()) for p in held}
    assert not any(" ".join(p.lower().split()) in low for p in corpus)
