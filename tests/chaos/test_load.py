"""Load: 32 concurrent streaming requests, mixed modes, both placements, 5 rounds, real model.

0 errors; every greedy output equals its solo run; after each round the KV pools are full again
(``kv_blocks_free == kv_blocks_total``) and no per-request state has grown — engine running/waiting
sequences, replica in-flight counts, the SpecEngine's tracked draft sequences and the DraftServer's
sequence count are no higher than before the first round (the DraftServer may still hold, and later
drop, sequences that earlier tests left behind: fewer is fine, more is a leak).
"""
from __future__ import annotations

import grpc
import pytest

from tests.chaos.service import (AUTO, PLAIN, PROMPTS, SPECULATIVE, idle_state, join_all,
                                 start_stream)
from tests.deployments.test_service_fake import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.ray, pytest.mark.model]
CONCURRENCY = 32
ROUNDS = 5
N = 16
MODES = [AUTO, SPECULATIVE, PLAIN, AUTO]


def grown(state: dict, baseline: dict) -> dict:
    """The per-request counts in ``state`` above their ``baseline`` values (KV is checked apart)."""
    return {f"{dep}.{key}": (baseline.get(dep, {}).get(key, 0), n)
            for dep, counts in state.items() for key, n in counts.items()
            if not key.startswith("kv_") and n > baseline.get(dep, {}).get(key, 0)}


def settled(app: str, baseline: dict) -> dict:
    """Wait until every engine is idle (nothing running, KV full) and return the state then."""
    box = {}

    def idle():
        box["s"] = s = idle_state(app)
        engines = [v for k, v in s.items() if k != "DraftServer"]
        return all(v["running"] == v["waiting"] == v["in_flight"] == 0 and v["kv_free"] == v["kv_total"]
                   for v in engines) and not grown(s, baseline)
    try:
        wait_for(idle, timeout=60, what=f"{app} back to its idle state")
    except AssertionError:
        pass  # the caller compares and reports the state it saw
    return box["s"]


@pytest.mark.parametrize("app", ["shared", "sep"])
def test_32_concurrent_streams_five_rounds(chaos_service, chaos_report, app):
    chaos_service.apps(app)
    chaos_service.wait_healthy(app)
    c = chaos_service.client(app)
    want = {p: chaos_service.solo(app, p, N) for p in PROMPTS}
    for p in PROMPTS:  # lossless: the speculative path alone gives the plain path's tokens
        r = c.generate(prompt=p, max_tokens=N, mode=SPECULATIVE, ignore_eos=True, timeout=120)
        assert list(r.token_ids) == want[p], f"speculative solo differs from plain solo for {p!r}"
    baseline = idle_state(app)
    errors, mismatches, states = [], [], []
    for rnd in range(ROUNDS):
        runs = [start_stream(c, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=N, ignore_eos=True,
                             mode=MODES[i % len(MODES)], timeout=300) for i in range(CONCURRENCY)]
        join_all([t for t, _ in runs], 400)
        for i, (_, r) in enumerate(runs):
            if r.code is not grpc.StatusCode.OK or not r.finished:
                errors.append(f"round {rnd} stream {i}: {r.code.name if r.code else 'HANG'} {r.details[:200]!r}")
            elif r.tokens != want[PROMPTS[i % len(PROMPTS)]]:
                mismatches.append(f"round {rnd} stream {i} (mode {MODES[i % len(MODES)]})")
        states.append(settled(app, baseline))
    leaks = [f"round {i}: {grown(s, baseline)}" for i, s in enumerate(states) if grown(s, baseline)]
    chaos_report.record("load", app, {"concurrency": CONCURRENCY, "rounds": ROUNDS,
                                      "requests": CONCURRENCY * ROUNDS, "errors": len(errors),
                                      "mismatches": len(mismatches), "baseline_state": baseline,
                                      "state_after_rounds": states, "error_samples": errors[:10]})
    assert not errors, errors[:10]
    assert not mismatches, mismatches[:10]
    assert all(v["kv_free"] == v["kv_total"] for k, v in states[-1].items() if k != "DraftServer")
    assert not leaks, f"per-request state grew (baseline {baseline}): {leaks}"
