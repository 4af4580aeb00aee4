"""`specserve bench cancel`: its counting, and a short run as a user runs it (real Serve, real gRPC)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster.bench.cancel import format_report, summarize


def test_summarize_sums_bursts_and_takes_the_median_free_time_of_bursts_that_lost_none():
    bursts = [{"cancelled": 4, "lost": 0, "lost_before_router": 0, "freed_s": 0.05},
              {"cancelled": 4, "lost": 0, "lost_before_router": 0, "freed_s": 0.15},
              {"cancelled": 4, "lost": 0, "lost_before_router": 0, "freed_s": 0.10},
              {"cancelled": 4, "lost": 2, "lost_before_router": 1, "freed_s": None},
              {"cancelled": 4, "lost": 1, "lost_before_router": 1, "freed_s": None}]
    s = summarize(bursts)
    assert (s["cancelled"], s["lost"], s["lost_before_router"], s["lost_after_router"]) == (20, 3, 2, 1)
    assert s["median_free_s"] == pytest.approx(0.10)
    assert summarize(bursts[3:])["median_free_s"] is None
    text = format_report({"settles": {"0": {"plain": s}}})
    assert "plain" in text and text.splitlines()[1].split()[:5] == ["0", "plain", "20", "3", "2"]


@pytest.mark.ray
def test_a_short_run_frees_every_settled_cancellation_and_writes_json(tmp_path):
    out = tmp_path / "cancel.json"
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from cluster.cli import main; sys.exit(main())",
         "bench", "cancel", "--rounds", "2", "--streams", "2", "--settle", "0.3", "--hold-s", "6", "--free-timeout-s", "3",
         "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["settles"]) == {"0.3"} and report["rounds"] == 2
    for path in ("speculative", "plain"):
        s = report["settles"]["0.3"][path]
        # a stream the engine holds is freed only by its cancellation (the hold is 6 s, the wait 3 s)
        assert (s["cancelled"], s["lost"]) == (4, 0), s
        assert 0 < s["median_free_s"] < 3
    assert "speculative" in proc.stdout


def test_bad_arguments_are_refused_before_ray_starts(monkeypatch, capsys):
    """In process (a subprocess a refusal cost seconds of imports): the local service, which starts
    Ray, fails the test if it is ever entered (and ``ray.init`` outside a ``ray`` test fails too)."""
    import deployments.local

    from cluster.cli import main

    def started(*_a, **_kw):
        raise AssertionError("bench cancel started the local service (and Ray) for bad arguments")

    monkeypatch.setattr(deployments.local, "local_service", started)
    for extra, words in ((["--settle", "x"], "comma-separated"), (["--settle", "-1"], ">= 0"),
                         (["--streams", "0"], "--streams >= 1"),
                         (["--hold-s", "2", "--free-timeout-s", "3"], "--hold-s > --free-timeout-s")):
        rc = main(["bench", "cancel", *extra])
        err = capsys.readouterr().err
        assert rc == 2 and words in err, (extra, err[-500:])
