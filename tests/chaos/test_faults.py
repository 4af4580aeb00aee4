"""Faults mid-stream on the real default model, both placements where the fault applies: nothing is
lost and no output changes (greedy outputs equal their solo runs).

- DraftServer killed (SIGKILL of the process serving KVSync): the streams finish, plain.
- DraftServer stopped (SIGSTOP, SIGCONT a few seconds later): the streams finish, and while it is
  stopped a step takes at most one decode step longer (the draft call has a budget).
- An engine core process killed (SIGKILL of the ``engine_pid`` the engine reports): its streams end
  UNAVAILABLE with a clean message and a prefix of the right tokens, the other engine's streams
  finish, Serve replaces the replica and new requests succeed.
- A Router replica killed (two running): streams either finish with the right tokens or end
  UNAVAILABLE (those on the killed replica), the others finish, new requests succeed.

A stream is *lost* when it hangs, ends with another code, or ends OK without a finished chunk; it is
*corrupted* when its tokens are not its solo run's (or, for an allowed failure, not a prefix of it).
"""
from __future__ import annotations

import os
import signal
import statistics
import time

import grpc
import pytest

from tests.chaos.service import (LEAKS, PLAIN, PROMPTS, SPECULATIVE, draft_info, engine_pid, join_all,
                                 kill_replica, listening_pid, replica_actors, start_stream)
from tests.deployments.test_service_fake import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.ray, pytest.mark.model]
N = 48  # tokens per stream: long enough that the fault lands mid-stream
STREAMS = 4


@pytest.fixture(scope="module")
def service(chaos_service):
    chaos_service.apps("shared", "sep")
    return chaos_service


def launch(service, app: str, modes: list[int], n: int = N):
    c = service.client(app)
    prompts = [PROMPTS[i % STREAMS] for i in range(len(modes))]
    want = [service.solo(app, p, n) for p in prompts]
    runs = [start_stream(c, prompt=p, max_tokens=n, mode=m, ignore_eos=True, timeout=300)
            for p, m in zip(prompts, modes)]
    for _, r in runs:
        assert r.first.wait(180), "a stream never started"
    return [t for t, _ in runs], [r for _, r in runs], want


def judge(results, want, may_fail: set[int], fail_codes=(grpc.StatusCode.UNAVAILABLE,),
          count_leaks: bool = True) -> dict:
    """Counts per outcome; ``may_fail``: streams allowed to end with one of ``fail_codes`` (an
    explicit failure, never a silent one) after a correct prefix of their tokens."""
    out = {"streams": len(results), "ok": 0, "unavailable": 0, "lost": 0, "corrupted": 0, "leaks": 0,
           "details": []}
    for i, r in enumerate(results):
        if r.code is grpc.StatusCode.OK and r.finished:
            kind = "ok" if r.tokens == want[i] else "corrupted"
        elif r.code in fail_codes and i in may_fail:
            kind = "unavailable" if r.tokens == want[i][:len(r.tokens)] else "corrupted"
        else:
            kind = "lost"
        if count_leaks and r.code not in (None, grpc.StatusCode.OK) and any(m in r.details for m in LEAKS):
            out["leaks"] += 1
        out[kind] += 1
        if kind != "ok":
            code = r.code.name if r.code else "HANG"
            out["details"].append(f"stream {i}: {kind} ({code}, {len(r.tokens)} tokens) {r.details[:200]!r}")
    return out


def new_requests_succeed(service, app: str, count: int = 4) -> list[str]:
    """``count`` fresh requests, alternating paths, each must equal its solo run."""
    c = service.client(app)
    errors = []
    for i in range(count):
        p = PROMPTS[i % STREAMS]
        try:
            r = c.generate(prompt=p, max_tokens=N, mode=(SPECULATIVE, PLAIN)[i % 2], ignore_eos=True,
                           timeout=120)
            if list(r.token_ids) != service.solo(app, p, N):
                errors.append(f"request {i}: output changed")
        except grpc.RpcError as exc:
            errors.append(f"request {i}: {exc.code().name} {exc.details()[:200]!r}")
    return errors


NO_DRAFT_SERVER = "n/a: placement shared has no DraftServer"


def test_draft_server_killed_mid_stream(service, chaos_report):
    app = "sep"
    chaos_report.record("faults", "draft_server_killed/shared", NO_DRAFT_SERVER)
    threads, results, want = launch(service, app, [SPECULATIVE] * STREAMS)
    os.kill(listening_pid(draft_info(app)["address"]), signal.SIGKILL)
    join_all(threads, 300)
    got = judge(results, want, may_fail=set())
    chaos_report.record("faults", f"draft_server_killed/{app}", got)
    assert got["lost"] == got["corrupted"] == got["leaks"] == 0 and got["ok"] == STREAMS, got["details"]
    service.wait_healthy(app)
    assert not new_requests_succeed(service, app)


def _step_gaps(results, lo: float, hi: float) -> list[float]:
    """Chunk-to-chunk gaps whose later chunk arrived in (lo, hi]."""
    return [b - a for r in results for a, b in zip(r.times, r.times[1:]) if lo < b <= hi]


