"""`bench serve --api openai`: the comparison of the two front doors (no service), and a quick run
against a real Ray Serve app on the fake engine, through both the gRPC and the OpenAI HTTP proxy."""
from __future__ import annotations

import argparse
import json

import pytest

from cluster.bench import serve as bench
from cluster.bench import serve_openai


def _cell(api, policy, e2e, tok_s, errors=None):
    return {"segment": "code", "concurrency": 1, "policy": policy, "api": api, "e2e_p50": e2e[1],
            "ttft_p50": 0.1, "tokens_per_s": tok_s, "e2e_s": e2e, "errors": errors or {}}


def test_api_overhead_pairs_the_two_front_doors():
    cells = [_cell("grpc", "fixed_plain", [1.0, 2.0, 4.0], 10.0),
             _cell("openai", "fixed_plain", [1.05, 2.1, 4.2], 9.5),
             _cell("grpc", "fixed_spec", [1.0, 1.0, 1.0], 10.0),
             _cell("openai", "fixed_spec", [1.2, 1.3, 1.2], 8.0, errors={"HTTP_503": 1})]
    rows = {r["policy"]: r for r in serve_openai.api_overhead(cells)}
    plain, spec = rows["fixed_plain"], rows["fixed_spec"]
    assert plain["e2e_ratio"] == pytest.approx(1.05) and plain["e2e_ratio_paired"] == pytest.approx(1.05)
    assert plain["throughput_ratio"] == pytest.approx(10 / 9.5, abs=1e-4) and plain["meets_goal"]
    assert spec["e2e_ratio"] == pytest.approx(1.3) and not spec["meets_goal"]
    assert spec["e2e_ratio_paired"] is None  # an error on one side: the requests no longer pair up
    assert serve_openai.api_overhead([c for c in cells if c["api"] == "grpc"]) == []
    assert any("MISSES GOAL" in line for line in serve_openai.format_api_overhead(list(rows.values())))


def test_openai_with_addr_needs_the_http_url(tmp_path, capsys):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--json", str(tmp_path / "x.json"), "--addr", "127.0.0.1:1", "--api", "openai"])
    assert bench.run(args) == 2 and "--http-url" in capsys.readouterr().err
    args = p.parse_args(["--json", str(tmp_path / "x.json"), "--addr", "127.0.0.1:1", "--http-url", "http://x/v1"])
    assert bench.run(args) == 2 and "--api openai" in capsys.readouterr().err


@pytest.mark.ray
def test_bench_serve_api_openai_quick(tmp_path, serve_shared):
    import yaml

    from tests.deployments.harness import Client, fake_args

    app_args = fake_args(engine_impl={"cls": "cluster.engine.fake_engine:FakeEngine",
                                      "options": {"token_delay_s": 0.01}})
    config = tmp_path / "oai.yaml"  # the in-process side of the front-door overhead is built from it
    config.write_text(yaml.safe_dump({"applications": [{"name": "oai", "args": app_args}]}))
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    with serve_shared.apps({"oai": app_args}) as addrs:
        Client(addrs.grpc, "oai").wait_ready()
        args = p.parse_args(["--json", str(tmp_path / "serve.json"), "--addr", addrs.grpc, "--app", "oai",
                             "--config", str(config), "--api", "openai", "--http-url", f"{addrs.http}/oai/v1",
                             "--segments", "code", "--concurrency", "1,2", "--requests", "2",
                             "--policies", "fixed_spec,fixed_plain", "--max-tokens", "8",
                             "--overhead-requests", "2"])
        assert bench.run(args) == 0
    report = json.loads((tmp_path / "serve.json").read_text())
    assert report["plan"]["apis"] == ["grpc", "openai"] and report["http_url"].endswith("/oai/v1")
    cells = {(c["policy"], c["api"], c["concurrency"]): c for c in report["cells"]}
    assert set(cells) == {(p, a, c) for p in ("fixed_spec", "fixed_plain") for a in ("grpc", "openai")
                          for c in (1, 2)}
    for (policy, api, _), c in cells.items():
        assert not c["errors"] and c["tokens"] == 2 * 8 and c["e2e_p50"] > 0 and c["ttft_p50"] > 0
        path = "speculative" if policy == "fixed_spec" else "plain"
        assert all(k.startswith(f"{path}:") for k in c["route_mix"]), (api, c["route_mix"])
    assert cells["fixed_spec", "openai", 1]["acceptance_rate"] > 0  # spec stats ride on the last chunk
    rows = report["api_overhead"]
    assert {(r["policy"], r["concurrency"]) for r in rows} == {(p, c) for p in ("fixed_spec", "fixed_plain")
                                                               for c in (1, 2)}
    for r in rows:
        assert r["e2e_ratio"] > 0 and r["e2e_ratio_paired"] > 0 and r["throughput_ratio"] > 0
        assert isinstance(r["meets_goal"], bool)
    fd = report["front_door"]["paths"]
    assert set(fd) == {f"{p}{s}" for p in ("speculative", "plain") for s in ("", "/unary", "/openai")}
    assert fd["plain/openai"]["requests"] == 2 and fd["plain/openai"]["same_token_counts"]
    assert "openai_e2e_p50" in fd["plain/openai"]
    assert len(report["summary"]) == 0  # no routed policy: nothing to compare with the better fixed one
