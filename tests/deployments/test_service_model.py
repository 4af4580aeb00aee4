"""The Serve app on the real default model (SmolLM2-135M): greedy outputs through the gRPC front
door equal Hugging Face ``generate`` on the spec and plain paths, with shared and separate
placement; a DraftServer killed mid-stream; an engine core process killed mid-stream (the stream
ends UNAVAILABLE, Serve replaces the replica); cancellation frees KV on target and draft.

Near ties: at the first divergence (if any) both tokens must be within 1e-3 in the HF logits —
batched verification may reorder float sums; never a looser rule.
"""
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from cluster.api.status import ENGINE_GONE
from tests.deployments.harness import SMALL, Client
from tests.deployments.test_service_fake import _kill_draft_server, engine_stats, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.model]
WORKLOADS = Path(__file__).resolve().parents[3] / "shared" / "workloads"
N = 24
CANCEL_ATTEMPTS = 3  # a cancellation the gRPC proxy loses (a Ray Serve gap) is tried again


def real_args(**over) -> dict:
    eng = {**SMALL, "num_cpus": 0.2, "max_num_seqs": 4, "kv_cache_memory_mb": 64}
    args = {"model": "default", "drafter": "ngram", "num_draft_tokens": 4, "torch_threads": 1,
            "router_deployment": SMALL, "spec_engine": eng, "batch_engine": eng,
            "draft_server": {**SMALL, "host": "127.0.0.1", "timeout_s": 2.0},
            "limits": {"max_tokens": 256, "max_prompt_tokens": 1024, "max_message_bytes": 65536,
                       "max_queue": 16}}
    args.update(over)
    return args


def prompts() -> list[str]:
    out = []
    for name in ("code", "summarize"):
        with open(WORKLOADS / f"{name}.jsonl") as f:
            out.append(json.loads(f.readline())["prompt"][:400])
    return out


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster.models.loader import resolve_model

    torch.set_num_threads(1)
    path = resolve_model("default").path
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return tok, model


def hf_greedy(hf, prompt: str, n: int) -> tuple[list[int], list[int]]:
    tok, model = hf
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


def assert_greedy_equal(hf, prompt_ids: list[int], got: list[int], want: list[int]) -> None:
    eos = hf[0].eos_token_id
    want = [t for t in want]
    if got == want or (want and want[-1] == eos and got == want[:-1]):
        return
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert i < min(len(got), len(want)), f"length differs: got {got}, want {want}"
    with torch.no_grad():
        logits = hf[1](torch.tensor([prompt_ids + want[:i]])).logits[0, -1]
    gap = abs(float(logits[got[i]] - logits[want[i]]))
    assert gap < 1e-3, f"diverged at {i}: got {got[i]} want {want[i]} (logit gap {gap:.4g})"


@pytest.fixture(scope="module")
def addr(serve_shared):
    apps = {"shared": real_args(), "sep": real_args(placement="separate")}
    with serve_shared.apps(apps, timeout_s=300) as a:
        for name in apps:
            Client(a.grpc, name).wait_ready(timeout_s=300)
        yield a.grpc


@pytest.mark.parametrize("app", ["shared", "sep"])
def test_greedy_equals_hf_on_both_paths(addr, hf, app, profile):
    c = Client(addr, app)
    for prompt in prompts()[:profile.pick(short=1, long=2)]:  # the short profile: the code prompt
        prompt_ids, want = hf_greedy(hf, prompt, N)
        for mode, path in ((1, 1), (2, 2)):  # SPECULATIVE, PLAIN
            r = c.generate(prompt=prompt, max_tokens=N, mode=mode, timeout=120)
            assert r.route.path == path and r.usage.prompt_tokens == len(prompt_ids)
            assert_greedy_equal(hf, prompt_ids, list(r.token_ids), want)
            chunks = list(c.stream(prompt=prompt, max_tokens=N, mode=mode, timeout=120))
            assert_greedy_equal(hf, prompt_ids, [t for ch in chunks for t in ch.token_ids], want)
            assert chunks[-1].finished and chunks[0].route.path == path
            if path == 1:
                assert r.spec.drafts > 0  # verification steps really carried drafts


