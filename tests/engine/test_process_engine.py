"""Process engine: the step loop in an engine core process gives the same streams as the
synchronous engine (plain and speculative), refuses bad and excess requests before the core sees
them, frees KV on cancel, and fails open requests (never hangs them) when the core dies."""
from __future__ import annotations

import asyncio
import os
import pickle
import signal

import pytest

from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.errors import EngineOverloadedError, EngineUnavailableError, InvalidRequestError
from cluster.common.request import GenerationRequest, SamplingParams
from cluster.engine.process_engine import ProcessEngine
from cluster.kvsync.client import RemoteProposer
from tests.engine.helpers import (
    assert_streams_match, consume_stream, run_to_completion, wait_pool_full,
)
from tests.engine.test_llm_engine import engine_on

PROMPTS = ["def add(a, b):\n", "The three primary colors are", "Bonjour, je m'appelle"]
BOUND_S = 240  # every test's event loop is bounded (model load in the core included)


def _reqs(tok, n=3, max_tokens=12):
    return [GenerationRequest(f"r{i}", tok(PROMPTS[i % 3], add_special_tokens=False)["input_ids"],
                              SamplingParams(max_tokens=max_tokens)) for i in range(n)]


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, BOUND_S))


@pytest.mark.parametrize("spec", [None, SpecConfig(drafter="ngram", num_draft_tokens=4)],
                         ids=["plain", "ngram"])
def test_streams_match_sync_engine_and_cancel_frees_kv(default_model, spec):
    tok = default_model.tokenizer
    expected = run_to_completion(engine_on(default_model), _reqs(tok))
    eng = ProcessEngine(EngineConfig(torch_threads=1, spec=spec))

    async def main():
        await eng.start()
        assert eng.pid != os.getpid() and eng.ready()
        assert eng.tokenize(PROMPTS[0]) == tok(PROMPTS[0], add_special_tokens=False)["input_ids"]
        got = await asyncio.gather(*(consume_stream(eng, r) for r in _reqs(tok)))
        asked = _reqs(tok, n=1)[0]
        asked.params.logprobs = 2
        lps = [lp async for out in eng.generate(asked) for lp in out.logprobs]  # across the process boundary
        long = GenerationRequest("long", eng.tokenize("Once upon a time"), SamplingParams(max_tokens=200))
        n = 0
        async for out in eng.generate(long):
            n += len(out.new_token_ids)
            if n >= 3:
                break  # closing the iterator cancels the request in the core
        st = await wait_pool_full(eng)
        info = eng.model_info()
        await eng.shutdown()
        return got, n, st, info, lps, [eng.token_bytes(lp.chosen.token_id) for lp in lps]

    got, n, st, info, lps, spelt = _run(main())
    assert_streams_match(expected, _reqs(tok), got)
    assert [lp.chosen.token_id for lp in lps] == expected["r0"]["ids"] and all(len(lp.top) == 2 for lp in lps)
    assert b"".join(spelt).decode() == expected["r0"]["text"]  # the parent's tokenizer spells them
    assert n >= 3
    assert st.kv_blocks_free == st.kv_blocks_total and st.num_running == 0 and st.num_waiting == 0
    assert info["vocab_size"] == default_model.runner.vocab_size and info["spec_enabled"] is (spec is not None)
    if spec is not None:  # the core's speculation statistics reach the replica's snapshot
        assert sum(s["draft_tokens"] for s in st.spec_by_segment.values()) > 0
    assert not eng.ready() and eng._proc.returncode == 0


def test_refuses_bad_and_excess_requests_before_the_core(default_model):
    tok = default_model.tokenizer
    eng = ProcessEngine(EngineConfig(torch_threads=1, max_queue=1, max_num_seqs=1))

    async def main():
        await eng.start()
        vocab = eng.model_info()["vocab_size"]
        for bad, msg in [([], "prompt is empty"), ([vocab + 5], "outside the vocabulary"),
                         ([1] * 10, "exceeds the context length")]:
            params = SamplingParams(max_tokens=10**6 if msg.startswith("exceeds") else 4)
            with pytest.raises(InvalidRequestError, match=msg):
                await eng.generate(GenerationRequest("bad", bad, params)).__anext__()
        reqs = _reqs(tok, n=3, max_tokens=30)
        gens = [eng.generate(r) for r in reqs]
        first = await gens[0].__anext__()  # r0 running
        second = asyncio.ensure_future(gens[1].__anext__())  # r1 submitted, no output yet
        await asyncio.sleep(0.05)
        with pytest.raises(EngineOverloadedError, match="waiting queue is full"):
            await gens[2].__anext__()
        await gens[0].aclose()
        out = await second
        await gens[1].aclose()
        st = await wait_pool_full(eng)
        await eng.shutdown()
        return first, out, st

    first, out, st = _run(main())
    assert first.request_id == "r0" and out.request_id == "r1"
    assert st.kv_blocks_free == st.kv_blocks_total


