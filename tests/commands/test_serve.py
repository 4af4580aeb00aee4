"""`specserve serve` as a user runs it: a subprocess with a fake-engine config, stopped by a signal;
and its printed hint, a command that runs as shown from the same directory in a new terminal, where
nothing has activated the venv (`make run` calls `.venv/bin/specserve`).

Each case starts Ray once (in the subprocess); the process must answer SIGTERM / SIGINT by
shutting Serve and Ray down and exiting 0 within a bounded time, leaving no process of its
session behind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import requests
import yaml

from cluster.commands import serve
from tests.deployments.harness import Client, fake_args, free_port

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


# SIGTERM end to end in the short profile; SIGINT end to end in the long one (the same handler:
# test_both_signals_stop_the_service_once below checks in process that SIGINT reaches it alike)
@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.long)])
def test_serve_stops_cleanly_on_signal(tmp_path, signum):
    port, http_port = free_port(), free_port()
    args = fake_args(drafter="none")
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "http_options": {"host": "127.0.0.1", "port": free_port()},  # --http-port overrides it
        "grpc_options": {"port": port},
        "applications": [{"name": "specserve", "import_path": "deployments.app:build", "args": args}]}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from cluster.cli import main; sys.exit(main())",
                             "serve", "--config", str(config), "--num-cpus", "2", "--ready-timeout", "180",
                             "--http-port", str(http_port)],
                            cwd=ROOT, env=env, stdout=(tmp_path / "out.txt").open("w"),
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        client = Client(f"127.0.0.1:{port}", "specserve")
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            try:
                r = client.generate(prompt="up ", max_tokens=3, timeout=5)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "specserve serve never answered"
                time.sleep(1.0)
        assert r.text == "up "
        base_url = f"http://127.0.0.1:{http_port}/specserve/v1"  # the default route prefix: /<app name>
        h = requests.post(f"{base_url}/completions", json={"prompt": "up ", "max_tokens": 3}, timeout=30)
        assert h.status_code == 200 and h.json()["choices"][0]["text"] == "up "  # the same app over HTTP
        # the service answers before the command has seen it serving: signal once its hint is out
        ready = time.monotonic() + 120
        while "OpenAI-compatible HTTP API at" not in (tmp_path / "out.txt").read_text():
            assert time.monotonic() < ready and proc.poll() is None, "no address printed"
            time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=90)
        out = (tmp_path / "out.txt").read_text()
        took = time.monotonic() - t0
        assert proc.returncode == 0, err[-3000:]
        assert "specserve: stopped" in err and took < 90
        assert f"gRPC on 127.0.0.1:{port}" in out and f"OpenAI-compatible HTTP API at {base_url}" in out
        deadline = time.monotonic() + 20  # Ray's daemons exit on their own once the driver is gone
        while _session_pids(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _session_pids(proc.pid), "processes of the service left running"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in _session_pids(proc.pid):  # whatever it left behind (a failed run)
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_both_signals_stop_the_service_once(signum, capsys):
    """What ``local_service`` installs after ``ray.init``: the first SIGTERM or SIGINT leaves the
    main thread's work (ShutdownRequested), one during the shutdown is ignored with a line on
    stderr, and the previous handlers are back afterwards."""
    from deployments.local import ShutdownRequested, _stop_on_signals

    before = signal.getsignal(signum)
    left = False
    with _stop_on_signals():
        try:
            os.kill(os.getpid(), signum)
            time.sleep(5)
        except ShutdownRequested as exc:
            left = str(exc) == signal.Signals(signum).name
        os.kill(os.getpid(), signum)  # again, while "shutting down": no exception
        time.sleep(0.05)
    assert left
    assert f"{signal.Signals(signum).name} again: already shutting down" in capsys.readouterr().err
    assert signal.getsignal(signum) is before


def test_hint_names_the_venv_script_by_its_path(tmp_path, monkeypatch):
    script = tmp_path / ".venv" / "bin" / "specserve"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), "serve"])
    assert serve._this_cli() == ".venv/bin/specserve"


def test_hint_outside_the_directory_is_absolute(tmp_path, monkeypatch):
    script = tmp_path / "elsewhere" / "specserve"
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    monkeypatch.setattr(sys, "argv", [str(script), "serve"])
    assert serve._this_cli() == str(script)


def test_hint_for_python_dash_m(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["/somewhere/cluster/cli.py", "serve"])
    assert serve._this_cli() == f"{sys.executable} -m cluster.cli"
