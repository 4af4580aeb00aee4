"""Drive a synchronous engine to completion and collect per-request results."""
from __future__ import annotations

from cluster.common.request import GenerationRequest, SamplingParams


def prompt_ids(tokenizer, row: dict) -> list[int]:
    from cluster.models.tokenizer import prompt_token_ids

    return prompt_token_ids(tokenizer, row)


def run_to_completion(engine, requests: list[GenerationRequest], join_at: dict[str, int] | None = None,
                      abort_at: dict[str, int] | None = None) -> dict[str, dict]:
    """Step until all finish. join_at: request id -> step at which it is submitted (default 0);
    abort_at: request id -> step after which it is cancelled."""
    join_at = join_at or {}
    abort_at = abort_at or {}
    pending = {r.request_id: r for r in requests}
    res: dict[str, dict] = {}
    step = 0
    while pending or engine.has_work():
        for rid in [rid for rid, r in pending.items() if join_at.get(rid, 0) <= step]:
            engine.add_request(pending.pop(rid))
        for rid, at in abort_at.items():
            if at == step:
                out = engine.abort(rid)
                if out is not None:
                    _collect(res, out)
        for out in engine.step():
            _collect(res, out)
        step += 1
        assert step < 10_000, "engine did not finish"
    return res


async def consume_stream(engine, request: GenerationRequest) -> tuple[list[int], str, object]:
    """Iterate an async engine's stream: (token ids, text, last delta)."""
    ids, text, last = [], "", None
    async for out in engine.generate(request):
        ids += out.new_token_ids
        text += out.text_delta
        last = out
    return ids, text, last


def assert_streams_match(expected: dict[str, dict], requests, got) -> None:
    """Streams (``consume_stream`` results, in request order) equal the synchronous engine's."""
    for req, (ids, text, last) in zip(requests, got, strict=True):
        assert ids == expected[req.request_id]["ids"]
        assert text == expected[req.request_id]["text"]
        assert last.finished and last.finish_reason is expected[req.request_id]["finish"]


async def wait_pool_full(engine, tries: int = 250):
    """Poll an async engine's stats until no request runs and every KV block is free; the last
    snapshot (the caller asserts on it)."""
    import asyncio

    for _ in range(tries):
        st = engine.stats()
        if st.kv_blocks_free == st.kv_blocks_total and st.num_running == 0:
            break
        await asyncio.sleep(0.02)
    return st


def _collect(res: dict, out) -> None:
    r = res.setdefault(out.request_id, {"ids": [], "text": "", "finish": None, "spec": None, "cached": 0,
                                        "error": None})
    r["ids"] += out.new_token_ids
    r["text"] += out.text_delta
    if out.finished:
        r["finish"] = out.finish_reason
        r["spec"] = out.spec
        r["cached"] = out.num_cached_tokens
        r["error"] = out.error


def greedy_requests(tokenizer, rows: list[dict], max_tokens: int) -> list[GenerationRequest]:
    return [GenerationRequest(r["id"], prompt_ids(tokenizer, r), SamplingParams(max_tokens=max_tokens),
                              segment=r.get("segment", "default")) for r in rows]
