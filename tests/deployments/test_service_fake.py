"""The Serve app end to end with the fake engine: real Ray Serve, real gRPC on 127.0.0.1.

Four apps on the suite's shared Serve session (``serve_shared``): ``main`` (auth on, small
thresholds and queue), ``moe`` (unvalidated MoE target, auth off), ``sep`` (placement separate:
a DraftServer with the n-gram drafter, KVSync to the SpecEngine's fake engine; the module's last
test kills its BatchEngine replica mid-stream on the plain path), ``overflow`` (slow steps, a
segment the fake SpecEngine cannot accelerate: measured overflow balancing). The gRPC proxy runs with the
message cap ``specserve serve`` gives an app with the default limits (``proxy_env``).
"""
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from cluster.api.status import ENGINE_GONE
from cluster.engine.fake_engine import CRASH_MARKER, CRASH_TEXT, FAIL_MARKER, FAIL_MESSAGE, HOLD_MARKER
from tests.deployments.harness import SHARED_ENV, Client, fake_args

pytestmark = pytest.mark.ray
TOKEN = SHARED_ENV["SPECSERVE_TEST_TOKEN"]
CODE = grpc.StatusCode


SEP_ARGS = fake_args(placement="separate", engine_impl={"cls": "cluster.engine.fake_engine:FakeEngine",
                                                       "options": {"token_delay_s": 0.05}})


def expected(prompt: str, n: int) -> list[int]:
    ids = [b + 3 for b in prompt.encode()]  # the fake engine's target repeats the prompt
    return [ids[i % len(ids)] for i in range(n)]


# 50 ms per step; the fake SpecEngine emits 4 tokens a step (α 0.75, K 4) except on segment "slow"
OVERFLOW_ARGS = fake_args(
    router={"enter_threshold": 2, "exit_threshold": 4, "overflow_min_samples": 8},
    limits={"max_segments": 4},  # fast, slow and two more (test_segment_labels_are_bounded)
    spec_engine={"num_cpus": 0.1, "max_num_seqs": 8}, batch_engine={"num_cpus": 0.1, "max_num_seqs": 8},
    engine_impl={"cls": "cluster.engine.fake_engine:FakeEngine",
                 "options": {"token_delay_s": 0.05, "acceptance_rate_by_segment": {"slow": 0.0}}})


@pytest.fixture(scope="module")
def addr(serve_shared):
    apps = {
        "main": fake_args(
            auth={"token_env": "SPECSERVE_TEST_TOKEN"},
            router={"enter_threshold": 2, "exit_threshold": 4, "min_alpha": 0.5, "min_alpha_samples": 8},
            limits={"max_tokens": 256, "max_prompt_tokens": 64, "max_message_bytes": 8192, "max_queue": 4},
            spec_engine={"num_cpus": 0.1, "max_num_seqs": 4}, batch_engine={"num_cpus": 0.1, "max_num_seqs": 4},
            engine_impl={"cls": "cluster.engine.fake_engine:FakeEngine",
                         "options": {"token_delay_s": 0.02, "acceptance_rate_by_segment": {"lowalpha": 0.1, "mixed+sampled": 0.1}}}),
        "moe": fake_args(engine_impl={"cls": "cluster.engine.fake_engine:FakeEngine",
                                      "options": {"moe": True}}),
        "sep": SEP_ARGS,
        "overflow": OVERFLOW_ARGS,
    }
    with serve_shared.apps(apps) as a:
        for name in apps:
            Client(a.grpc, name, TOKEN).wait_ready()
        yield a.grpc


@pytest.fixture(scope="module")
def main(addr):
    return Client(addr, "main", TOKEN)


def engine_stats(app: str, deployment: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=app).stats.remote().result(timeout_s=10)