def test_core_death_fails_open_requests_and_refuses_new_ones(default_model):
    tok = default_model.tokenizer
    eng = ProcessEngine(EngineConfig(torch_threads=1))

    async def main():
        await eng.start()
        req = GenerationRequest("long", eng.tokenize("Once upon a time"),
                                SamplingParams(max_tokens=400, ignore_eos=True))
        outs = []
        with pytest.raises(EngineUnavailableError, match=r"engine process exited \(code -9\)"):
            async for out in eng.generate(req):
                outs.append(out)
                if len(outs) == 2:
                    os.kill(eng.pid, signal.SIGKILL)
        with pytest.raises(EngineUnavailableError, match="engine process exited"):
            await eng.generate(_reqs(tok, n=1)[0]).__anext__()
        ready = eng.ready()
        await eng.shutdown()
        return outs, ready

    outs, ready = _run(main())
    assert len(outs) >= 2 and not any(o.finished for o in outs)
    assert not ready


def test_start_failure_is_reported_not_hung():
    eng = ProcessEngine(EngineConfig(model="/nonexistent/model-dir", torch_threads=1))
    with pytest.raises(EngineUnavailableError, match="nonexistent"):
        _run(eng.start())
    assert not eng.ready()


def test_remote_proposer_travels_without_connection_state():
    p = RemoteProposer("127.0.0.1:1", timeout_s=0.5, retry_after_s=0.1)
    p._sent["s"] = [1, 2, 3]
    q = pickle.loads(pickle.dumps(p))
    assert q.address == "127.0.0.1:1" and q.timeout_s == 0.5 and q.retry_after_s == 0.1
    assert q.tracked() == {} and q._channel is None
    q.set_address("127.0.0.1:2")  # the lock is a fresh one
    assert q.address == "127.0.0.1:2" and p.address == "127.0.0.1:1"


from tests.speculative.test_eagle import engine, head_dir, requests, tiny  # noqa: E402,F401 (fixtures)


def test_remote_eagle_reads_the_features_of_the_target_in_the_core(tiny, head_dir):
    """Placement separate through the engine core process: the KVSync proposer shipped to the core
    taps the core's target runner, so the DraftServer's head gets features and drafts; streams
    equal plain decoding."""
    from cluster.kvsync.budget import DraftBudget
    from cluster.kvsync.drafters import build_remote_proposer
    from cluster.kvsync.server import DraftServerCore, start_server
    from cluster.speculative.proposer import parse_drafter_choice

    path, model = tiny
    draft, vocab = build_remote_proposer(parse_drafter_choice(f"eagle:{head_dir}"), str(path), "float32",
                                         target=model)
    core = DraftServerCore(draft, vocab_size=vocab, drafter="eagle")
    server, port = start_server(core, host="127.0.0.1")
    params = lambda i: SamplingParams(max_tokens=12)  # noqa: E731
    expected = run_to_completion(engine(model, None), requests(params))
    remote = RemoteProposer(f"127.0.0.1:{port}", timeout_s=30.0, budget=DraftBudget(factor=100.0, cap_s=30.0))
    eng = ProcessEngine(EngineConfig(model=str(path), torch_threads=1, max_num_seqs=8,
                                     spec=SpecConfig(drafter=f"eagle:{head_dir}", num_draft_tokens=3)),
                        proposer=remote)

    async def main():
        await eng.start()
        got = await asyncio.gather(*(consume_stream(eng, r) for r in requests(params)))
        st = await wait_pool_full(eng)
        await eng.shutdown()
        return got, st

    try:
        got, st = _run(main())
    finally:
        server.stop(0)
    assert_streams_match(expected, requests(params), got)
    assert sum(s["draft_tokens"] for s in st.spec_by_segment.values()) > 0
    assert st.draft_fallbacks == 0
