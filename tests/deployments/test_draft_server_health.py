"""The DraftServer deployment's health check asks its own KVSync server over loopback (same token,
same TLS): it passes while the server answers and fails once the server is stopped, wedged (a
drafter call stuck past ``STUCK_DRAFTER_S``) or replaced by another one. No Ray needed: the check
is plain code over a real gRPC server on 127.0.0.1."""
import threading

import pytest

from cluster.common.request import SamplingParams
from cluster.kvsync.client import RemoteProposer
from cluster.kvsync.server import DraftServerCore, start_server
from cluster.speculative.ngram import NgramProposer
from cluster.speculative.types import DraftUnavailableError, ProposeInput
from deployments import draft_server as ds
from deployments.app_config import AppConfig

TOKEN = "health-token"


@pytest.fixture()
def app(monkeypatch):
    monkeypatch.setenv("KVSYNC_TEST_TOKEN", TOKEN)
    return AppConfig(placement="separate", auth={"token_env": "KVSYNC_TEST_TOKEN"})


def test_health_follows_the_server(app):
    core = DraftServerCore(NgramProposer(), vocab_size=0, limits=app.kvsync_limits())
    server, port = start_server(core, token=TOKEN)
    health = ds.KVSyncHealth(f"127.0.0.1:{port}", app, TOKEN)
    try:
        health.check(core)  # answers Info with the token
        other = DraftServerCore(NgramProposer(), vocab_size=0)
        with pytest.raises(RuntimeError, match="another KVSync server"):
            health.check(other)  # a different epoch answers on this address
        wrong = ds.KVSyncHealth(f"127.0.0.1:{port}", app, "not-the-token")
        with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
            wrong.check(core)
        wrong.close()
        server.stop(0).wait()
        with pytest.raises(RuntimeError, match="does not answer"):
            health.check(core)
    finally:
        health.close()
        server.stop(0)


def test_a_stuck_drafter_fails_health(app, monkeypatch):
    release = threading.Event()

    class Stuck(NgramProposer):
        def propose(self, inputs):
            release.wait(30)
            return super().propose(inputs)

    core = DraftServerCore(Stuck(), vocab_size=0)
    server, port = start_server(core)
    health = ds.KVSyncHealth(f"127.0.0.1:{port}", AppConfig(placement="separate"), None)
    try:
        remote = RemoteProposer(f"127.0.0.1:{port}", timeout_s=0.3)
        with pytest.raises(DraftUnavailableError):
            remote.propose([ProposeInput("a", [1, 2, 1], 2, SamplingParams(max_tokens=4))])
        health.check(core)  # busy, not yet stuck
        monkeypatch.setattr(ds, "STUCK_DRAFTER_S", 0.0)
        with pytest.raises(RuntimeError, match="drafter has been running one call"):
            health.check(core)
    finally:
        release.set()
        health.close()
        server.stop(0)


def test_auth_configured_without_the_variable_refuses_to_start(monkeypatch):
    from cluster.api.auth import token_from_env

    monkeypatch.delenv("KVSYNC_TEST_TOKEN", raising=False)
    with pytest.raises(ValueError, match="empty in the DraftServer replica"):
        token_from_env("KVSYNC_TEST_TOKEN", "DraftServer")
    assert token_from_env(None, "DraftServer") is None