def wait_for(pred, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def kv_full(app="main", deployment="SpecEngine") -> bool:
    s = engine_stats(app, deployment)
    return s["num_running"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]


# Ray Serve's gRPC proxy loses a client's cancellation of a stream when it arrives while the proxy is
# still busy with the chunk before (docs/reliability.md#cancellation): the Router never hears of it and
# the request runs on to its end (a held one: HOLD_LIMIT_S). A test that cancels held streams to
# check what cancellation frees waits this long after their last chunk first, so the proxy is
# waiting for the next chunk, where it passes the cancellation on.
PROXY_SETTLE_S = 0.3


def cancel_streams(streams) -> None:
    time.sleep(PROXY_SETTLE_S)
    for it in streams:
        it.cancel()


def code_of(fn):
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def test_health_and_model_info(addr, main):
    from grpc_health.v1 import health_pb2

    r = main.health.Check(health_pb2.HealthCheckRequest(service="specserve.v1.Generation"),
                          metadata=main.md[:1], timeout=10)
    assert r.status == health_pb2.HealthCheckResponse.SERVING
    code, _ = code_of(lambda: main.health.Check(health_pb2.HealthCheckRequest(service="nope"),
                                                metadata=main.md[:1], timeout=10))
    assert code == CODE.NOT_FOUND
    info = main.stub.ModelInfo(main.pb2.ModelInfoRequest(), metadata=main.md, timeout=10)
    assert info.model == "fake:fake" and info.vocab_size == 259 and info.placement == "shared"
    assert (info.enter_threshold, info.exit_threshold, info.max_prompt_tokens) == (2, 4, 64)
    assert info.spec_ready and info.batch_ready
    assert info.paths_share_hardware  # auto: both engines on this one Ray node, no GPUs
    assert info.min_alpha == pytest.approx(0.5) and not info.min_alpha_auto
    # min_alpha "auto" (the default, app moe): the threshold in force is reported as a number
    moe = Client(addr, "moe")
    auto = moe.stub.ModelInfo(moe.pb2.ModelInfoRequest(), metadata=moe.md, timeout=10)
    assert auto.min_alpha_auto and 0.0 <= auto.min_alpha <= 1.0


def test_auth_required_when_configured(addr, main):
    for md in ([("application", "main")], [("application", "main"), ("authorization", "Bearer wrong")]):
        assert code_of(lambda: main.generate(prompt="hi", max_tokens=2, md=md))[0] == CODE.UNAUTHENTICATED
        assert code_of(lambda: list(main.stream(prompt="hi", max_tokens=2, md=md)))[0] == CODE.UNAUTHENTICATED
        assert code_of(lambda: main.stub.ModelInfo(main.pb2.ModelInfoRequest(), metadata=md,
                                                   timeout=10))[0] == CODE.UNAUTHENTICATED
    # auth off on the other app: no token needed
    assert Client(addr, "moe").generate(prompt="hi", max_tokens=2).token_ids


@pytest.mark.parametrize("fields,needle", [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt="a", messages=[{"role": "user", "content": "b"}]), "prompt and messages"),
    (dict(prompt="a", max_tokens=0), "max_tokens must be in [1, 256]"),
    (dict(prompt="a", max_tokens=257), "max_tokens must be in [1, 256]"),
    (dict(prompt="a", temperature=-1.0), "temperature must be >= 0"),
    (dict(prompt="a", top_p=1.5), "top_p must be in (0, 1]"),
    (dict(prompt="x" * 65), "prompt too long: 65 tokens, limit is 64"),
    (dict(prompt="a", json_schema=json.dumps({"type": 12})), "not a valid JSON Schema"),
    (dict(prompt="a", regex="a(b"), "regex does not compile"),
    (dict(prompt="x" * 9000), "8192-byte limit"),
    (dict(prompt="a", temperature=float("nan")), "temperature must be a finite number"),
    (dict(prompt="a", temperature=float("inf")), "temperature must be a finite number"),
    (dict(prompt="a", top_p=float("nan")), "top_p must be a finite number"),
    (dict(prompt="a", stop=[str(i) for i in range(17)]), "stop has 17 strings, limit is 16"),
    (dict(prompt="a", stop=["x" * 257]), "stop[0] is 257 characters, limit is 256"),
    (dict(prompt="a", json_schema="[" * 3000 + "]" * 3000), "json_schema is nested too deeply"),
    (dict(prompt="a", regex="(" * 2000 + ")" * 2000), "regex is nested too deeply"),
    (dict(prompt="a", grammar="start: foo"), 'grammar is not supported: at 1(8): unknown name: "foo"'),
    (dict(prompt="a", grammar='start: "a"', regex="a"), "set at most one of json_schema, regex and grammar"),
    (dict(prompt="a", draft_scope="tenant 7"), "draft_scope must be ASCII letters"),
])
def test_invalid_argument(main, fields, needle):
    code, details = code_of(lambda: main.generate(**fields))
    assert code == CODE.INVALID_ARGUMENT and needle in details
    code, details = code_of(lambda: list(main.stream(**fields)))
    assert code == CODE.INVALID_ARGUMENT and needle in details


def _with_field(pb2, number: int, payload: bytes, **fields) -> bytes:
    """A GenerateRequest's bytes plus a length-delimited field ``number`` its proto lacks."""
    from google.protobuf.internal.encoder import _VarintBytes

    return (pb2.GenerateRequest(**fields).SerializeToString()
            + _VarintBytes(number << 3 | 2) + _VarintBytes(len(payload)) + payload)


def test_a_field_the_server_does_not_know_is_refused_not_ignored(main):
    """A newer client's field (here number 40, and a chat message's 3) parses as an unknown field in
    proto3: the server refuses the request instead of answering as if it were unset, unary and
    stream, through the real gRPC proxy; ModelInfo lists every field it implements."""
    pb2 = main.pb2
    raw = {name: main.channel.unary_unary(f"/specserve.v1.Generation/{name}", request_serializer=None,
                                          response_deserializer=pb2.GenerateResponse.FromString)
           for name in ("Generate",)}
    raw["GenerateStream"] = main.channel.unary_stream("/specserve.v1.Generation/GenerateStream",
                                                      request_serializer=None,
                                                      response_deserializer=pb2.GenerateStreamChunk.FromString)
    message = pb2.ChatMessage(role="user", content="hi").SerializeToString()
    from google.protobuf.internal.encoder import _VarintBytes

    odd_message = message + _VarintBytes(3 << 3 | 2) + _VarintBytes(1) + b"x"
    cases = [(_with_field(pb2, 40, b"tenant-7", prompt="the cat sat. ", max_tokens=4), "GenerateRequest carries field number 40"),
             (_with_field(pb2, 2, odd_message, max_tokens=4), "messages[0] carries field number 3")]
    for body, needle in cases:
        for name, call in raw.items():
            fn = (lambda: call(body, metadata=main.md, timeout=30)) if name == "Generate" else (
                lambda: list(call(body, metadata=main.md, timeout=30)))
            code, details = code_of(fn)
            assert code == CODE.INVALID_ARGUMENT and needle in details and "does not implement" in details, (name, details)
    # the same bytes without the extra field are answered
    plain = pb2.GenerateRequest(prompt="the cat sat. ", max_tokens=4).SerializeToString()
    assert list(raw["Generate"](plain, metadata=main.md, timeout=30).token_ids) == expected("the cat sat. ", 4)
    info = main.stub.ModelInfo(pb2.ModelInfoRequest(), metadata=main.md, timeout=10)
    assert list(info.request_fields) == [f.name for f in pb2.GenerateRequest.DESCRIPTOR.fields]
    assert "draft_scope" in info.request_fields


