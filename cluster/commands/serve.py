"""`specserve serve`: start a local Ray cluster and the specserve app behind the gRPC and HTTP proxies.

Owns: the command's arguments, printing the gRPC address and the OpenAI-compatible API's base
URL with a client command that runs as shown in a new terminal, and serving until SIGTERM or
SIGINT (exit 0). Ignores: starting and stopping Ray, Serve and the app from the config
(``deployments.local``) and what the app does (``deployments``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from deployments.local import DEFAULT_CONFIG, ShutdownRequested, http_base_url, load_config, local_service


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the service locally (Ray Serve: gRPC and OpenAI-compatible HTTP)")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="Serve config YAML")
    p.add_argument("--port", type=int, default=None, help="gRPC port (default: the config's, 9000)")
    p.add_argument("--http-port", type=int, default=None,
                   help="HTTP port of the OpenAI-compatible API (default: the config's, 8000)")
    p.add_argument("--model", default=None, help="override the app's model")
    p.add_argument("--drafter", default=None,
                   help="override the drafter (ngram, suffix[:FILE|:cold], portfolio[:DIR], eagle[:DIR], self[:L], model, none)")
    p.add_argument("--placement", choices=("shared", "separate"), default=None)
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may use (default: all)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for SERVING")
    p.set_defaults(func=run)


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
