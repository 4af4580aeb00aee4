"""KVSync closed to strangers in the running service: placement ``separate`` with auth and TLS
configured, real Ray Serve on 127.0.0.1 (fake engine, n-gram DraftServer). The SpecEngine
speculates over the authenticated TLS channel; a stranger without TLS or without the token gets
nothing; the DraftServer's loopback health check keeps passing (the replica is not replaced)."""
import time

import grpc
import pytest

from cluster.api import stubs
from cluster.kvsync.tls import KVSyncTLS
from tests.deployments.harness import SHARED_ENV, Client, fake_args
from tests.kvsync.certs import NAME, self_signed

pytestmark = pytest.mark.ray
TOKEN = SHARED_ENV["KVSYNC_SERVICE_TOKEN"]
pb2 = stubs.kvsync_pb2()


def expected(prompt: str, n: int) -> list[int]:
    ids = [b + 3 for b in prompt.encode()]  # the fake engine's target repeats the prompt
    return [ids[i % len(ids)] for i in range(n)]


def test_separate_placement_with_auth_and_tls(tmp_path, serve_shared):
    from ray import serve

    cert, key = self_signed(tmp_path)
    args = fake_args(placement="separate", auth={"token_env": "KVSYNC_SERVICE_TOKEN"},
                     kvsync={"tls_cert_file": cert, "tls_key_file": key, "tls_server_name": NAME},
                     engine_impl={"cls": "cluster.engine.fake_engine:FakeEngine",
                                  "options": {"token_delay_s": 0.02}})
    with serve_shared.apps({"sec": args}) as addrs:
        addr = addrs.grpc
        client = Client(addr, "sec", TOKEN)
        client.wait_ready()
        prompt = "one two three one two three "
        r = client.generate(prompt=prompt, max_tokens=24)
        assert list(r.token_ids) == expected(prompt, 24) and r.spec.accepted_tokens > 0  # over KVSync

        draft = serve.get_deployment_handle("DraftServer", app_name="sec")
        info = draft.info.remote().result(timeout_s=10)
        plain = stubs.kvsync_grpc().KVSyncStub(grpc.insecure_channel(info["address"]))
        with pytest.raises(grpc.RpcError) as err:  # no TLS: no connection at all
            plain.Info(pb2.InfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        tls = KVSyncTLS(cert_file=cert, key_file=key, server_name=NAME)
        stranger = stubs.kvsync_grpc().KVSyncStub(tls.open_channel(info["address"]))
        with pytest.raises(grpc.RpcError) as err:  # TLS but no token
            stranger.Release(pb2.ReleaseRequest(epoch=info["epoch"], seq_ids=["x"]), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stranger.Info(pb2.InfoRequest(), timeout=5,
                             metadata=(("authorization", f"Bearer {TOKEN}"),)).epoch == info["epoch"]

        time.sleep(6)  # three health check periods: the loopback check passes, no replacement
        assert draft.info.remote().result(timeout_s=10)["epoch"] == info["epoch"]
        r = client.generate(prompt=prompt, max_tokens=12)
        assert list(r.token_ids) == expected(prompt, 12) and r.spec.accepted_tokens > 0