def test_the_client_tokenizes(addr, capsys):
    from cluster.cli import build_parser

    args = build_parser().parse_args(["client", "--addr", addr, "--app", "main", "--token", TOKEN, "--tokenize", "hé"])
    assert args.func(args) == 0
    out = capsys.readouterr()
    assert out.out.split() == ["107", "198", "172"] and "[tokens=3 max_model_len=2048" in out.err  # bytes + 3
    from cluster.common.config import EngineConfig
    from cluster.engine.fake_engine import FakeEngine

    args = build_parser().parse_args(["client", "--addr", addr, "--app", "main", "--token", TOKEN, "--tokenize",
                                      "--chat", "hé"])
    assert args.func(args) == 0  # --chat: the chat template's ids
    want = FakeEngine(EngineConfig()).apply_chat_template([{"role": "user", "content": "hé"}])
    assert capsys.readouterr().out.split() == [str(t) for t in want]
    args = build_parser().parse_args(["client", "--addr", addr, "--app", "main", "--tokenize", "hé"])  # no token
    assert args.func(args) == 1 and "UNAUTHENTICATED" in capsys.readouterr().err


def test_tokenize_and_detokenize_as_generate_feeds_the_model(main):
    """Tokenize gives the ids Generate would feed the model (a prompt's, a chat's through the chat
    template), with the limits to check them against; Detokenize spells ids back; the prompt rules,
    auth, unknown fields and ids outside the vocabulary are refused like a generation request's."""
    from cluster.engine.fake_engine import FakeEngine
    from cluster.common.config import EngineConfig

    fake, pb2 = FakeEngine(EngineConfig()), main.pb2
    r = main.stub.Tokenize(pb2.TokenizeRequest(prompt="héllo"), metadata=main.md, timeout=30)
    assert list(r.token_ids) == fake.tokenize("héllo") and r.count == len(r.token_ids) == 6
    assert r.max_model_len == 2048 and r.max_prompt_tokens > 0
    chat = main.stub.Tokenize(pb2.TokenizeRequest(messages=[pb2.ChatMessage(role="user", content="hi")]),
                              metadata=main.md, timeout=30)
    assert list(chat.token_ids) == fake.apply_chat_template([{"role": "user", "content": "hi"}])
    g = main.generate(prompt_token_ids=pb2.TokenIds(ids=list(r.token_ids)), max_tokens=3, mode=2)
    assert g.usage.prompt_tokens == r.count and list(g.token_ids) == expected("héllo", 3)
    d = main.stub.Detokenize(pb2.DetokenizeRequest(token_ids=list(r.token_ids)), metadata=main.md, timeout=30)
    assert d.text == "héllo"
    for call, match in (
            (lambda: main.stub.Tokenize(pb2.TokenizeRequest(), metadata=main.md, timeout=30), "prompt is empty"),
            (lambda: main.stub.Tokenize(pb2.TokenizeRequest(prompt="a", messages=[pb2.ChatMessage(role="user", content="b")]),
                                        metadata=main.md, timeout=30), "exactly one of prompt, messages"),
            (lambda: main.stub.Tokenize(pb2.TokenizeRequest(messages=[pb2.ChatMessage(role="wizard", content="b")]),
                                        metadata=main.md, timeout=30), "role must be one of"),
            (lambda: main.stub.Detokenize(pb2.DetokenizeRequest(token_ids=[5, 99999]), metadata=main.md, timeout=30),
             r"out of range \[0, 259\): \[99999\]")):
        code, details = code_of(call)
        assert code is grpc.StatusCode.INVALID_ARGUMENT and re.search(match, details), details
    code, _ = code_of(lambda: main.stub.Tokenize(pb2.TokenizeRequest(prompt="a"), metadata=main.md[:1], timeout=30))
    assert code is grpc.StatusCode.UNAUTHENTICATED
    raw = main.channel.unary_unary("/specserve.v1.Generation/Tokenize", request_serializer=lambda b: b,
                                   response_deserializer=pb2.TokenizeResponse.FromString)
    code, details = code_of(lambda: raw(pb2.TokenizeRequest(prompt="a").SerializeToString() + b"\xa8\x02\x01",
                                        metadata=main.md, timeout=30))  # field 37: unknown here
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "TokenizeRequest carries field number 37" in details


