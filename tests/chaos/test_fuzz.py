"""Fuzz the public gRPC API (hypothesis, every ``GenerateRequest`` field) through the real Serve app.

Every answer is OK or a documented error code — never INTERNAL / UNKNOWN / a hang past the per-call
deadline, and never OK with ``FINISH_REASON_ERROR`` (an error disguised as success); a wrong or
missing token is UNAUTHENTICATED whatever the body; no error message carries internals (tracebacks,
Ray actor ids, pids). Afterwards the service is SERVING and a
reference greedy request answers exactly as before. The FakeEngine app takes the many examples
(``--fuzz-examples``, CI 200); the real default model (n-gram drafter, shared placement) a smaller
share. Unary and streaming calls alternate.
"""
from __future__ import annotations

from collections import Counter

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.chaos.service import LEAKS, TOKEN
from tests.chaos.strategies import credentials, generate_requests

pytestmark = [pytest.mark.chaos, pytest.mark.ray]

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.UNAUTHENTICATED}
FINISH_REASON_ERROR = 5
REFERENCE = dict(prompt="The capital of France is", max_tokens=8, mode=1, ignore_eos=True)


def call(client, fields: dict, auth, stream: bool, timeout: float) -> tuple[grpc.StatusCode, str, int]:
    """(code, details, finish_reason) of one call; DEADLINE_EXCEEDED means the service hung; an OK
    answer whose log-probabilities (asked or not) do not match its tokens one for one, or whose
    prompt log-probabilities are not one per prompt token after the first (on the first chunk
    alone), counts as -1."""
    md = [("application", client.md[0][1])] + ([("authorization", auth)] if auth else [])
    want, want_prompt = "logprobs" in fields, "prompt_logprobs" in fields
    try:
        if stream:
            chunks = list(client.stream(timeout=timeout, md=md, **fields))
            last = chunks[-1] if chunks else None
            if last is None or not last.finished:
                return grpc.StatusCode.OK, "stream ended without a finished chunk", -1
            if any(len(c.logprobs) != (len(c.token_ids) if want else 0) for c in chunks):
                return grpc.StatusCode.OK, "log-probabilities do not match the chunk's tokens", -1
            if last.finish_reason != FINISH_REASON_ERROR and (
                    any(c.prompt_logprobs for c in chunks[1:])
                    or len(chunks[0].prompt_logprobs) != (last.usage.prompt_tokens - 1 if want_prompt else 0)):
                return grpc.StatusCode.OK, "prompt log-probabilities do not match the prompt", -1
            return grpc.StatusCode.OK, "", last.finish_reason
        r = client.generate(timeout=timeout, md=md, **fields)
        if len(r.logprobs) != (len(r.token_ids) if want else 0):
            return grpc.StatusCode.OK, "log-probabilities do not match the tokens", -1
        if len(r.prompt_logprobs) != (r.usage.prompt_tokens - 1 if want_prompt else 0):
            return grpc.StatusCode.OK, "prompt log-probabilities do not match the prompt", -1
        return grpc.StatusCode.OK, "", r.finish_reason
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", 0


