"""deployments/local.py: the environment Ray's processes inherit from ``local_service``."""
from __future__ import annotations

import pytest

from deployments import local


class _Stop(Exception):
    pass


def _start_and_stop_at_ray_init(monkeypatch, cfg: dict) -> dict:
    """Run ``local_service`` up to ``ray.init`` and return the environment Ray would start with
    (on a copy of this process's environment: what it sets does not reach later tests)."""
    import os

    import ray

    monkeypatch.setattr(os, "environ", os.environ.copy())

    seen: dict = {}

    def fake_init(**_kwargs):
        seen.update(os.environ)
        raise _Stop

    monkeypatch.setattr(ray, "init", fake_init)
    with pytest.raises(_Stop):
        with local.local_service(cfg):
            pass
    return seen


def _cfg() -> dict:
    return {"applications": [{"name": "specserve", "args": {}}]}


def test_the_proxy_gets_time_to_start_on_a_busy_machine(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "unset below")
    monkeypatch.delenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S")
    env = _start_and_stop_at_ray_init(monkeypatch, _cfg())
    assert env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "30"
    assert float(env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"]) > 5.0  # Ray's default, too short there


def test_an_operators_own_value_is_kept(monkeypatch):
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "120")
    env = _start_and_stop_at_ray_init(monkeypatch, _cfg())
    assert env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] == "120"
