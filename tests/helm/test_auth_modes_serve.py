"""The chart's auth modes, end to end: the serve config Helm renders, built into AppConfig and run
as a real Ray Serve app (the fake engine and small resources in place of the model and the
chart's GPU-sized ones). Without a Secret the Router starts and answers without a token; with one
it starts from the Secret's variable and refuses calls without it."""
from __future__ import annotations

import grpc
import pytest

from tests.deployments.harness import Client, fake_args, serve_apps

from .conftest import NAMESPACE, RELEASE

pytestmark = pytest.mark.ray

TOKEN = "helm-s3cret"
# what the test swaps in: the engine and the resources; auth, router, limits, telemetry, dtype,
# drafter and placement stay as rendered
SWAPPED = ("model", "engine_impl", "router_deployment", "spec_engine", "batch_engine", "draft_server",
           "torch_threads")


def _runnable(chart, values: dict) -> dict:
    from deployments.app_config import AppConfig

    from .conftest import Rendered

    args = Rendered(chart.render(values, name=RELEASE, namespace=NAMESPACE), values).app_args
    fake = fake_args()
    merged = {**args, **{k: fake[k] for k in SWAPPED}}
    AppConfig.model_validate(merged)  # what deployments.app:build validates
    return merged


def test_rendered_auth_modes_serve(chart, monkeypatch):
    pytest.importorskip("ray.serve")
    open_args = _runnable(chart, {})
    closed_args = _runnable(chart, {"auth": {"existingSecret": "tokens"}})
    assert open_args["auth"] == {"token_env": None}
    assert closed_args["auth"] == {"token_env": "SPECSERVE_AUTH_TOKEN"}
    # the Secret's variable is in every replica's environment; the no-auth app must not need it
    # (the old chart named it in both and the no-Secret Router raised at start without it)
    monkeypatch.setenv("SPECSERVE_AUTH_TOKEN", TOKEN)  # inherited by Ray's workers
    with serve_apps({"open": open_args, "closed": closed_args}) as addr:
        open_client, closed_client = Client(addr, "open"), Client(addr, "closed")
        open_client.wait_ready()
        closed_client.wait_ready()
        out = open_client.generate(prompt="hello", max_tokens=8)
        assert len(out.token_ids) == 8 and out.text
        with pytest.raises(grpc.RpcError) as err:
            closed_client.generate(prompt="hello", max_tokens=8)
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        authed = Client(addr, "closed", token=TOKEN).generate(prompt="hello", max_tokens=8)
        assert authed.token_ids == out.token_ids  # same fake engine, same greedy answer