def test_the_client_sends_no_field_the_server_would_ignore(addr, main, capsys):
    """`specserve client` asks ModelInfo first: against this server a draft scope is sent and
    answered (the check's own cases: tests/api/test_server_fields.py)."""
    from cluster.api.server_fields import UnsupportedField, check_request_fields
    from cluster.cli import build_parser

    args = build_parser().parse_args(["client", "--addr", addr, "--app", "main", "--token", TOKEN,
                                      "--max-tokens", "4", "--draft-scope", "tenant-7", "the cat sat. "])
    assert args.func(args) == 0
    out = capsys.readouterr()
    assert out.out.startswith((("the cat sat. ") * 2)[:4]) and "route=" in out.err
    # every field this server lists passes the check (a request setting all of them)
    pb2 = main.pb2
    every = pb2.GenerateRequest(prompt="a", max_tokens=3, temperature=0.5, top_p=0.9, top_k=4, seed=1,
                                stop=["x"], mode=1, segment="chat", regex="[a-z]+", ignore_eos=True,
                                draft_scope="tenant-7", prediction="b")
    check_request_fields(every, main.stub.ModelInfo(pb2.ModelInfoRequest(), metadata=main.md, timeout=10))
    # an older server (no request_fields): the client refuses before sending anything
    with pytest.raises(UnsupportedField, match="draft_scope"):
        check_request_fields(every, pb2.ModelInfoResponse(model="old"))


def test_generate_and_stream_agree_on_both_paths(main):
    prompt = "the cat sat. "
    for mode, path, reason in ((0, 1, "below_enter_threshold"), (2, 2, "mode_plain")):
        r = main.generate(prompt=prompt, max_tokens=23, mode=mode, segment="code")
        assert list(r.token_ids) == expected(prompt, 23) and r.text == (prompt * 2)[:23]
        assert (r.route.path, r.route.reason) == (path, reason)
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 23
        assert r.finish_reason == main.pb2.FINISH_REASON_LENGTH
        chunks = list(main.stream(prompt=prompt, max_tokens=23, mode=mode, segment="code"))
        assert [t for c in chunks for t in c.token_ids] == expected(prompt, 23)
        assert chunks[0].route.reason == reason and chunks[-1].finished and not chunks[0].finished
        assert chunks[-1].usage.completion_tokens == 23
        if path == 1:
            assert r.spec.draft_tokens > 0 and r.spec.acceptance_rate == pytest.approx(0.75)
            assert len(chunks) < 23  # several committed tokens per verification step
        else:
            assert r.spec.draft_tokens == 0


def test_a_prediction_is_counted_in_usage_and_refused_with_mode_plain(main):
    """Predicted outputs over real gRPC: the final usage says how much of the prediction the output
    kept (the fake target repeats the prompt: "the cat sat. the" kept 15 of "the cat sat. thX"'s 16
    tokens), unary and stream, on both paths; MODE_PLAIN with a prediction is INVALID_ARGUMENT."""
    prompt, predicted = "the cat sat. ", "the cat sat. thX"
    for mode in (0, 1):
        r = main.generate(prompt=prompt, max_tokens=16, mode=mode, prediction=predicted)
        assert list(r.token_ids) == expected(prompt, 16)  # the output is the target's, prediction or not
        assert (r.usage.accepted_prediction_tokens, r.usage.rejected_prediction_tokens) == (15, 1)
        last = list(main.stream(prompt=prompt, max_tokens=16, mode=mode, prediction=predicted))[-1]
        assert (last.usage.accepted_prediction_tokens, last.usage.rejected_prediction_tokens) == (15, 1)
    r = main.generate(prompt=prompt, max_tokens=16)
    assert (r.usage.accepted_prediction_tokens, r.usage.rejected_prediction_tokens) == (0, 0)
    code, details = code_of(lambda: main.generate(prompt=prompt, max_tokens=4, mode=2, prediction="x"))
    assert code == CODE.INVALID_ARGUMENT and "prediction needs speculative decoding" in details


def test_logprobs_ride_with_their_tokens_unary_and_stream_on_both_paths(addr, main, capsys):
    """Over real gRPC through Serve: one OutputLogprobs per token id, in order, with the token's
    bytes filled in next to the tokenizer (the fake engine's stand-in values; the real values are
    checked against HF in tests/sampling/test_logprobs.py); none unless asked; the CLI prints them."""
    prompt = "the cat sat. "
    for mode in (0, 2):
        r = main.generate(prompt=prompt, max_tokens=9, mode=mode, logprobs=2)
        assert [o.chosen.token_id for o in r.logprobs] == list(r.token_ids) == expected(prompt, 9)
        assert b"".join(o.chosen.token for o in r.logprobs).decode() == r.text
        assert all(len(o.top) == 2 and o.top[0].token == o.chosen.token and o.chosen.logprob == -0.25
                   for o in r.logprobs)
        chunks = list(main.stream(prompt=prompt, max_tokens=9, mode=mode, logprobs=0))
        assert all([o.chosen.token_id for o in c.logprobs] == list(c.token_ids) for c in chunks)
        assert all(not o.top for c in chunks for o in c.logprobs)
        assert not main.generate(prompt=prompt, max_tokens=3, mode=mode).logprobs
    from cluster.cli import build_parser

    args = build_parser().parse_args(["client", "--addr", addr, "--app", "main", "--token", TOKEN,
                                      "--max-tokens", "3", "--logprobs", "1", "--stream", prompt])
    assert args.func(args) == 0
    err = capsys.readouterr().err
    assert "'t'   -0.2500   't' -0.250" in err and "'h'   -0.2500" in err
    args = build_parser().parse_args(["client", "--addr", addr, "--app", "main", "--token", TOKEN,
                                      "--max-tokens", "0", "--prompt-logprobs", "0", "abc"])
    assert args.func(args) == 0  # scored only: no output, each prompt token after the first printed
    err = capsys.readouterr().err
    assert err.startswith("prompt:\n") and "'b'   -0.2500" in err and "'c'   -0.2500" in err and "'a'" not in err


