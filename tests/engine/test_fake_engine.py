"""The fake engine's own contract: the deterministic target and the hold marker tests lean on."""
import asyncio

from cluster.common.config import EngineConfig
from cluster.common.request import FinishReason, GenerationRequest, SamplingParams
from cluster.engine.fake_engine import HOLD_MARKER, FakeEngine


def _request(engine: FakeEngine, rid: str, prompt: str, n: int) -> GenerationRequest:
    return GenerationRequest(rid, engine.tokenize(prompt), SamplingParams(max_tokens=n, temperature=0.0))


def test_target_repeats_the_prompt_and_finishes_at_max_tokens():
    async def run():
        engine = FakeEngine(EngineConfig(), token_delay_s=0.0)
        await engine.start()
        outs = [o async for o in engine.generate(_request(engine, "a", "abc", 7))]
        return engine, outs

    engine, outs = asyncio.run(run())
    ids = [t for o in outs for t in o.new_token_ids]
    assert ids == engine.tokenize("abcabca")
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert engine.stats().num_running == 0


def test_held_request_keeps_its_slot_until_cancelled():
    async def run():
        engine = FakeEngine(EngineConfig(), token_delay_s=0.001)
        await engine.start()
        gen = engine.generate(_request(engine, "h", "x" + HOLD_MARKER, 200))
        first = await gen.__anext__()
        nxt = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.3)  # 300 steps' worth of time: an unheld request would be done
        held = (nxt.done(), engine.stats().num_running, engine.stats().kv_blocks_free)
        nxt.cancel()
        try:
            await nxt
        except asyncio.CancelledError:
            pass
        await gen.aclose()
        return first, held, engine.stats()

    first, (done, running, free), after = asyncio.run(run())
    assert first.new_token_ids and not first.finished
    assert (done, running) == (False, 1) and free < after.kv_blocks_total
    assert after.num_running == 0 and after.kv_blocks_free == after.kv_blocks_total


def test_held_request_finishes_by_itself_after_the_hold_limit():
    async def run():
        engine = FakeEngine(EngineConfig(), token_delay_s=0.001, hold_limit_s=0.2)
        await engine.start()
        t0 = asyncio.get_running_loop().time()
        outs = [o async for o in engine.generate(_request(engine, "h", "x" + HOLD_MARKER, 20))]
        return asyncio.get_running_loop().time() - t0, outs, engine.stats()

    took, outs, after = asyncio.run(run())
    assert took >= 0.2 and outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 20
    assert after.num_running == 0 and after.kv_blocks_free == after.kv_blocks_total