def fuzz(chaos_report, client, section: str, examples: int, timeout: float) -> None:
    reference = list(client.generate(**REFERENCE, timeout=120).token_ids)
    codes: Counter = Counter()
    bad: list[str] = []

    @settings(max_examples=examples, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(fields=generate_requests(), cred=credentials, stream=st.booleans())
    def one(fields, cred, stream):
        label, value = cred
        auth = f"Bearer {TOKEN}" if value is True else value
        code, details, finish = call(client, fields, auth, stream, timeout)
        codes[code.name] += 1
        summary = {k: (v if len(repr(v)) < 200 else f"<{type(v).__name__} len {len(v)}>")
                   for k, v in fields.items()}
        if label != "good":
            ok = code is grpc.StatusCode.UNAUTHENTICATED
        else:
            ok = code in ALLOWED and code is not grpc.StatusCode.UNAUTHENTICATED
            ok = ok and not (code is grpc.StatusCode.OK and finish in (FINISH_REASON_ERROR, -1))
        ok = ok and not any(m in details for m in LEAKS)  # a clear message, never internals
        if not ok:  # collected, not raised: one run counts every failure (no shrinking rounds)
            said = details if len(details) < 500 else f"{details[:150]} ... {details[-300:]}"
            bad.append(f"{code.name} finish={finish} auth={label} stream={stream}: {said!r} for {summary}")

    one()
    chaos_report.record(section, "examples", sum(codes.values()))
    chaos_report.count_codes(section, codes)
    chaos_report.record(section, "internal_or_unknown", codes["INTERNAL"] + codes["UNKNOWN"])
    chaos_report.record(section, "hangs", codes["DEADLINE_EXCEEDED"])
    chaos_report.record(section, "failures", len(bad))
    chaos_report.record(section, "failure_samples", bad[:20])
    assert not bad, f"{len(bad)} of {sum(codes.values())} answers broke the contract:\n" + "\n".join(bad[:15])

    r = client.health.Check(health_pb2.HealthCheckRequest(), metadata=client.md[:1], timeout=10)
    assert r.status == health_pb2.HealthCheckResponse.SERVING
    after = list(client.generate(**REFERENCE, timeout=120).token_ids)
    chaos_report.record(section, "reference_unchanged", after == reference)
    assert after == reference, "the reference greedy request changed after the fuzz"
    assert codes["OK"] > 0 and codes["INVALID_ARGUMENT"] > 0  # the fuzz reached both sides


def test_fuzz_fake_engine_app(chaos_service, chaos_report, fuzz_examples):
    chaos_service.apps("fake")
    fuzz(chaos_report, chaos_service.client("fake"), "fuzz_fake", fuzz_examples[0], timeout=30)


@pytest.mark.model
def test_fuzz_real_model_app(chaos_service, chaos_report, fuzz_examples):
    chaos_service.apps("fuzz")
    fuzz(chaos_report, chaos_service.client("fuzz"), "fuzz_real", fuzz_examples[1], timeout=90)


@pytest.mark.parametrize("app", ["fake", pytest.param("shared", marks=pytest.mark.model)])
def test_reused_request_id_does_not_cancel_another_client(chaos_service, chaos_report, app):
    """Clients sending the same ``request_id`` metadata at once must not touch each other's streams
    (the server names requests; a client id is only a label)."""
    from tests.chaos.service import PLAIN, PROMPTS, join_all, start_stream
    from tests.deployments.test_service_fake import expected

    chaos_service.apps(app)
    c = chaos_service.client(app)
    md = c.md + [("request_id", "same-id")]
    prompt, n = PROMPTS[0], 48
    want = expected(prompt, n) if app == "fake" else chaos_service.solo(app, prompt, n)
    threads, results = [], []
    for _ in range(3):
        t, r = start_stream(c, timeout=120, md=md, prompt=prompt, max_tokens=n, ignore_eos=True, mode=PLAIN)
        threads.append(t)
        results.append(r)
        r.first.wait(60)
    join_all(threads, 180)
    outcome = [(r.code.name if r.code else "HANG", len(r.tokens), r.details[:100]) for r in results]
    chaos_report.record("request_id_reuse", app, outcome)
    for r in results:
        assert r.code is grpc.StatusCode.OK and r.finished, outcome
        assert r.tokens == want, outcome


@pytest.mark.model
@pytest.mark.parametrize("temperature", [1e-44, 1e-38])
def test_tiny_temperature_harms_no_other_stream(chaos_service, chaos_report, temperature):
    """A temperature just above 0 (``logits / T`` overflows) is answered for that request alone —
    greedy, or INVALID_ARGUMENT — while greedy streams on both engines finish with their solo
    output."""
    from tests.chaos.service import PLAIN, PROMPTS, SPECULATIVE, join_all, start_stream

    app, n = "shared", 48
    chaos_service.apps(app)
    c = chaos_service.client(app)
    runs = [start_stream(c, prompt=PROMPTS[i], max_tokens=n, mode=mode, ignore_eos=True, timeout=240)
            for i, mode in enumerate((SPECULATIVE, PLAIN))]
    for _, r in runs:
        assert r.first.wait(120)
    answers = []
    for mode in (SPECULATIVE, PLAIN):
        code, details, finish = call(c, dict(prompt=PROMPTS[2], max_tokens=8, temperature=temperature,
                                             mode=mode), c.md[1][1] if len(c.md) > 1 else None,
                                     stream=False, timeout=90)
        answers.append((code.name, finish, details[:200]))
    join_all([t for t, _ in runs], 240)
    streams = [(r.code.name if r.code else "HANG", len(r.tokens),
                r.tokens == chaos_service.solo(app, PROMPTS[i], n)) for i, (_, r) in enumerate(runs)]
    chaos_report.record("tiny_temperature", repr(temperature), {"answers": answers, "streams": streams})
    for code, finish, _ in answers:
        assert code == "INVALID_ARGUMENT" or (code == "OK" and finish != FINISH_REASON_ERROR), answers
    assert all(s == ("OK", n, True) for s in streams), streams
