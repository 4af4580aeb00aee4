"""Async engine: concurrent streams equal the synchronous engine, closing a stream cancels the
request and frees its KV at once, the bounded queue refuses with EngineOverloadedError."""
from __future__ import annotations

import asyncio

import pytest

from cluster.common.errors import EngineOverloadedError, InvalidRequestError
from cluster.common.request import GenerationRequest, SamplingParams
from cluster.engine.async_engine import AsyncEngine
from tests.engine.helpers import (
    assert_streams_match, consume_stream, run_to_completion, wait_pool_full,
)
from tests.engine.test_llm_engine import engine_on


def _reqs(tok, n=3, max_tokens=12):
    prompts = ["def add(a, b):\n", "The three primary colors are", "Bonjour, je m'appelle"]
    return [GenerationRequest(f"r{i}", tok(prompts[i % 3], add_special_tokens=False)["input_ids"],
                              SamplingParams(max_tokens=max_tokens)) for i in range(n)]


def test_streams_match_sync_engine_and_cancel_frees_kv(default_model):
    tok = default_model.tokenizer
    expected = run_to_completion(engine_on(default_model), _reqs(tok))
    eng = AsyncEngine(engine_on(default_model).config, engine=engine_on(default_model))

    async def cancel_midway(req):
        n = 0
        async for out in eng.generate(req):
            n += len(out.new_token_ids)
            if n >= 3:
                break  # closing the iterator cancels the request
        return n

    async def main():
        await eng.start()
        got = await asyncio.gather(*(consume_stream(eng, r) for r in _reqs(tok)))
        long = GenerationRequest("long", tok("Once upon a time", add_special_tokens=False)["input_ids"],
                                 SamplingParams(max_tokens=200))
        n = await cancel_midway(long)
        st = await wait_pool_full(eng)  # the loop thread frees the blocks at its next step boundary
        with pytest.raises(InvalidRequestError):
            async for _ in eng.generate(GenerationRequest("bad", [], SamplingParams())):
                pass
        await eng.shutdown()
        return got, n, st

    got, n, st = asyncio.run(main())
    assert_streams_match(expected, _reqs(tok), got)
    assert n >= 3
    assert st.kv_blocks_free == st.kv_blocks_total and st.num_running == 0 and st.num_waiting == 0


def test_bounded_queue_refuses_when_full(default_model):
    tok = default_model.tokenizer
    base = engine_on(default_model, max_queue=1, max_num_seqs=1)
    eng = AsyncEngine(base.config, engine=base)

    async def main():
        await eng.start()
        reqs = _reqs(tok, n=3, max_tokens=30)
        gens = [eng.generate(r) for r in reqs]
        first = await gens[0].__anext__()  # r0 running
        second = asyncio.ensure_future(gens[1].__anext__())  # r1 waiting (queue now full)
        await asyncio.sleep(0.05)
        with pytest.raises(EngineOverloadedError):
            await gens[2].__anext__()
        await gens[0].aclose()
        out = await second
        await gens[1].aclose()
        await eng.shutdown()
        return first, out

    first, out = asyncio.run(main())
    assert first.request_id == "r0" and out.request_id == "r1"
    assert base.runner.kv.num_free_blocks == base.runner.kv.num_blocks


def test_slow_consumer_gets_merged_deltas_with_identical_tokens(default_model):
    tok = default_model.tokenizer
    expected = run_to_completion(engine_on(default_model), _reqs(tok, n=1, max_tokens=16))["r0"]
    eng = AsyncEngine(engine_on(default_model).config, engine=engine_on(default_model))

    async def main():
        await eng.start()
        deltas = []
        async for out in eng.generate(_reqs(tok, n=1, max_tokens=16)[0]):
            deltas.append(out)
            await asyncio.sleep(0.3)  # slower than the engine's steps
        await eng.shutdown()
        return deltas

    deltas = asyncio.run(main())
    assert [t for d in deltas for t in d.new_token_ids] == expected["ids"]
    assert "".join(d.text_delta for d in deltas) == expected["text"]
    assert len(deltas) < len(expected["ids"]) and deltas[-1].finished
    assert sum(d.finished for d in deltas) == 1