def test_constrained_routes_like_any_request(main):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    r = main.generate(prompt="{", max_tokens=3, json_schema=schema, mode=1)
    assert r.route.reason == "mode_speculative"
    assert main.generate(prompt="x", max_tokens=3, regex="[a-z]+", mode=2).route.reason == "mode_plain"
    assert main.generate(prompt="x", max_tokens=3, mode=1).route.reason == "mode_speculative"


def test_segment_below_break_even_goes_plain(main):
    first = main.generate(prompt="abc", max_tokens=20, segment="lowalpha")
    assert first.route.reason == "below_enter_threshold" and first.spec.acceptance_rate < 0.5
    wait_for(lambda: main.generate(prompt="abc", max_tokens=2, segment="lowalpha").route.reason
             == "below_break_even", what="router to see the segment's live alpha")
    assert main.generate(prompt="abc", max_tokens=2, segment="code").route.path == 1


def test_a_segments_sampled_requests_are_gated_apart_from_its_greedy_ones(main):
    """Segment "mixed": greedy requests' drafts are accepted, sampled ones' are not (the fake
    engine's rates). Once each class is measured, sampled requests go plain below break-even and
    greedy ones still speculate: the Router reads each class's α from the SpecEngine's stats."""
    greedy = main.generate(prompt="abc", max_tokens=20, segment="mixed")
    assert greedy.route.path == 1 and greedy.spec.acceptance_rate > 0.5
    hot = main.generate(prompt="abc", max_tokens=20, segment="mixed", temperature=1.0)
    assert hot.route.path == 1 and hot.spec.acceptance_rate < 0.5  # unmeasured yet: the segment's α
    wait_for(lambda: main.generate(prompt="abc", max_tokens=2, segment="mixed", temperature=1.0).route.reason
             == "below_break_even", what="router to see the sampled class's live alpha")
    assert main.generate(prompt="abc", max_tokens=2, segment="mixed").route.path == 1
    by_class = engine_stats("main", "SpecEngine")["spec_by_segment"]["mixed"]["live_alpha_by_class"]
    assert by_class["base"]["live_alpha"] > 0.5 > by_class["sampled"]["live_alpha"], by_class


def test_burst_moves_to_plain_and_back(main):
    streams, reasons = [], []
    try:
        for _ in range(8):  # admitted one by one: each holds its slot until cancelled
            # a segment of its own: no completed requests, so overflow balancing is by capacity
            it = main.stream(prompt="burst " + HOLD_MARKER, max_tokens=250, segment="burst")
            reasons.append(next(it).route.reason)
            streams.append(it)
        assert reasons == ["below_enter_threshold", "below_enter_threshold",
                           "hysteresis_speculative", "hysteresis_speculative",
                           "above_exit_threshold", "hysteresis_plain", "hysteresis_plain",
                           "hysteresis_plain"]
    finally:
        cancel_streams(streams)
    wait_for(lambda: main.stub.ModelInfo(main.pb2.ModelInfoRequest(), metadata=main.md,
                                         timeout=10).spec_in_flight == 0, what="spec in-flight 0")
    assert main.generate(prompt="calm", max_tokens=2).route.reason == "below_enter_threshold"
    wait_for(kv_full, what="spec KV back to full")
    wait_for(lambda: kv_full(deployment="BatchEngine"), what="batch KV back to full")


