"""The chaos suite's service: app configs, one lazily deployed Ray Serve session, and the probes the
tests use (streams with timings, solo references, engine/DraftServer/Router pids and state).

Owns: the apps under test — ``fake`` (FakeEngine, auth on: the fast fuzz target), ``fuzz`` (the
real default model with small limits, n-gram drafter, shared placement), ``shared`` and ``sep``
(the real model, both placements, two Router replicas each, queues deep enough for 32 concurrent
streams) — and how to find and hurt their processes. Ignores: what counts as a pass (the tests).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc
import psutil

from tests.deployments.harness import FAKE, Client, deploy_apps, fake_args, serve_session_at
from tests.deployments.test_service_fake import engine_stats, wait_for

TOKEN = "chaos-token-7f3a"
TOKEN_ENV = "SPECSERVE_CHAOS_TOKEN"
TINY = {"num_replicas": 1, "num_cpus": 0.05, "num_gpus": 0}
ENGINE = {**TINY, "max_num_seqs": 8, "kv_cache_memory_mb": 128}
SPECULATIVE, PLAIN, AUTO = 1, 2, 0  # Mode values
LEAKS = ("Traceback", "actor_id", "ray::", "pid=")  # internals a client must never see


def real_app(**over) -> dict:
    """The real default model; 2 Router replicas; queues that take 32 concurrent streams."""
    args = {"model": "default", "drafter": "ngram", "num_draft_tokens": 4, "torch_threads": 1,
            "router_deployment": {**TINY, "num_replicas": 2},
            "spec_engine": ENGINE, "batch_engine": {**ENGINE, "max_num_seqs": 16},
            "draft_server": {**TINY, "host": "127.0.0.1", "timeout_s": 2.0},
            "limits": {"max_tokens": 128, "max_prompt_tokens": 1024, "max_message_bytes": 65536,
                       "max_queue": 64}}
    args.update(over)
    return args


APPS = {
    "fake": fake_args(auth={"token_env": TOKEN_ENV}, router_deployment=TINY,
                      spec_engine={**TINY, "max_num_seqs": 8}, batch_engine={**TINY, "max_num_seqs": 16},
                      limits={"max_tokens": 64, "max_prompt_tokens": 512, "max_message_bytes": 16384,
                              "max_queue": 32},
                      engine_impl={**FAKE, "options": {"token_delay_s": 0.002}}),
    # small limits keep every accepted fuzz request short on the real model
    "fuzz": real_app(auth={"token_env": TOKEN_ENV}, router_deployment=TINY, batch_engine=ENGINE,
                     limits={"max_tokens": 8, "max_prompt_tokens": 256, "max_message_bytes": 16384,
                             "max_queue": 16}),
    "shared": real_app(),
    "sep": real_app(placement="separate"),
}

# Prompts for the fault and load tests: short, varied, some with repetition the n-gram drafter hits.
PROMPTS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\ndef fact(n):\n",
    "Summarize: The river flooded the town twice this year. The town built a wall. The wall held "
    "the second flood. Summary:",
    "List the days of the week: Monday, Tuesday, Wednesday,",
    "Translate to French: Good morning, my friend. How are you today?",
    '{"name": "Ada", "age": 36, "languages": ["en", "fr"]}\nThe same record as YAML:\n',
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Count slowly: one, two, three, four,",
    "Edit for grammar: she dont like the apples what was on the table yesterday.",
]


class ChaosService:
    """One Ray + Serve session for the chaos modules; apps are deployed on first use."""

    def __init__(self) -> None:
        self._session = None
        self.addr: str | None = None
        self.http: str | None = None  # http://127.0.0.1:port of Serve's HTTP proxy (the OpenAI API)
        self.deployed: set[str] = set()
        self._solo: dict[tuple, list[int]] = {}

    def apps(self, *names: str) -> str:
        if self._session is None:
            self._session = serve_session_at(env={TOKEN_ENV: TOKEN})
            addrs = self._session.__enter__()
            self.addr, self.http = addrs.grpc, addrs.http
        todo = [n for n in names if n not in self.deployed]
        if todo:
            deploy_apps({n: APPS[n] for n in todo}, timeout_s=600)
            for n in todo:
                self.client(n).wait_ready(timeout_s=300)
                wait_engines_ready(self.client(n))
                self.deployed.add(n)
        return self.addr

    def client(self, app: str) -> Client:
        return Client(self.addr, app, TOKEN if "auth" in APPS[app] else None)

    def solo(self, app: str, prompt: str, n: int) -> list[int]:
        """Greedy output of ``prompt`` alone (plain path, ignore_eos); cached per app."""
        key = (app, prompt, n)
        if key not in self._solo:
            r = self.client(app).generate(prompt=prompt, max_tokens=n, mode=PLAIN, ignore_eos=True,
                                          timeout=120)
            assert len(r.token_ids) == n
            self._solo[key] = list(r.token_ids)
        return self._solo[key]

    def wait_healthy(self, app: str, timeout: float = 240) -> None:
        """Every deployment of ``app`` HEALTHY with its replicas running, and both engines ready as
        the Routers see them (after a replica was killed and replaced)."""
        wait_deployments_healthy(app, timeout)
        wait_engines_ready(self.client(app), timeout)

    def close(self) -> None:
        if self._session is not None:
            self._session.__exit__(None, None, None)
            self._session = None


@dataclass
class StreamResult:
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # monotonic arrival of each chunk
    code: grpc.StatusCode | None = None  # None: still running
    details: str = ""
    finish_reason: int = 0
    finished: bool = False
    first: threading.Event = field(default_factory=threading.Event)


def start_stream(client: Client, timeout: float = 240, **fields) -> tuple[threading.Thread, StreamResult]:
    """Run one GenerateStream in a thread; ``result.first`` is set at the first chunk or the end."""
    res = StreamResult()

    def run():
        try:
            for ch in client.stream(timeout=timeout, **fields):
                res.tokens += ch.token_ids
                res.times.append(time.monotonic())
                if ch.finished:
                    res.finished, res.finish_reason = True, ch.finish_reason
                res.first.set()
            res.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            res.code, res.details = exc.code(), exc.details() or ""
        except Exception as exc:  # noqa: BLE001 — recorded, the test judges it
            res.code, res.details = grpc.StatusCode.UNKNOWN, f"client: {exc!r}"
        finally:
            res.first.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, res


def join_all(threads: list[threading.Thread], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def engine_pid(app: str, deployment: str) -> int:
    return engine_stats(app, deployment)["engine_pid"]


def draft_info(app: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle("DraftServer", app_name=app).info.remote().result(timeout_s=10)


def listening_pid(address: str) -> int:
    """The process listening on ``host:port`` (the DraftServer's KVSync server): exact, and scoped
    to our own cluster, unlike a search by process name."""
    port = int(address.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return conn.pid
    raise LookupError(f"no process listens on {address}")


def replica_actors(app: str, deployment: str) -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if f"{app}#{deployment}#" in a["name"]]


def kill_replica(app: str, deployment: str, name: str | None = None) -> str:
    import ray

    name = name or replica_actors(app, deployment)[0]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    return name


def wait_engines_ready(client: Client, timeout: float = 300, times: int = 4) -> None:
    """``times`` ModelInfo answers in a row (the proxy spreads them over the Router replicas) say
    both engines are ready: the Routers' polled view has caught up with a new or replaced engine."""
    streak = [0]

    def ready():
        try:
            info = client.stub.ModelInfo(client.pb2.ModelInfoRequest(), metadata=client.md, timeout=10)
            streak[0] = streak[0] + 1 if info.spec_ready and info.batch_ready else 0
        except grpc.RpcError:
            streak[0] = 0
        return streak[0] >= times
    wait_for(ready, timeout=timeout, what="both engines ready in the Routers' view")


def wait_deployments_healthy(app: str, timeout: float = 240) -> None:
    """Every deployment of ``app`` HEALTHY with its target replica count running."""
    from ray import serve

    want = {"Router": APPS[app]["router_deployment"]["num_replicas"]}

    def healthy():
        st = serve.status().applications.get(app)
        if st is None or st.status != "RUNNING":
            return False
        for name, dep in st.deployments.items():
            running = dep.replica_states.get("RUNNING", 0)
            if dep.status != "HEALTHY" or running < want.get(name, 1):
                return False
        return True
    wait_for(healthy, timeout=timeout, what=f"app {app} healthy")


def idle_state(app: str) -> dict:
    """Per-request state the service holds when nothing is in flight (all must return to this)."""
    out = {}
    for dep in ("SpecEngine", "BatchEngine"):
        s = engine_stats(app, dep)
        out[dep] = {"running": s["num_running"], "waiting": s["num_waiting"],
                    "kv_free": s["kv_blocks_free"], "kv_total": s["kv_blocks_total"],
                    "in_flight": s["in_flight"], "draft_tracked": s.get("draft_tracked", 0)}
    if APPS[app].get("placement") == "separate":
        out["DraftServer"] = {"sequences": draft_info(app)["num_sequences"]}
    return out


def is_idle(state: dict) -> bool:
    engines_idle = all(v["running"] == 0 and v["waiting"] == 0 and v["kv_free"] == v["kv_total"]
                       and v["in_flight"] == 0 and v["draft_tracked"] == 0
                       for k, v in state.items() if k != "DraftServer")
    return engines_idle and state.get("DraftServer", {"sequences": 0})["sequences"] == 0