def test_draft_server_killed_mid_stream_then_speculation_resumes(addr, hf):
    c = Client(addr, "sep")
    prompt = prompts()[0]
    prompt_ids, want = hf_greedy(hf, prompt, 48)
    before = engine_stats("sep", "SpecEngine")
    it = c.stream(prompt=prompt, max_tokens=48, mode=1, timeout=180)
    got = list(next(it).token_ids)
    _kill_draft_server()
    got += [t for ch in it for t in ch.token_ids]
    assert_greedy_equal(hf, prompt_ids, got, want)  # completed with the right tokens

    def speculating_again():  # drafts reached verification again: the new DraftServer answers
        r = c.generate(prompt=prompt, max_tokens=N, mode=1, timeout=120)
        return r.spec.drafts > 0
    wait_for(speculating_again, timeout=120, what="speculation to resume on a new DraftServer")
    after = engine_stats("sep", "SpecEngine")
    assert after["draft_epoch_changes"] >= 1
    assert after["draft_fallbacks"] + after["draft_resyncs"] > before["draft_fallbacks"] + before["draft_resyncs"]


def test_cancel_mid_stream_frees_kv_on_target_and_draft(addr):
    """The cancellation must reach the engine replica (``requests_abandoned``: a stream closed before
    its final output) and free KV on target and draft. A real model streams without pause, so a
    cancellation can meet Ray Serve's gRPC proxy mid-chunk, where the proxy loses it
    (docs/reliability.md#cancellation) and the request runs on to max_tokens by itself: such an
    attempt is told apart by the counter and tried again, up to CANCEL_ATTEMPTS."""
    from ray import serve

    c = Client(addr, "sep")

    def freed():
        s = engine_stats("sep", "SpecEngine")
        draft = serve.get_deployment_handle("DraftServer", app_name="sep").info.remote().result(timeout_s=10)
        return (s["num_running"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
                and draft["num_sequences"] == 0)

    lost = 0
    for _ in range(CANCEL_ATTEMPTS):
        abandoned = engine_stats("sep", "SpecEngine")["requests_abandoned"]
        it = c.stream(prompt="Count slowly: one, two, three,", max_tokens=200, ignore_eos=True, mode=1,
                      timeout=180)
        next(it)
        next(it)
        s = engine_stats("sep", "SpecEngine")
        assert s["kv_blocks_free"] < s["kv_blocks_total"]
        it.cancel()
        wait_for(freed, timeout=60, what="KV pool full again on target and draft")
        if engine_stats("sep", "SpecEngine")["requests_abandoned"] == abandoned + 1:
            return
        lost += 1
    pytest.fail(f"none of {CANCEL_ATTEMPTS} cancelled streams reached the engine replica as a cancellation "
                f"(each ran to its end: {lost} lost)")


def test_engine_core_killed_mid_stream_fails_it_then_replica_is_replaced(addr, hf):
    import grpc

    c = Client(addr, "shared")
    core = engine_stats("shared", "BatchEngine")["engine_pid"]
    assert core != os.getpid()
    it = c.stream(prompt="Count slowly: one, two, three,", max_tokens=200, ignore_eos=True, mode=2,
                  timeout=180)
    got = list(next(it).token_ids)
    os.kill(core, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as err:
        for ch in it:
            got += ch.token_ids
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    # the client gets the fixed message (the exit code and pid stay in the replica's log)
    assert err.value.details() == ENGINE_GONE and len(got) < 200

    prompt = prompts()[1]
    prompt_ids, want = hf_greedy(hf, prompt, N)

    def served_again():  # health check fails -> Serve starts a new BatchEngine replica
        try:
            r = c.generate(prompt=prompt, max_tokens=N, mode=2, timeout=60)
        except grpc.RpcError:
            return False
        assert_greedy_equal(hf, prompt_ids, list(r.token_ids), want)
        return True
    wait_for(served_again, timeout=180, what="a new BatchEngine replica to serve")
    assert engine_stats("shared", "BatchEngine")["engine_pid"] not in (core, None)
