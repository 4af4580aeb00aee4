"""OpenAI's ``n``: one HTTP request answered with n choices, each its own engine request.

Owns: turning one validated request into its n choices (``choice_requests``: choice i has the
server id ``<id>-<i>`` — its engine request id and KVSync seq id — and, when the client set a
``seed``, the seed ``seed + i`` mod 2^64, so a seeded request is reproducible and its choices still
differ; greedy choices are identical, as OpenAI's), running them at once on the path the Router
chose for the request (``choice_outputs``: every choice's outputs as (index, output) in the order
they come; the first failure fails the request and cancels the rest, and closing it cancels every
choice still running, which aborts its engine request and frees its KV), and the request's
summary for telemetry (``combined_final``: the choices' token counts and speculation counters
summed). A completion's ``best_of``: that many candidates run as choices do, each reporting its
tokens' log-probabilities, and ``best_choices`` picks the n answered. A completion's batch of
prompts: one request per prompt (``prompt_requests``), each with its choices, prompt-major. Every choice enters the
Router's in-flight count on its path, so n choices load the route decision and overflow balancing
as n requests do. Ignores: response shapes
(``cluster.api.openai_responses``), validation (``n``'s range is ``limits.max_choices``).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from typing import AsyncIterator, Callable

from cluster.api.requests import Limits, RequestFields, ValidatedRequest, validate_fields
from cluster.common.request import RequestOutput, SpecStats, TokenLogprobs

_SEEDS = 1 << 64


def prompt_requests(vreq: ValidatedRequest, batch: list[RequestFields], limits: Limits) -> list[ValidatedRequest]:
    """A completion's batch of prompts: the admitted request (its first prompt's) once per prompt,
    prompt i with the server id ``<id>-<i>`` and its own prompt, checked by the shared rules
    (``validate_fields``); itself for a batch of one."""
    if len(batch) == 1:
        return [vreq]
    return [dataclasses.replace(vreq, request_id=f"{vreq.request_id}-{i}",
                                prompt=validate_fields(f, vreq.request_id, limits).prompt)
            for i, f in enumerate(batch)]


def choice_requests(vreq: ValidatedRequest, n: int, ranked: bool = False) -> list[ValidatedRequest]:
    """The engine requests of a request with ``n`` choices (itself when n is 1); ``ranked``
    (best_of): each also reports its tokens' log-probabilities, which ``best_choices`` ranks by."""
    if ranked and vreq.params.logprobs is None:
        vreq = dataclasses.replace(vreq, params=dataclasses.replace(vreq.params, logprobs=0))
    if n == 1:
        return [vreq]
    seed = vreq.params.seed
    return [dataclasses.replace(
        vreq, request_id=f"{vreq.request_id}-{i}",
        params=vreq.params if seed is None else dataclasses.replace(vreq.params, seed=(seed + i) % _SEEDS))
        for i in range(n)]


async def choice_outputs(
        streams: list[Callable[[], AsyncIterator[RequestOutput]]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from every choice's stream (``streams[i]()`` opens choice i), as they
    come; one choice's exception is raised here once, after which every other choice is cancelled."""
    if len(streams) == 1:  # no tasks, no queue: the request's own stream
        async with contextlib.aclosing(streams[0]()) as outputs:
            async for out in outputs:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))  # a slow client slows the choices

    async def pump(i: int) -> None:
        try:
            async with contextlib.aclosing(streams[i]()) as outputs:
                async for out in outputs:
                    await queue.put((i, out))
            await queue.put((i, None))
        except Exception as exc:  # noqa: BLE001 - raised in the consumer, once
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    try:
        running = len(streams)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:  # done, failed, or closed by a client that left: nothing keeps running
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def best_of_each(candidates: list[list[TokenLogprobs]], each: int, n: int) -> list[int]:
    """``best_choices`` for every prompt of a batch: candidates are prompt-major, ``each`` to a
    prompt; the answered indices, prompt by prompt."""
    return [start + i for start in range(0, len(candidates), each)
            for i in best_choices(candidates[start : start + each], n)]


def best_choices(candidates: list[list[TokenLogprobs]], n: int) -> list[int]:
    """OpenAI's ``best_of``: the indices of the ``n`` candidates with the highest log-probability
    per token (the mean of their output tokens' log-probabilities under the target's raw
    distribution), best first; ties keep the candidates' order, and a candidate with no tokens
    ranks last."""
    def score(i: int) -> float:
        lps = candidates[i]
        return sum(t.chosen.logprob for t in lps) / len(lps) if lps else -math.inf

    return sorted(range(len(candidates)), key=lambda i: -score(i))[:n]


def combined_final(finals: list[RequestOutput], per_prompt: int | None = None) -> RequestOutput:
    """One finished output that stands for all the choices: the first choice's, with the output
    tokens, prediction counts and speculation counters of all of them; ``per_prompt``: the choices
    are a batch's, prompt-major, this many to a prompt (the prompt tokens of each prompt, once)."""
    first = finals[0]
    if len(finals) == 1:
        return first
    each_prompt = finals[:: per_prompt or len(finals)]  # a prompt's first choice stands for its prompt
    prompt_tokens = sum(f.num_prompt_tokens for f in each_prompt)
    spec = None
    if any(f.spec is not None for f in finals):
        spec = SpecStats()
        for f in finals:
            if f.spec is not None:
                spec.merge(f.spec)
    return dataclasses.replace(
        first, new_token_ids=[], text_delta="", logprobs=[], spec=spec, num_prompt_tokens=prompt_tokens,
        num_cached_tokens=sum(f.num_cached_tokens for f in each_prompt),
        num_output_tokens=sum(f.num_output_tokens for f in finals),
        accepted_prediction_tokens=sum(f.accepted_prediction_tokens for f in finals),
        rejected_prediction_tokens=sum(f.rejected_prediction_tokens for f in finals))