def test_overflow_balance_follows_measured_latency(addr):
    c = Client(addr, "overflow")
    for mode in (1, 2):  # 8 completions per path: SpecEngine ~4x faster per token on "fast"
        for _ in range(8):
            assert c.generate(prompt="measure ", max_tokens=8, mode=mode, segment="fast").route.path == mode
    info = c.stub.ModelInfo(c.pb2.ModelInfoRequest(), metadata=c.md, timeout=10)
    fits = {pl.path: pl for pl in info.path_latency if pl.segment == "fast"}
    assert set(fits) == {1, 2} and fits[1].samples == fits[2].samples == 8
    assert (fits[1].capacity, fits[2].capacity) == (8, 8)
    assert fits[1].base_s + fits[1].per_running_s < 0.5 * (fits[2].base_s + fits[2].per_running_s)
    held, reasons = [], []
    try:
        for _ in range(4):  # 4 x 256 tokens at 1 token per 50 ms step: in flight for ~13 s
            it = c.stream(prompt="hold ", max_tokens=256, mode=1, segment="slow")
            assert next(it).route.reason == "mode_speculative"
            held.append(it)
        t0 = time.monotonic()
        for _ in range(3):  # the SpecEngine holds 4, the BatchEngine 0, 1, 2: capacity (8 and 8)
            it = c.stream(prompt="burst ", max_tokens=256, segment="fast")  # would keep all plain
            held.append(it)
            reasons.append(next(it).route.reason)
            if reasons[-1] == "overflow_balanced":
                break
        assert time.monotonic() - t0 < 10, "the held streams may have finished: inconclusive"
        # exit threshold reached: plain by hysteresis; the SpecEngine at 5 requests is predicted
        # slower than the BatchEngine at 1 (per token ~1/4, x5 load), faster than it at 2 or 3
        assert reasons[0] == "above_exit_threshold"
        assert reasons[-1] == "overflow_balanced" and len(reasons) in (2, 3), reasons
        info = c.stub.ModelInfo(c.pb2.ModelInfoRequest(), metadata=c.md, timeout=10)
        assert (info.spec_in_flight, info.plain_in_flight) == (5, len(reasons) - 1)
    finally:
        cancel_streams(held)
    wait_for(lambda: kv_full("overflow") and kv_full("overflow", "BatchEngine"), what="KV back to full")


def test_cancel_mid_stream_frees_kv(main):
    """Held after its first chunk: only the cancellation can free it before HOLD_LIMIT_S."""
    for deployment, mode in (("SpecEngine", 1), ("BatchEngine", 2)):
        abandoned = engine_stats("main", deployment)["requests_abandoned"]
        it = main.stream(prompt="cancel me " + HOLD_MARKER, max_tokens=250, mode=mode)
        next(it)
        s = engine_stats("main", deployment)
        assert s["num_running"] == 1 and s["kv_blocks_free"] < s["kv_blocks_total"]
        cancel_streams([it])
        wait_for(lambda: kv_full(deployment=deployment), what=f"{deployment} KV freed after cancel")
        assert engine_stats("main", deployment)["requests_abandoned"] == abandoned + 1  # the replica saw it


def test_deadline_exceeded_and_request_aborted(main):
    t0 = time.monotonic()
    code, _ = code_of(lambda: main.generate(prompt="slow ", max_tokens=250, mode=2, timeout=0.5))
    assert code == CODE.DEADLINE_EXCEEDED and time.monotonic() - t0 < 3
    wait_for(lambda: kv_full(deployment="BatchEngine"), what="KV freed after deadline")


def test_queue_full_is_resource_exhausted(main):
    def call(_):
        try:
            main.generate(prompt="q ", max_tokens=60, mode=2, timeout=30)
            return CODE.OK
        except grpc.RpcError as e:
            return e.code()

    with ThreadPoolExecutor(12) as pool:
        codes = list(pool.map(call, range(12)))
    # 4 running + 4 waiting fit (max_num_seqs=4, max_queue=4); the rest are turned away
    assert codes.count(CODE.RESOURCE_EXHAUSTED) >= 1 and codes.count(CODE.OK) >= 8
    assert set(codes) <= {CODE.OK, CODE.RESOURCE_EXHAUSTED}


def test_moe_gate_keeps_speculation_off(addr):
    c = Client(addr, "moe")
    wait_for(lambda: c.generate(prompt="m", max_tokens=2).route.reason == "moe_unvalidated",
             what="router to see the MoE gate")
    r = c.generate(prompt="moe", max_tokens=5, mode=1)
    assert (r.route.path, r.route.reason) == (2, "moe_unvalidated") and list(r.token_ids) == expected("moe", 5)


def _kill_draft_server():
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if "sep#DraftServer" in a["name"]]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)


def test_separate_placement_survives_draft_server_kill(addr):
    c = Client(addr, "sep")
    prompt = "one two three one two three "
    r = c.generate(prompt=prompt, max_tokens=24)
    assert list(r.token_ids) == expected(prompt, 24) and r.route.path == 1
    assert r.spec.accepted_tokens > 0  # the n-gram drafter in the DraftServer, over KVSync
    before = engine_stats("sep", "SpecEngine")
    assert before["draft_tracked"] == 0  # finished sequences are released on the draft side

    it = c.stream(prompt=prompt, max_tokens=120, timeout=120)
    got = list(next(it).token_ids)
    _kill_draft_server()
    chunks = list(it)
    got += [t for ch in chunks for t in ch.token_ids]
    assert got == expected(prompt, 120) and chunks[-1].finished  # nothing lost or corrupted
    assert engine_stats("sep", "SpecEngine")["draft_fallbacks"] > before["draft_fallbacks"]

    def speculating_again():  # mode speculative: the route (rule 9 may measure plain faster
        # while drafts were unavailable) is not what this test is about
        r = c.generate(prompt=prompt, max_tokens=12, mode=1)
        assert list(r.token_ids) == expected(prompt, 12) and r.route.path == 1
        return r.spec.accepted_tokens > 0
    wait_for(speculating_again, timeout=90, what="speculation to resume on a new DraftServer")
    assert engine_stats("sep", "SpecEngine")["draft_epoch_changes"] >= 1


