"""`specserve serve`: start a local Ray cluster and the specserve app behind the gRPC and HTTP proxies.

Owns: reading a Serve config YAML (default ``deployments/serve_config.yaml``), applying
``--port``/``--http-port``/``--model``/``--drafter``/``--placement`` overrides, starting Ray with the machine's
CPUs (dashboard off, node IP 127.0.0.1 so every internal hop stays on loopback) with the gRPC
proxy's message cap set to the app's limit, deploying, waiting until the engines are SERVING,
printing the gRPC address and the OpenAI-compatible API's base URL, and a clean shutdown (Serve, then Ray; exit 0) on SIGTERM or SIGINT,
at any point after Ray started. ``ray.init`` installs its own SIGTERM handlers (Python's
``sys.exit`` and the core worker's fatal-signal handler, which aborts: exit 134), so ours are
installed after it. Ignores: what the app does (``deployments``).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "deployments" / "serve_config.yaml"


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the service locally (Ray Serve: gRPC and OpenAI-compatible HTTP)")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="Serve config YAML")
    p.add_argument("--port", type=int, default=None, help="gRPC port (default: the config's, 9000)")
    p.add_argument("--http-port", type=int, default=None,
                   help="HTTP port of the OpenAI-compatible API (default: the config's, 8000)")
    p.add_argument("--model", default=None, help="override the app's model")
    p.add_argument("--drafter", default=None, help="override the drafter (ngram, suffix, portfolio, self[:L], model, none)")
    p.add_argument("--placement", choices=("shared", "separate"), default=None)
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may use (default: all)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for SERVING")
    p.set_defaults(func=run)


def load_config(args) -> dict:
    import yaml

    from cluster.errors import UserFacingError

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


def _needed_cpus(app_args: dict) -> float:
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
    from cluster.errors import UserFacingError
    from deployments.app import build
    from deployments.app_config import proxy_env

    app_cfg = cfg["applications"][0]
    app_args = app_cfg.setdefault("args", {})
    grpc_cfg = cfg.get("grpc_options") or {}
    port = int(grpc_cfg.get("port", 9000))
    servicers = grpc_cfg.get("grpc_servicer_functions") or stubs.GRPC_SERVICER_FUNCTIONS
    http = cfg.get("http_options") or {}
    # Logical CPUs: at least what the deployments reserve, so a small machine still schedules.
    num_cpus = num_cpus or max(os.cpu_count() or 1, int(_needed_cpus(app_args) + 0.999))
    stubs.generation_pb2()  # generate stubs now (fresh install) rather than in every process
    os.environ.update(proxy_env([app_args]))  # Ray's processes inherit it: the proxy's message cap
    ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             configure_logging=False)
    with _stop_on_signals():  # after ray.init, which installs handlers of its own
        try:
            serve.start(http_options={"host": http.get("host", "127.0.0.1"), "port": int(http.get("port", 8000))},
                        grpc_options=gRPCOptions(port=port, grpc_servicer_functions=list(servicers)))
            name = app_cfg.get("name", "specserve")
            serve.run(build(app_args), name=name, route_prefix=_route_prefix(app_cfg), blocking=False)
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


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    try:
        with local_service(cfg, args.num_cpus, args.ready_timeout) as (addr, name):
            base_url = http_base_url(cfg)
            print(f"specserve: gRPC on {addr} (app {name!r}); try in another terminal: "
                  f"{_this_cli()} client --addr {addr} \"Hello\"", flush=True)
            print(f"specserve: OpenAI-compatible HTTP API at {base_url} (model "
                  f"{_served_model(cfg)!r}); try: curl {base_url}/chat/completions -H 'Content-Type: "
                  f"application/json' -d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'",
                  flush=True)
            while True:
                time.sleep(0.5)
    except (ShutdownRequested, KeyboardInterrupt):  # KeyboardInterrupt: before Ray started
        pass
    return 0


def _route_prefix(app_cfg: dict) -> str:
    return app_cfg.get("route_prefix", f"/{app_cfg.get('name', 'specserve')}")


def http_base_url(cfg: dict) -> str:
    """The OpenAI-compatible API's base URL (what ``openai.OpenAI(base_url=...)`` takes)."""
    http = cfg.get("http_options") or {}
    host = http.get("host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host  # bound everywhere: loopback reaches it
    prefix = _route_prefix(cfg["applications"][0]).rstrip("/")
    return f"http://{host}:{int(http.get('port', 8000))}{prefix}/v1"


def _served_model(cfg: dict) -> str:
    args = cfg["applications"][0].get("args") or {}
    return (args.get("http") or {}).get("served_model_name") or args.get("model", "default")


def _this_cli() -> str:
    """This CLI as a command that runs as shown in a new terminal from the current directory: its
    path (`.venv/bin/specserve` after `make run`; nothing activates the venv, so a bare `specserve`
    would not be found), relative when it lies below here."""

    def shown(path: str) -> str:
        rel = os.path.relpath(path)
        return path if rel.startswith("..") else rel

    exe = os.path.abspath(sys.argv[0])
    if os.path.basename(exe) != "specserve":  # started as `python -m cluster.cli`
        return f"{shown(sys.executable)} -m cluster.cli"
    return shown(exe)


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
