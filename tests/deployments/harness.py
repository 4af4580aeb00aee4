"""Local Ray + Serve for the tests: 127.0.0.1 only, bounded CPUs, no dashboard; one session per module
(``serve_apps``) or one shared by the modules that can share it (``SharedServe``)."""
from __future__ import annotations

import contextlib
import os
import time
from typing import NamedTuple

import grpc

from cluster.api import stubs
from deployments.local import SLOW_START_ENV, free_port  # noqa: F401 (free_port: the tests' too)

FAKE = {"cls": "cluster.engine.fake_engine:FakeEngine"}
PROXY_PORT_TRIES = 3  # serve.start on fresh ports when a picked one was taken before the proxy bound it
SMALL = {"num_replicas": 1, "num_cpus": 0.1, "num_gpus": 0}


def fake_args(**over) -> dict:
    args = {"model": "fake", "drafter": "ngram", "num_draft_tokens": 4, "torch_threads": 1,
            "router_deployment": SMALL, "spec_engine": {**SMALL, "max_num_seqs": 8},
            "batch_engine": {**SMALL, "max_num_seqs": 32}, "draft_server": {**SMALL, "host": "127.0.0.1"},
            "engine_impl": {**FAKE, "options": {"token_delay_s": 0.01}}}
    args.update(over)
    return args


class Addresses(NamedTuple):
    grpc: str  # host:port of the gRPC proxy
    http: str  # http://host:port of the HTTP proxy; app ``name`` lives under ``{http}/{name}``


@contextlib.contextmanager
def serve_apps(apps: dict[str, dict], env: dict[str, str] | None = None, timeout_s: float = 240,
               ray_kwargs: dict | None = None, ray_address: str | None = None):
    """``serve_apps_at`` yielding only the gRPC address."""
    with serve_apps_at(apps, env, timeout_s, ray_kwargs, ray_address) as addrs:
        yield addrs.grpc


@contextlib.contextmanager
def serve_apps_at(apps: dict[str, dict], env: dict[str, str] | None = None, timeout_s: float = 240,
                  ray_kwargs: dict | None = None, ray_address: str | None = None):
    """Start Ray (2 CPUs, no dashboard, node IP 127.0.0.1) and Serve with the gRPC and HTTP proxies
    on free ports, deploy ``apps`` (name -> AppConfig args, route prefix ``/{name}``); yields their
    ``Addresses``. ``ray_kwargs`` adds ``ray.init`` keywords (e.g. ``_metrics_export_port``);
    ``ray_address`` joins a cluster started elsewhere (``ray start``) instead of starting one."""
    with serve_session_at(env=env, ray_kwargs=ray_kwargs, ray_address=ray_address) as addrs:
        deploy_apps(apps, timeout_s=timeout_s)
        yield addrs


@contextlib.contextmanager
def serve_session(env: dict[str, str] | None = None, ray_kwargs: dict | None = None,
                  ray_address: str | None = None):
    """``serve_session_at`` yielding only the gRPC address."""
    with serve_session_at(env, ray_kwargs, ray_address) as addrs:
        yield addrs.grpc