def test_bench_serve_quick(addr, tmp_path):
    import argparse

    from cluster.bench import serve as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    import yaml

    config = tmp_path / "sep.yaml"  # the service's config: the in-process engine is built from it
    config.write_text(yaml.safe_dump({"applications": [{"name": "sep", "args": SEP_ARGS}]}))
    args = p.parse_args(["--json", str(tmp_path / "serve.json"), "--addr", addr, "--app", "sep",
                         "--config", str(config), "--quick", "--segments", "code",
                         "--overhead-requests", "2"])
    assert bench.run(args) == 0
    report = json.loads((tmp_path / "serve.json").read_text())
    cells = {(c["policy"], c["concurrency"]): c for c in report["cells"]}
    assert set(cells) == {(p, c) for p in ("fixed_spec", "fixed_plain", "routed") for c in (1, 4, 16)}
    assert all(k.startswith("speculative:") for k in cells[("fixed_spec", 1)]["route_mix"])
    assert all(k.startswith("plain:") for k in cells[("fixed_plain", 4)]["route_mix"])
    assert cells[("fixed_plain", 1)]["e2e_p50"] > 0 and cells[("routed", 4)]["tokens_per_s"] > 0
    assert not any(c["errors"] for c in cells.values())
    # what the Router measured for the segment, from every policy's requests (the front door's too)
    fits = cells[("routed", 16)]["router_latency"]
    assert set(fits) == {"speculative", "plain"} and all(f["samples"] >= 16 for f in fits.values())
    assert "router's service ms/token" in bench.format_report(report)
    assert len(report["summary"]) == 3
    fd = report["front_door"]
    assert fd["engine"] == "cluster.engine.fake_engine:FakeEngine" and set(fd["paths"]) == {
        "speculative", "plain", "speculative/unary", "plain/unary"}
    for path in fd["paths"].values():  # same tokens both ways; the front door costs something
        assert path["requests"] == 2 and path["same_token_counts"] and path["e2e_ratio"] > 0.5
        assert path["e2e_ratio_paired"] > 0.5 and len(path["pairs_e2e_s"]) == 2
    # repeated rows: the front door sends each of its 3 rows (warm-up pair included) through the
    # speculative path twice (stream and unary), and fixed-spec and routed share each level's rows,
    # but every side and policy sends in a draft scope of its own: nothing repeats within a scope
    # (the levels take fresh rows: 3 + 4 + 4 + 16 of code's 40)
    rep = report["repeated_rows"]
    assert fd["repeated_rows"] == 0 and rep["repeated"] == 0
    assert all(c["repeated_rows"] == 0 for c in cells.values())
    spec_requests = sum(n for c in cells.values() for k, n in c["route_mix"].items() if k.startswith("speculative:"))
    assert rep["speculative_requests"] == 2 * 3 + spec_requests
    assert rep["drafter"] == "ngram" and rep["drafter_learns_from_traffic"] is False
    assert "repeated a row" not in bench.format_report(report)


def test_engine_access_log_has_requests_not_polls(main):
    """The Router polls each engine's stats twice a second; those calls leave no access-log line,
    the requests it forwards do."""
    import glob
    import os

    from ray._private.worker import global_worker

    main.generate(prompt="logged ", max_tokens=2, mode=1)
    main.generate(prompt="logged ", max_tokens=2, mode=2)
    logs = os.path.join(global_worker.node.get_logs_dir_path(), "serve")

    def lines(deployment):
        out = []
        for f in glob.glob(os.path.join(logs, f"replica_main_{deployment}_*.log")):
            with open(f, errors="replace") as fh:
                out += [ln for ln in fh if " CALL " in ln]
        return out

    for deployment in ("SpecEngine", "BatchEngine"):
        wait_for(lambda: any(" CALL generate OK " in ln for ln in lines(deployment)),
                 what=f"{deployment} access log for generate")
        assert not [ln for ln in lines(deployment) if " CALL stats " in ln], deployment


def test_segment_labels_are_bounded(addr):
    """A client labelling every request uniquely cannot grow what the service measures per segment:
    past limits.max_segments (4 here) new labels are measured together as "other"."""
    c = Client(addr, "overflow")
    labels = [f"user-{i}" for i in range(8)]
    for seg in labels:
        for mode in (1, 2):
            r = c.generate(prompt="label ", max_tokens=2, mode=mode, segment=seg)
            assert list(r.token_ids) == expected("label ", 2)
    spec_segments = set(engine_stats("overflow", "SpecEngine")["spec_by_segment"])
    info = c.stub.ModelInfo(c.pb2.ModelInfoRequest(), metadata=c.md, timeout=10)
    fit_segments = {pl.segment for pl in info.path_latency}
    for seen in (spec_segments, fit_segments):
        assert "other" in seen and len(seen - {"other"}) <= 4, seen
        assert 1 <= len(seen & set(labels)) <= 4, seen  # some of ours kept (fast/slow may hold 2)


