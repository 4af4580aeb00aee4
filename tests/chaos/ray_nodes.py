"""A two-node Ray cluster on this machine for the chaos suite, stopped by pid, never globally.

Owns: ``ray start --head`` and a second ``ray start --address`` (with a custom resource) on free
ports of 127.0.0.1, each with its own temp dir and ``--block`` so the process we started owns its
node's processes; stopping SIGTERMs those two processes and then SIGKILLs whatever of their
descendants is left. A global ``ray stop`` would kill every Ray cluster on the machine, including
other users' — it is never used. Ignores: what runs on the cluster.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.deployments.harness import free_port

RAY = str(Path(sys.executable).with_name("ray"))
# Ray's token auth: ``ray start`` turns it on when ~/.ray/auth_token exists, but a driver joining
# with ``ray.init(address=...)`` does not, so both sides are told explicitly
AUTH = {"RAY_AUTH_MODE": "token"}


@contextlib.contextmanager
def driver_token_auth():
    """This process joins the cluster with token auth on (restored afterwards)."""
    from ray._private.authentication.authentication_token_setup import (_get_default_token_path,
                                                                          generate_and_save_token)
    from ray._raylet import Config

    if not _get_default_token_path().exists():
        generate_and_save_token()
    old = os.environ.get("RAY_AUTH_MODE")
    os.environ.update(AUTH)
    Config.initialize("")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = old
        Config.initialize("")


@dataclass
class RayNode:
    proc: subprocess.Popen
    temp_dir: str
    log: Path
    # pid -> process, remembered with its start time: psutil refuses to signal a reused pid
    descendants: dict[int, psutil.Process] = field(default_factory=dict)

    def processes(self) -> dict[int, psutil.Process]:
        """The processes this node runs (raylet, GCS, workers...), as seen so far."""
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.descendants.setdefault(p.pid, p)
        return self.descendants


def _ports_args(head: bool) -> list[str]:
    lo = free_port()
    args = ["--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
            "--min-worker-port", str(lo), "--max-worker-port", str(lo + 40),
            "--metrics-export-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
            "--dashboard-agent-grpc-port", str(free_port()), "--runtime-env-agent-port", str(free_port())]
    if head:
        args += ["--ray-client-server-port", str(free_port()), "--include-dashboard", "false"]
    return args


def _start(args: list[str], temp_dir: str, name: str) -> RayNode:
    log = Path(temp_dir) / f"{name}.log"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **AUTH}
    with open(log, "w") as f:
        proc = subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", *args], stdout=f,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return RayNode(proc, temp_dir, log)


def _wait_nodes(address: str, n: int, nodes: list[RayNode], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    script = ("import ray; ray.init(address=%r, logging_level='ERROR', log_to_driver=False); "
              "print(sum(1 for n in ray.nodes() if n['Alive']))" % address)
    while time.monotonic() < deadline:
        for node in nodes:
            if node.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {node.proc.returncode}: {node.log.read_text()[-2000:]}")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                             env={**os.environ, **AUTH})
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(n)]:
            return
        time.sleep(1.0)
    raise TimeoutError(f"{n} Ray nodes not up after {timeout_s}s")


@contextlib.contextmanager
def two_node_cluster(head_cpus: float, worker_cpus: float, worker_resources: dict[str, float],
                     worker_gpus: int = 0, timeout_s: float = 180):
    """Yields (gcs address, head node, worker node). The worker node carries ``worker_resources``
    and advertises ``worker_gpus`` GPUs (a resource count; nothing needs a real GPU)."""
    import json

    # short paths: Ray's unix sockets live under the temp dir (108-byte limit)
    root = tempfile.mkdtemp(prefix="rc", dir="/tmp")
    nodes: list[RayNode] = []
    with driver_token_auth():  # writes ~/.ray/auth_token if missing, before the nodes read it
        pass
    try:
        gcs_port = free_port()
        address = f"127.0.0.1:{gcs_port}"
        nodes.append(_start(["--head", "--port", str(gcs_port), "--node-ip-address", "127.0.0.1",
                             "--num-cpus", str(head_cpus), "--num-gpus", "0",
                             "--temp-dir", f"{root}/h", *_ports_args(head=True)], root, "head"))
        _wait_nodes(address, 1, nodes, timeout_s)
        nodes.append(_start(["--address", address, "--node-ip-address", "127.0.0.1",
                             "--num-cpus", str(worker_cpus), "--num-gpus", str(worker_gpus),
                             "--resources", json.dumps(worker_resources),
                             "--temp-dir", f"{root}/w", *_ports_args(head=False)], root, "worker"))
        _wait_nodes(address, 2, nodes, timeout_s)
        yield address, nodes[0], nodes[1]
    finally:
        _stop(nodes)
        shutil.rmtree(root, ignore_errors=True)


def _stop(nodes: list[RayNode]) -> None:
    """SIGTERM the ``ray start`` processes we started (worker first), then SIGKILL what is left of
    everything they ran. Only these pids: other clusters on the machine are untouched."""
    procs: list[psutil.Process] = []
    for node in reversed(nodes):
        procs += node.processes().values()
        with contextlib.suppress(ProcessLookupError):
            node.proc.send_signal(signal.SIGTERM)
    for node in reversed(nodes):
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.proc.wait(timeout=10)
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            proc.kill()
    for node in nodes:
        with contextlib.suppress(Exception):
            node.proc.wait(timeout=5)