@contextlib.contextmanager
def serve_session_at(env: dict[str, str] | None = None, ray_kwargs: dict | None = None,
                     ray_address: str | None = None):
    """Ray + Serve with the gRPC and HTTP proxies on free ports of 127.0.0.1 and no apps yet (add
    them with ``deploy_apps``); yields their ``Addresses``. Shuts Serve and this driver's Ray down
    on exit."""
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    os.environ.update(env or {})
    for key, value in SLOW_START_ENV.items():  # as ``specserve serve``: a busy machine starts proxies slowly
        os.environ.setdefault(key, value)
    if ray_address is None:
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 configure_logging=False, log_to_driver=False, **(ray_kwargs or {}))
    else:
        ray.init(address=ray_address, configure_logging=False, log_to_driver=False, **(ray_kwargs or {}))
    try:
        for attempt in range(PROXY_PORT_TRIES):
            # picked after Ray's own services took theirs; a port free when picked can still be
            # taken before the proxy binds it (Ray's workers and connections use the same range:
            # a CI run lost two modules' fixtures to "Failed to bind"): then again, on new ports
            grpc_port, http_port = free_port(), free_port()
            try:
                serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                            grpc_options=gRPCOptions(port=grpc_port,
                                                     grpc_servicer_functions=stubs.GRPC_SERVICER_FUNCTIONS))
                break
            except Exception as exc:  # noqa: BLE001 (RayTaskError wraps the proxy's RuntimeError)
                if "Failed to bind" not in str(exc) or attempt == PROXY_PORT_TRIES - 1:
                    raise
                with contextlib.suppress(Exception):
                    serve.shutdown()
        yield Addresses(f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}")
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def deploy_apps(apps: dict[str, dict], timeout_s: float = 240) -> None:
    """Deploy ``apps`` (name -> AppConfig args) into the running Serve and wait until all run.

    All at once (``serve.run_many``, not waiting for any to run): ``serve.run`` returns only once
    its app runs, so apps deployed one by one started their replicas one app after another. They
    share the machine: the deadline is ``timeout_s`` per app."""
    from ray import serve

    from deployments.app import build

    limit = timeout_s * max(1, len(apps))
    deadline = time.monotonic() + limit
    if hasattr(serve, "run_many"):
        serve.run_many([serve.RunTarget(build(args), name=name, route_prefix=f"/{name}")
                        for name, args in apps.items()], wait_for_applications_running=False)
    else:  # a Ray before run_many: one by one
        for name, args in apps.items():
            serve.run(build(args), name=name, route_prefix=f"/{name}", blocking=False)
    while True:
        status = serve.status().applications
        if all(name in status and status[name].status == "RUNNING" for name in apps):
            return
        if any(name in status and status[name].status == "DEPLOY_FAILED" for name in apps):
            raise RuntimeError(f"deploy failed: {status}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"apps not running after {limit}s: {status}")
        time.sleep(0.2)


def delete_apps(names: list[str], timeout_s: float = 120) -> None:
    """Delete the apps ``names`` together (their replicas drain and stop at once, not one app
    after another) and wait until Serve lists none of them; a delete that cannot be asked is
    skipped (the session is gone)."""
    from ray import serve

    asked = []
    for name in names:
        with contextlib.suppress(Exception):
            serve.delete(name, _blocking=False)
            asked.append(name)
    deadline = time.monotonic() + timeout_s
    while asked and time.monotonic() < deadline:
        try:
            status = serve.status().applications
        except Exception:  # noqa: BLE001 (Serve itself gone: nothing left to wait for)
            return
        if not any(name in status for name in asked):
            return
        time.sleep(0.2)
    for name in asked:  # still listed past the deadline: the blocking delete, as before
        with contextlib.suppress(Exception):
            serve.delete(name)


# Every variable the modules on the shared session read (each module its own token), set once
# before Ray starts so that every replica inherits them; OTEL_BSP_SCHEDULE_DELAY: replicas export
# spans every 200 ms instead of every 5 s (a traced test waits for them).
SHARED_ENV = {"SPECSERVE_TEST_TOKEN": "test-token-123", "KVSYNC_SERVICE_TOKEN": "kvsync-s3cret",
              "SPECSERVE_OA_TOKEN": "oa-token-456", "SPECSERVE_RESP_TOKEN": "resp-token-789",
              "OTEL_BSP_SCHEDULE_DELAY": "200"}


class SharedServe:
    """One Ray + Serve session for the ``ray`` modules that only deploy apps and send requests
    (the ``serve_shared`` fixture): started on first use, each module's apps deployed for the module
    and deleted after it, closed when the next test does not use it (``tests/conftest.py``) — a
    module that starts Ray its own way (its own environment, metrics port, ``specserve serve``)
    never finds it running. The proxy's message cap is the default limits' (1 MiB); an app that
    needs a bigger one is refused here (it would need a session of its own)."""

    def __init__(self) -> None:
        self._session = None
        self.addrs: Addresses | None = None

    @staticmethod
    def _proxy_env() -> dict[str, str]:
        from deployments.app_config import proxy_env

        return proxy_env([{}])  # the default limits' cap

    def _start(self) -> Addresses:
        if self._session is None:
            session = serve_session_at(env={**SHARED_ENV, **self._proxy_env()})
            self.addrs = session.__enter__()
            self._session = session
        return self.addrs

    @contextlib.contextmanager
    def apps(self, apps: dict[str, dict], timeout_s: float = 240):
        """Deploy ``apps`` (name -> AppConfig args) for the ``with`` block; yields the Addresses."""
        from deployments.app_config import AppConfig

        cap = int(next(iter(self._proxy_env().values())))
        for name, args in apps.items():
            if AppConfig(**args).proxy_max_message_bytes() > cap:
                raise ValueError(f"app {name!r} needs a gRPC proxy cap over the shared session's {cap} bytes")
        addrs = self._start()
        try:
            deploy_apps(apps, timeout_s=timeout_s)
            yield addrs
        finally:
            delete_apps(list(apps))

    def close(self) -> None:
        if self._session is not None:
            session, self._session, self.addrs = self._session, None, None
            session.__exit__(None, None, None)


SHARED = SharedServe()  # the ``serve_shared`` fixture's (tests/conftest.py)


class Client:
    """Thin test client over one channel; ``app`` selects the Serve application."""

    def __init__(self, addr: str, app: str, token: str | None = None) -> None:
        self.channel = grpc.insecure_channel(addr)
        self.stub = stubs.generation_grpc().GenerationStub(self.channel)
        from grpc_health.v1 import health_pb2_grpc

        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.md = [("application", app)] + ([("authorization", f"Bearer {token}")] if token else [])
        self.pb2 = stubs.generation_pb2()

    def generate(self, timeout=60, md=None, **fields):
        return self.stub.Generate(self.pb2.GenerateRequest(**fields), metadata=md or self.md, timeout=timeout)

    def stream(self, timeout=60, md=None, **fields):
        return self.stub.GenerateStream(self.pb2.GenerateRequest(**fields), metadata=md or self.md,
                                        timeout=timeout)

    def wait_ready(self, timeout_s=120) -> None:
        from grpc_health.v1 import health_pb2

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                r = self.health.Check(health_pb2.HealthCheckRequest(), metadata=self.md[:1], timeout=10)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
        raise TimeoutError("service not SERVING")