def test_same_request_id_label_cannot_touch_another_request(main):
    """The client's request_id metadata is a label: two clients sending the same one at once both
    get their complete, correct streams, each echoing the label; the server's ids differ."""
    md = main.md + [("request_id", "dup-1")]
    prompts = ("first client ", "second client ")
    with ThreadPoolExecutor(2) as pool:
        streams = list(pool.map(lambda pr: list(main.stream(prompt=pr, max_tokens=120, md=md, timeout=60)),
                                prompts))
    for prompt, chunks in zip(prompts, streams):
        assert [t for c in chunks for t in c.token_ids] == expected(prompt, 120)
        assert chunks[-1].finished and chunks[-1].finish_reason == main.pb2.FINISH_REASON_LENGTH
        assert {c.request_id for c in chunks} == {"dup-1"}
    r = main.generate(prompt="echo", max_tokens=3, md=md)
    assert r.request_id == "dup-1" and list(r.token_ids) == expected("echo", 3)
    a, b = main.generate(prompt="x", max_tokens=1), main.generate(prompt="x", max_tokens=1)
    assert len(a.request_id) == 32 and a.request_id != b.request_id  # unlabelled: the server's id
    code, details = code_of(lambda: main.generate(prompt="x", max_tokens=1,
                                                  md=main.md + [("request_id", "L" * 129)]))
    assert code == CODE.INVALID_ARGUMENT and "at most 128 characters" in details


def test_engine_error_is_internal_with_its_message_and_harms_no_one(main):
    """A request the engine finishes with ERROR ends with INTERNAL and the engine's message, on
    both RPCs, after the tokens it produced; a request running beside it is untouched."""
    with ThreadPoolExecutor(1) as pool:
        bystander = pool.submit(lambda: main.generate(prompt="bystander ", max_tokens=60, mode=2))
        for mode in (1, 2):
            code, details = code_of(lambda: main.generate(prompt=f"x {FAIL_MARKER}", max_tokens=50, mode=mode))
            assert code == CODE.INTERNAL and FAIL_MESSAGE in details
            got = []
            with pytest.raises(grpc.RpcError) as e:
                for c in main.stream(prompt=f"x {FAIL_MARKER}", max_tokens=50, mode=mode):
                    got += c.token_ids
            assert e.value.code() == CODE.INTERNAL and FAIL_MESSAGE in e.value.details()
            # what it produced before failing (the SpecEngine commits several tokens a step)
            assert got == expected(f"x {FAIL_MARKER}", len(got)) and 2 <= len(got) < 50
        assert list(bystander.result().token_ids) == expected("bystander ", 60)
    wait_for(kv_full, what="spec KV back to full")
    wait_for(lambda: kv_full(deployment="BatchEngine"), what="batch KV back to full")


def test_unexpected_errors_carry_no_internals(main):
    """An exception inside the engine reaches the client as INTERNAL 'internal error (id ...)':
    none of its text (traceback, pid, node IP, actor id) goes on the wire."""
    import re

    for call in (lambda: main.generate(prompt=f"y {CRASH_MARKER}", max_tokens=20),
                 lambda: list(main.stream(prompt=f"y {CRASH_MARKER}", max_tokens=20))):
        code, details = code_of(call)
        assert code == CODE.INTERNAL and re.fullmatch(r"internal error \(id [0-9a-f]{32}\)", details), details
        for leak in ("Traceback", "pid", "10.1.2.3", "ffff0001", CRASH_TEXT):
            assert leak not in details
    assert list(main.generate(prompt="after", max_tokens=4).token_ids) == expected("after", 4)


def test_proxy_refuses_oversized_messages(main):
    """The gRPC proxy's own cap (the largest app's limit, 1 MiB here) refuses a bigger message
    before any replica sees it: RESOURCE_EXHAUSTED, not the Router's INVALID_ARGUMENT."""
    code, _ = code_of(lambda: main.generate(prompt="z" * (2 << 20), max_tokens=1))
    assert code == CODE.RESOURCE_EXHAUSTED
    code, details = code_of(lambda: main.generate(prompt="z" * 9000, max_tokens=1))  # under the proxy's
    assert code == CODE.INVALID_ARGUMENT and "8192-byte limit" in details
    assert main.generate(prompt="fine", max_tokens=2).token_ids


def test_dead_engine_replica_is_unavailable_then_replaced(addr):
    """The BatchEngine replica dies mid-stream: the stream ends UNAVAILABLE with a plain message
    (no Ray actor ids); Serve replaces the replica and new plain requests succeed on it. On app
    ``sep`` (50 ms steps), mode plain: the module's last test, so no other test meets the kill."""
    import ray

    c = Client(addr, "sep")
    it = c.stream(prompt="doomed ", max_tokens=250, mode=2, timeout=60)
    first = next(it)
    assert first.route.path == 2  # the BatchEngine's stream
    got = list(first.token_ids)
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "sep#BatchEngine" in a["name"]]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)
    with pytest.raises(grpc.RpcError) as e:
        for ch in it:
            got += ch.token_ids
    assert e.value.code() == CODE.UNAVAILABLE and e.value.details() == ENGINE_GONE
    assert got == expected("doomed ", len(got)) and len(got) < 250

    def serving_again():
        try:
            r = c.generate(prompt="reborn ", max_tokens=3, mode=2, timeout=10)
        except grpc.RpcError:
            return False
        return r.route.path == 2 and list(r.token_ids) == expected("reborn ", 3)
    wait_for(serving_again, timeout=120, what="a replacement BatchEngine replica")
