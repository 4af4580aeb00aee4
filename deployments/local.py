"""Run the specserve app on a local Ray cluster from a Serve config: what ``specserve serve``,
``specserve bench serve``, ``specserve bench cancel`` and ``specserve map`` share.

Owns: reading a Serve config YAML (default ``deployments/serve_config.yaml``) with the
``--port``/``--http-port``/``--model``/``--drafter``/``--placement`` overrides, the CPUs its
deployments reserve, starting Ray with the machine's CPUs (dashboard off, node IP 127.0.0.1 so
every internal hop stays on loopback) with the gRPC proxy's message cap set to the app's limit
and the proxy's readiness check given time for a busy small machine (``SLOW_START_ENV``),
deploying, waiting until the engines are SERVING, free loopback ports for a benchmark's own
service (``free_port``), and a clean shutdown (Serve, then Ray) on
SIGTERM or SIGINT at any point after Ray started. ``ray.init`` installs its own SIGTERM handlers
(Python's ``sys.exit`` and the core worker's fatal-signal handler, which aborts: exit 134), so
ours are installed after it. Ignores: the command line (``cluster.commands.serve``) and what the
app does (``deployments.app``).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from cluster.common.errors import UserFacingError

DEFAULT_CONFIG = Path(__file__).resolve().with_name("serve_config.yaml")

# Ray Serve's controller waits 5 s for a new proxy to report ready, three times, then kills it and
# starts another; on 2 cores busy with other work (a training run, a benchmark) a proxy took 21 s
# to start and the service failed with ActorDiedError. Ray's processes inherit the driver's
# environment; a value the operator set is kept.
SLOW_START_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}


def load_config(args) -> dict:
    import yaml

    if not args.config.is_file():
        raise UserFacingError(f"config file not found: {args.config}")
    cfg = yaml.safe_load(args.config.read_text()) or {}
    apps = cfg.get("applications") or []
    if len(apps) != 1:
        raise UserFacingError(f"{args.config}: expected exactly one application, got {len(apps)}")
    app_args = apps[0].setdefault("args", {})
    for key in ("model", "drafter", "placement"):
        if getattr(args, key) is not None:
            app_args[key] = getattr(args, key)
    if args.port is not None:
        cfg.setdefault("grpc_options", {})["port"] = args.port
    if getattr(args, "http_port", None) is not None:
        cfg["http_options"] = {**(cfg.get("http_options") or {}), "port": args.http_port}
    if app_args.get("placement") == "separate":
        app_args.setdefault("draft_server", {}).setdefault("host", "127.0.0.1")
    return cfg


def needed_cpus(app_args: dict) -> float:
    from deployments.app_config import AppConfig

    a = AppConfig(**app_args)
    parts = [a.router_deployment, a.batch_engine] + ([a.spec_engine] if a.speculative else [])
    if a.placement.value == "separate":
        parts.append(a.draft_server)
    return sum(p.num_cpus * p.num_replicas for p in parts)


class ShutdownRequested(BaseException):
    """SIGTERM / SIGINT: leave whatever the main thread is doing and shut down cleanly."""


@contextlib.contextmanager
def _stop_on_signals():
    """SIGTERM and SIGINT raise ShutdownRequested once; signals during the shutdown are ignored."""
    asked = {"n": 0}

    def handler(signum, _frame):
        asked["n"] += 1
        if asked["n"] == 1:
            raise ShutdownRequested(signal.Signals(signum).name)
        print(f"specserve: {signal.Signals(signum).name} again: already shutting down", file=sys.stderr,
              flush=True)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


@contextlib.contextmanager
def local_service(cfg: dict, num_cpus: int | None = None, ready_timeout: float = 900.0):
    """Start Ray + Serve + the app from a Serve config dict; yields (grpc address, app name)."""
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from cluster.api import stubs
    from deployments.app import build
    from deployments.app_config import proxy_env

    app_cfg = cfg["applications"][0]
    app_args = app_cfg.setdefault("args", {})
    grpc_cfg = cfg.get("grpc_options") or {}
    port = int(grpc_cfg.get("port", 9000))
    servicers = grpc_cfg.get("grpc_servicer_functions") or stubs.GRPC_SERVICER_FUNCTIONS
    http = cfg.get("http_options") or {}
    # Logical CPUs: at least what the deployments reserve, so a small machine still schedules.
    num_cpus = num_cpus or max(os.cpu_count() or 1, int(needed_cpus(app_args) + 0.999))
    stubs.generation_pb2()  # generate stubs now (fresh install) rather than in every process
    os.environ.update(proxy_env([app_args]))  # Ray's processes inherit it: the proxy's message cap
    for key, value in SLOW_START_ENV.items():
        os.environ.setdefault(key, value)
    ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             configure_logging=False)
    with _stop_on_signals():  # after ray.init, which installs handlers of its own
        try:
            serve.start(http_options={"host": http.get("host", "127.0.0.1"), "port": int(http.get("port", 8000))},
                        grpc_options=gRPCOptions(port=port, grpc_servicer_functions=list(servicers)))
            name = app_cfg.get("name", "specserve")
            serve.run(build(app_args), name=name, route_prefix=route_prefix(app_cfg), blocking=False)
            addr = f"127.0.0.1:{port}"
            print(f"specserve: deployed app {name!r}; loading models...", file=sys.stderr, flush=True)
            if not _wait_serving(addr, name, ready_timeout):
                raise UserFacingError(f"engines not SERVING after {ready_timeout}s; see Ray logs")
            yield addr, name
        finally:
            print("specserve: shutting down", file=sys.stderr, flush=True)
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
            print("specserve: stopped", file=sys.stderr, flush=True)


def free_port() -> int:
    """A loopback port free now, for a local service's proxies (a benchmark's own service beside
    others)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def route_prefix(app_cfg: dict) -> str:
    return app_cfg.get("route_prefix", f"/{app_cfg.get('name', 'specserve')}")


def http_base_url(cfg: dict) -> str:
    """The OpenAI-compatible API's base URL (what ``openai.OpenAI(base_url=...)`` takes)."""
    http = cfg.get("http_options") or {}
    host = http.get("host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host  # bound everywhere: loopback reaches it
    prefix = route_prefix(cfg["applications"][0]).rstrip("/")
    return f"http://{host}:{int(http.get('port', 8000))}{prefix}/v1"


def _wait_serving(addr: str, app: str, timeout_s: float) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(), metadata=[("application", app)], timeout=10)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(1.0)
    return False
