"""`specserve bench mapped`: the split, the judging on synthetic reports with known answers, and
one end-to-end run on FakeEngine (map on the even rows, bench serve on the odd rows, twice)."""
from __future__ import annotations

import json

import pytest

from cluster.mapper.heldout import crossover_check, judge, split_workloads
from cluster.cli import main
from tests.mapper.fake_setup import ALPHA, fake_serve_config


def _workloads(path, per_segment=8):
    path.mkdir(parents=True, exist_ok=True)
    for seg in ALPHA:
        rows = [{"id": f"{seg}-{i}", "max_tokens": 24, "prompt": f"{seg} prompt number {i}: " + "abc " * (3 + i)}
                for i in range(per_segment)]
        (path / f"{seg}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_split_keeps_even_rows_for_the_map_and_holds_out_the_odd(tmp_path):
    wl = _workloads(tmp_path / "wl", per_segment=5)
    sample, held, counts = split_workloads(wl, ["code", "chat"], tmp_path / "out")
    assert counts == {"code": {"sample": 3, "heldout": 2}, "chat": {"sample": 3, "heldout": 2}}
    ids = lambda d, seg: [json.loads(x)["id"] for x in (d / f"{seg}.jsonl").read_text().splitlines()]  # noqa: E731
    assert ids(sample, "code") == ["code-0", "code-2", "code-4"] and ids(held, "code") == ["code-1", "code-3"]
    assert all(json.loads(x)["segment"] == "chat" for x in (held / "chat.jsonl").read_text().splitlines())
    assert not set(ids(sample, "chat")) & set(ids(held, "chat"))
    (wl / "one.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(Exception, match="nothing would be held out"):
        split_workloads(wl, ["one"], tmp_path / "out2")


def _cell(seg, c, policy, p50, e2e=None, mix=None):
    return {"segment": seg, "concurrency": c, "policy": policy, "e2e_p50": p50,
            "e2e_s": e2e or [p50] * 5, "route_mix": mix or {}}


def test_judge_compares_within_a_run_and_against_the_shipped_config():
    # chat: spec wins at c=1 (1.0 vs 2.0), loses at 4 (3.0 vs 2.0): crossover between 1 and 4
    mapped = {"cells": [_cell("chat", 1, "fixed_spec", 1.0), _cell("chat", 1, "fixed_plain", 2.0),
                        _cell("chat", 1, "routed", 1.0),
                        _cell("chat", 4, "fixed_spec", 3.0), _cell("chat", 4, "fixed_plain", 2.0),
                        _cell("chat", 4, "routed", 2.4, e2e=[2.3, 2.4, 2.5, 2.4, 2.4])]}
    shipped = {"cells": [_cell("chat", 1, "routed", 1.0), _cell("chat", 4, "routed", 3.0, e2e=[2.9, 3.0, 3.1, 3.0, 3.0])]}
    decision = {"segments": {"chat": {"crossover": {"kind": "within", "value": 2.5}}}}
    rows = {r["concurrency"]: r for r in judge(mapped, shipped, decision, [1, 4])}
    assert rows[1]["best_fixed"] == "fixed_spec" and rows[1]["meets_goal"]
    assert rows[4]["mapped_over_best_fixed"] == pytest.approx(1.2) and not rows[4]["meets_goal"]
    # 20% slower than plain there, every request of each: beyond noise (its interval stays above 1)
    assert rows[4]["mapped_over_best_fixed_ci90"][0] > 1.0 and not rows[4]["best_fixed_within_noise"]
    assert rows[4]["mapped_over_shipped"] == pytest.approx(0.8) and rows[4]["not_worse_than_shipped"]
    x = rows[4]["crossover"]  # held out: r(1) = 0.5, r(4) = 1.5 -> crosses at 2 (log2 midpoint)
    assert x["heldout"] == pytest.approx(2.0) and x["within_one_level"]
    # 2% over the best fixed policy with spreads that overlap: a miss of the point goal, within noise
    noisy = {"cells": [_cell("code", 2, "fixed_spec", 1.0, e2e=[1.0, 1.1, 0.9, 1.05, 0.95]),
                       _cell("code", 2, "fixed_plain", 2.0),
                       _cell("code", 2, "routed", 1.02, e2e=[1.02, 0.92, 1.12, 0.97, 1.07])]}
    (row,) = judge(noisy, {"cells": []}, {}, [2])
    assert not row["meets_goal"] and row["best_fixed_within_noise"]


def test_crossover_check_cases():
    levels = [1, 2, 4, 8, 16]
    within = {"kind": "within", "value": 3.0}
    assert crossover_check({"crossover": {"kind": "within", "value": 5.0}}, within, levels)["within_one_level"]
    far = crossover_check({"crossover": {"kind": "within", "value": 14.0}}, within, levels)
    assert far["levels_apart"] == pytest.approx(2.222, rel=0.01) and not far["within_one_level"]
    # the map's sweep never crossed up to 16: its cost model's prediction counts beyond that only
    # (a prediction of 4 contradicts the sweep's own measurement)
    beyond = {"crossover": {"kind": "above", "value": None}, "predicted_crossover": 24.0, "levels": levels}
    assert crossover_check(beyond, within, levels)["map"] == 24.0
    assert crossover_check(beyond, {"kind": "above", "value": None}, levels)["within_one_level"]
    contradicted = {"crossover": {"kind": "above", "value": None}, "predicted_crossover": 3.62, "levels": levels}
    assert crossover_check(contradicted, {"kind": "above", "value": None}, levels)["within_one_level"]
    late, early = {"kind": "within", "value": 12.0}, {"kind": "within", "value": 3.0}
    assert crossover_check(contradicted, late, levels) == {"map": "> 16", "heldout": 12.0, "within_one_level": True}
    assert not crossover_check(contradicted, early, levels)["within_one_level"]
    # no sweep at all: the cost model alone
    assert crossover_check({"predicted_crossover": 4.0}, within, levels)["map"] == 4.0
    # neither crossed within the levels: they agree
    assert crossover_check({"crossover": {"kind": "above"}}, {"kind": "above", "value": None}, levels)["within_one_level"]
    assert crossover_check(None, within, levels)["within_one_level"] is None


@pytest.mark.ray
def test_bench_mapped_end_to_end_on_fake_engine(tmp_path, capsys):
    cfg = fake_serve_config(tmp_path / "serve_config.yaml")
    wl = _workloads(tmp_path / "wl")
    out = tmp_path / "run"
    rc = main(["bench", "mapped", "--json", str(tmp_path / "mapped.json"), "--out", str(out),
               "--config", str(cfg), "--workloads", str(wl), "--segments", "code,chat",
               "--concurrency", "1,4", "--requests", "4", "--max-tokens", "16",
               "--rows-per-segment", "4", "--quick"])
    assert rc == 0
    report = json.loads((tmp_path / "mapped.json").read_text())
    assert report["rows_split"] == {"code": {"sample": 4, "heldout": 4}, "chat": {"sample": 4, "heldout": 4}}
    assert {(c["segment"], c["concurrency"]) for c in report["cells"]} == {(s, c) for s in ("code", "chat") for c in (1, 4)}
    for c in report["cells"]:
        assert c["mapped_over_best_fixed"] > 0 and "mapped_over_shipped" in c and "crossover" in c
    for name in ("map/map.json", "map/serve_config.yaml", "serve_mapped.json", "serve_shipped.json"):
        assert (out / name).is_file(), name
    # the benches ran on the held-out rows only
    prompts = {json.loads(x)["prompt"] for x in (out / "heldout" / "code.jsonl").read_text().splitlines()}
    assert len(prompts) == 4 and "code prompt number 0: abc abc abc " not in prompts
    assert report["goals"]["cells"] == 4
    # judged again from the same files, nothing measured: the same cells
    rc = main(["bench", "mapped", "--json", str(tmp_path / "again.json"), "--out", str(out), "--config", str(cfg),
               "--segments", "code,chat", "--concurrency", "1,4", "--judge-only"])
    assert rc == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["judge_only"] and again["cells"] == report["cells"] and again["rows_split"] == report["rows_split"]
    assert main(["bench", "mapped", "--json", str(tmp_path / "x.json"), "--out", str(tmp_path / "empty"),
                 "--judge-only"]) != 0
