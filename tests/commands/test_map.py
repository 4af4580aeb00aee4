"""`specserve map` end to end on FakeEngine: every phase (profile in process, sweep through a real
local Serve app, decide), every output file, the written config loading with the app's own
AppConfig and `specserve serve`'s loader, the Helm overlay passing the chart's schema, PNGs that
are real images whose plotted series are map.json's numbers; and partial maps (time budget,
Ctrl-C) still written."""
from __future__ import annotations

import argparse
import copy
import json
import struct
from pathlib import Path

import jsonschema
import pytest
import yaml

from cluster.cli import main
from deployments.local import load_config
from deployments.app_config import AppConfig
from tests.mapper.fake_setup import fake_serve_config, traffic_file

CHART = Path(__file__).resolve().parents[2] / "helm" / "specserve"
PNGS = ("latency.png", "throughput.png", "speedup_heatmap.png", "alpha_by_position.png",
        "measured_vs_predicted.png")


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path.name} is not a PNG"
    assert len(data) > 5000, f"{path.name}: {len(data)} bytes, too small for a plot"
    return struct.unpack(">II", data[16:24])


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def _check_configs(out: Path, knobs: dict) -> AppConfig:
    cfg = load_config(argparse.Namespace(config=out / "serve_config.yaml", model=None, drafter=None,
                                         placement=None, port=None))
    app = AppConfig(**cfg["applications"][0]["args"])
    assert app.drafter == knobs["drafter"] and app.num_draft_tokens == knobs["num_draft_tokens"]
    dumped = app.router.model_dump(exclude_none=True)
    for k, v in knobs["router"].items():
        assert dumped[k] == v
    overlay = yaml.safe_load((out / "values-mapped.yaml").read_text())
    assert overlay["app"]["router"] == knobs["router"] and overlay["app"]["drafter"] == knobs["drafter"]
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.validate(_merge(yaml.safe_load((CHART / "values.yaml").read_text()), overlay), schema)
    return app


@pytest.mark.ray
def test_map_end_to_end_on_fake_engine(tmp_path, capsys):
    cfg = fake_serve_config(tmp_path / "serve_config.yaml")
    traffic = traffic_file(tmp_path / "traffic.jsonl")
    out = tmp_path / "map"
    rc = main(["map", "--traffic", str(traffic), "--config", str(cfg), "--out", str(out), "--quick",
               "--concurrency", "1,2,4,8,16", "--no-progress"])
    assert rc == 0
    err = capsys.readouterr().err
    assert f"skipped bad row {traffic}:3: not JSON" in err and f"{traffic}:6: 'max_tokens'" in err
    m = json.loads((out / "map.json").read_text())
    assert m["partial"] is False and not m.get("interrupted")
    assert [b.split(": ")[0] for b in m["traffic"]["bad_rows"]] == [f"{traffic}:3", f"{traffic}:6"]
    assert set(m["traffic"]["shares"]) == {"code", "chat", "default"}  # the row without a segment

    # phase 1: α by position from the fake's deterministic acceptance (K=4): code accepts 4 of 4,
    # chat 1 of 4; the per-position prediction says chat commits 2 tokens a step (≈2x); one α for
    # every position (0.5: an acceptance and a rejection a step) says 1.94x, where accepted/drafted
    # (0.25) would predict 1.33x
    prof = m["profile"]["segments"]
    assert set(prof) == {"code", "chat", "default"}
    assert m["drafters"] == ["ngram", "portfolio", "eagle"]  # the defaults (the config's drafter is ngram)
    for d in m["drafters"]:
        assert prof["code"]["drafters"][d]["alpha_by_position"] == [1.0, 1.0, 1.0, 1.0]
        chat = prof["chat"]["drafters"][d]
        assert chat["alpha_by_position"] == [1.0, 0.0, 0.0, 0.0] and chat["acceptance_rate"] == 0.25
        assert chat["predicted_speedup"] == pytest.approx(2.0, rel=0.1)
        assert chat["alpha"] == 0.5 and chat["predicted_speedup_alpha_only"] == pytest.approx(1.94, rel=0.05)
        assert chat["best_num_draft_tokens"] == 1  # one draft is as good as four and verifies cheaper
        assert chat["speedup"] > 1.3 and prof["code"]["drafters"][d]["speedup"] > 2.5
    assert prof["code"]["output_tokens"]["p50"] == 24

    # phase 2: both paths per level for every segment, no errors; chat (2 tokens a step on a
    # SpecEngine of 2 sequences) loses to batching within the levels run
    cells = m["sweep"]["cells"]
    for seg in ("code", "chat", "default"):
        for path in ("fixed_spec", "fixed_plain"):
            mine = [c for c in cells if c["segment"] == seg and c["policy"] == path]
            assert [c["concurrency"] for c in mine] == [1, 2, 4, 8, 16][:len(mine)] and len(mine) >= 2
    assert all(not c["errors"] for c in cells)

    # phase 3
    dec = m["decision"]
    chat = dec["segments"]["chat"]
    assert chat["crossover"]["kind"] == "within" and 1 < chat["crossover"]["value"] <= 16
    assert dec["segments"]["code"]["ratio_spec_over_plain"][0] < 0.5  # 5 tokens a step at c=1
    assert dec["cost_model"]["points"] > 0 and chat["predicted_crossover"] is not None
    knobs = dec["knobs"]
    assert 1 <= knobs["router"]["enter_threshold"] <= knobs["router"]["exit_threshold"]
    # chat's best K is 1, code's more: each its own K in the SpecEngine, adaptive K for the rest
    assert knobs["num_draft_tokens"] == "auto" and knobs["router"]["segments"]["chat"]["num_draft_tokens"] == 1
    assert knobs["router"]["segments"]["code"]["num_draft_tokens"] > 1
    app = _check_configs(out, knobs)
    assert app.engine_config(True).spec.k_policy("chat") == 1

    # the plots: real PNGs, and what they show is map.json's numbers
    for name in PNGS:
        w, h = _png_size(out / name)
        assert w >= 300 and h >= 200
    series = m["plots"]
    for seg in ("code", "chat"):
        for path, label in (("fixed_spec", "speculative"), ("fixed_plain", "plain")):
            mine = [c for c in cells if c["segment"] == seg and c["policy"] == path]
            lat = series["latency.png"][f"{seg}/{label} p50"]
            assert lat["x"] == [c["concurrency"] for c in mine] and lat["y"] == [c["e2e_p50"] for c in mine]
            assert series["latency.png"][f"{seg}/{label} p99"]["y"] == [c["e2e_p99"] for c in mine]
            tput = series["throughput.png"][f"{seg}/{label}"]
            assert tput["y"] == [c["tokens_per_s"] for c in mine]
    assert series["latency.png"]["chat/crossover"]["x"][0] == pytest.approx(chat["crossover"]["value"])
    assert series["alpha_by_position.png"]["alpha/chat/ngram"]["y"] == prof["chat"]["drafters"]["ngram"]["alpha_by_position"]
    heat = series["speedup_heatmap.png"]["heatmap"]
    i = heat["segments"].index("chat")
    assert [v for v in heat["values"][i] if v is not None] == chat["speedup_by_level"]
    report = (out / "report.md").read_text()
    for name in PNGS:
        assert f"]({name})" in report
    assert "| chat |" in report and "exit_threshold" in report
    assert "chat drafts with" in report and "at K 1" in report