def test_draft_server_stopped_then_resumed(service, chaos_report):
    app = "sep"
    chaos_report.record("faults", "draft_server_stopped/shared", NO_DRAFT_SERVER)
    service.wait_healthy(app)
    pid = listening_pid(draft_info(app)["address"])
    threads, results, want = launch(service, app, [SPECULATIVE] * STREAMS, n=128)
    time.sleep(1.5)  # baseline steps with drafts
    t_stop = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(2.5)
    finally:
        t_cont = time.monotonic()
        os.kill(pid, signal.SIGCONT)
    join_all(threads, 300)
    got = judge(results, want, may_fail=set())
    before = _step_gaps(results, 0.0, t_stop)
    during = _step_gaps(results, t_stop, t_cont)
    # steps that had not ended when SIGCONT came count as stalled until then
    stalled = [t_cont - max([t for t in r.times if t <= t_cont] or [t_stop]) for r in results
               if r.times and r.times[-1] > t_cont]
    step = statistics.median(before) if before else float("nan")
    step_p90 = statistics.quantiles(before, n=10)[-1] if len(before) >= 2 else step
    mean_during = statistics.fmean(during + stalled) if during or stalled else float("inf")
    longest = max(during + stalled, default=float("inf"))
    got.update(baseline_step_s=round(step, 4), baseline_step_p90_s=round(step_p90, 4),
               mean_step_while_stopped_s=round(mean_during, 4),
               added_latency_per_step_s=round(mean_during - step, 4),
               added_latency_per_step_in_steps=round((mean_during - step) / step, 3),
               max_step_while_stopped_s=round(longest, 4), steps_while_stopped=len(during))
    chaos_report.record("faults", f"draft_server_stopped/{app}", got)
    assert got["lost"] == got["corrupted"] == 0 and got["ok"] == STREAMS, got["details"]
    assert before, "no baseline steps before the stop"
    assert any(r.times and r.times[-1] > t_stop for r in results), "the streams ended before the stop"
    # The goal (≤ 1 decode step added per step) is a speed figure: recorded above and reported
    # (docs/reliability.md), not asserted on a shared machine. What must hold on any machine: the
    # no step waits out the KVSync deadline (draft_server.timeout_s, 2 s) as steps did before the
    # draft-call budget (longest 2.1-2.2 s with 0.2 s steps); the budget ends a late call at
    # budget_factor x the median step.
    assert longest < 2.0, f"a step took {longest:.3f}s while the DraftServer was stopped (the 2 s deadline)"


@pytest.mark.parametrize("app", ["shared", "sep"])
def test_engine_core_killed_mid_stream(service, chaos_report, app):
    service.wait_healthy(app)
    core = engine_pid(app, "SpecEngine")
    assert core not in (None, os.getpid())
    modes = [SPECULATIVE, SPECULATIVE, SPECULATIVE, PLAIN, PLAIN]
    threads, results, want = launch(service, app, modes)
    os.kill(core, signal.SIGKILL)
    join_all(threads, 300)
    on_killed = {i for i, m in enumerate(modes) if m == SPECULATIVE}
    got = judge(results, want, may_fail=on_killed)
    chaos_report.record("faults", f"engine_core_killed/{app}", got)
    assert got["lost"] == got["corrupted"] == got["leaks"] == 0, got["details"]
    assert got["unavailable"] == len(on_killed) and got["ok"] == len(modes) - len(on_killed), got["details"]

    def replaced():
        try:
            return engine_pid(app, "SpecEngine") not in (core, None)
        except Exception:  # noqa: BLE001 — the replica is being replaced
            return False
    wait_for(replaced, timeout=300, what="a new SpecEngine replica")
    service.wait_healthy(app)
    errors = new_requests_succeed(service, app)
    chaos_report.record("faults", f"engine_core_killed/{app}/after", errors)
    assert not errors


@pytest.mark.parametrize("app", ["shared", "sep"])
def test_router_replica_killed_mid_stream(service, chaos_report, app):
    service.wait_healthy(app)
    routers = replica_actors(app, "Router")
    assert len(routers) == 2, routers
    modes = [SPECULATIVE, PLAIN] * 4
    threads, results, want = launch(service, app, modes)
    kill_replica(app, "Router", routers[0])
    join_all(threads, 300)
    # The streams the dead replica carried are ended by Ray Serve's gRPC proxy, not by our code: it
    # answers INTERNAL with the actor's details (a known gap, docs/reliability.md). They must still
    # end explicitly after a correct prefix: no hang, no OK with a cut or changed output.
    got = judge(results, want, may_fail=set(range(len(modes))),
                fail_codes=(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL), count_leaks=False)
    chaos_report.record("faults", f"router_replica_killed/{app}", got)
    assert got["lost"] == got["corrupted"] == 0, got["details"]
    assert got["ok"] >= 1, "no stream on the surviving Router replica finished"
    errors = new_requests_succeed(service, app)
    chaos_report.record("faults", f"router_replica_killed/{app}/after", errors)
    assert not errors
    service.wait_healthy(app)