def test_time_budget_spent_leaves_a_partial_map(tmp_path):
    cfg = fake_serve_config(tmp_path / "serve_config.yaml")
    out = tmp_path / "map"
    rc = main(["map", "--traffic", str(traffic_file(tmp_path / "t.jsonl")), "--config", str(cfg),
               "--out", str(out), "--max-minutes", "0.00001", "--no-progress"])
    assert rc == 0
    m = json.loads((out / "map.json").read_text())
    assert m["partial"] is True and "max-minutes" in m["profile"]["stopped"]
    assert "skipped" in m["sweep"]["stopped"] and not m["sweep"].get("cells")
    assert "Partial map" in (out / "report.md").read_text()
    _check_configs(out, m["decision"]["knobs"])  # the config's own knobs: nothing was measured


@pytest.mark.parametrize("exc,rc,key", [(KeyboardInterrupt, 130, "interrupted"),
                                        (RuntimeError("engines not SERVING"), 1, "failed")])
def test_ctrl_c_or_a_failed_sweep_leaves_the_partial_map(tmp_path, monkeypatch, exc, rc, key):
    from cluster.mapper import sweep

    def interrupted(addr, app, traffic, levels, requests, max_tokens, budget, result, token=None, drafter=None):
        result.setdefault("cells", [])
        raise exc

    monkeypatch.setattr(sweep, "run_sweep", interrupted)
    cfg = fake_serve_config(tmp_path / "serve_config.yaml")
    out = tmp_path / "map"
    got = main(["map", "--traffic", str(traffic_file(tmp_path / "t.jsonl", per_segment=2)), "--config", str(cfg),
                "--out", str(out), "--addr", "127.0.0.1:1", "--drafters", "ngram", "--no-progress"])
    assert got == rc
    m = json.loads((out / "map.json").read_text())
    assert m[key] and m["partial"] is True
    if key == "failed":
        assert m["failed"] == "RuntimeError: engines not SERVING"
        assert "failed: RuntimeError: engines not SERVING" in (out / "report.md").read_text()
    assert set(m["profile"]["segments"]) == {"code", "chat", "default"}  # phase 1 kept
    for name in ("serve_config.yaml", "values-mapped.yaml", "report.md", "alpha_by_position.png",
                 "measured_vs_predicted.png"):
        assert (out / name).is_file()
    assert not (out / "latency.png").exists()  # nothing swept, nothing plotted
    _check_configs(out, m["decision"]["knobs"])


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    t = traffic_file(tmp_path / "t.jsonl")
    assert main(["map", "--traffic", str(t), "--out", str(tmp_path / "o"), "--concurrency", "1,x"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert main(["map", "--traffic", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "traffic not found" in capsys.readouterr().err
    assert main(["map", "--traffic", str(t), "--out", str(tmp_path / "o"), "--k", "0"]) == 2
