"""The OpenAI-compatible HTTP API of the Router replica (the ASGI app Ray Serve's HTTP proxy calls).

Owns: the routes — ``POST /v1/chat/completions``, ``POST /v1/completions`` (unary JSON, or
Server-Sent Events with ``stream: true``), ``GET /v1/models`` and ``GET /v1/models/{model}``,
the Responses API's (mounted from ``deployments.responses_http``),
vLLM's ``POST /tokenize`` and ``POST /detokenize`` (the Router's, gRPC's Tokenize / Detokenize), ``GET /health`` (200 when every
engine is ready, else 503; exempt from auth like gRPC's health check) — and one request's life on
HTTP: the body goes through the Router's own ``admit`` (bearer auth from the ``Authorization``
header, the shared validation via ``openai_schemas`` -> ``RequestFields``, the route decision) and
``forward``; failures become OpenAI error bodies with the status ``http_status`` maps from the same
``ServiceError`` gRPC sees. A stream answers its status only once the first engine output exists,
so a prompt the engine refuses (too long, out-of-range ids) is still a 400, not a 200 with an
error event; a failure after that is one error event and ``data: [DONE]``. ``n`` choices are n engine requests on the route the request
got, run at once (``deployments.openai_choices``); the response waits for all of them, a stream
interleaves their events; ``best_of`` runs that many and answers the n best (never streamed); a
completion's batch of prompts runs each prompt's choices, prompt-major (choice i * n + j). A client that
disconnects cancels the response task: every ``forward``
is closed, which aborts its engine request and frees its KV. ``X-Request-Id`` is the client's label
(``specserve.label``; Ray Serve's proxy sets
one when the client does not, and echoes it in the response header), never the id. Ignores: the rules themselves, routing policy.
"""
from __future__ import annotations

import contextlib
import functools
import time
import uuid
from typing import TYPE_CHECKING, AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from cluster.api.auth import check_bearer
from cluster.api.openai_errors import error_body, error_event, http_error_body
from cluster.api.openai_responses import DONE, Kind, Responder
from cluster.api.openai_schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeBody, TokenizeBody,
                                        chat_fields, check_choices, check_model, completion_batch,
                                        echoed_prompts, num_candidates, parse_body, tokenize_body)
from cluster.api.requests import Limits, check_size
from cluster.api.responses import Accumulator
from cluster.api.status import ServiceError, invalid
from cluster.telemetry import semconv as sc
from cluster.telemetry.router_telemetry import API_OPENAI, RequestTelemetry
from deployments.openai_choices import (best_of_each, choice_outputs, choice_requests, combined_final,
                                        prompt_requests)
from deployments.responses_http import add_routes

if TYPE_CHECKING:
    from deployments.router import Router

LABEL_HEADER = "x-request-id"


def _metadata(request: Request) -> list[tuple[str, str]]:
    """HTTP headers as the (key, value) pairs ``admit`` reads (gRPC's ``request_id`` metadata
    is HTTP's ``X-Request-Id``); ``traceparent`` continues the client's trace."""
    md = [(k.lower(), v) for k, v in request.headers.items() if k.lower() not in (LABEL_HEADER, "request_id")]
    label = request.headers.get(LABEL_HEADER)
    return md + ([("request_id", label)] if label else [])


def _error(err: ServiceError) -> JSONResponse:
    status, body = error_body(err)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


async def _lifecycle(router: "Router", kind: Kind, raw: bytes, metadata: list,
                     request_id: str) -> AsyncIterator[ServiceError | dict | str]:
    """One request: yields a ``ServiceError`` (nothing was sent yet), or the unary body, or the
    stream's events (the first only once the engine produced output)."""
    cls = ChatCompletionRequest if kind is Kind.CHAT else CompletionRequest
    operation = sc.OP_CHAT if kind is Kind.CHAT else sc.OP_TEXT_COMPLETION
    body = None
    batch: list = []  # a completion's prompts' RequestFields; the first is admitted
    started = False

    def read():
        nonlocal body, batch
        check_size(len(raw), router.limits)  # before parsing what may be a huge body
        body = parse_body(raw, cls)
        check_choices(body, router.limits)
        batch = ([chat_fields(body, len(raw), router.served_model)] if kind is Kind.CHAT
                 else completion_batch(body, len(raw), router.served_model))
        return batch[0]

    last: ServiceError | dict | str | None = None  # sent after the telemetry closed: the consumer
    #                                              closes this generator once it has it
    with RequestTelemetry(router.metrics, model=router.cfg.model, metadata=metadata, operation=operation,
                          api=API_OPENAI) as tel:
        try:
            vreq, decision = await router.admit(metadata, request_id, read)
            tel.set_stream(body.stream)
            tel.routed(vreq, decision, inflight=router.spec_in_flight)
            n, each = body.n or 1, num_candidates(body)
            resp = Responder(kind, request_id, vreq.label, router.served_model, decision,
                             include_usage=body.stream and body.include_usage,
                             logprobs=vreq.params.logprobs is not None,
                             tools=body.tool_plan if kind is Kind.CHAT else None,
                             echo=echoed_prompts(body) if kind is Kind.COMPLETION else None, per_prompt=n)
            ranked = each > n  # best_of: more candidates than answers
            choices = [c for p in prompt_requests(vreq, batch, router.limits)
                       for c in choice_requests(p, each, ranked=ranked)]
            accs = [Accumulator(request_id, decision) for _ in choices]
            streams = [functools.partial(router.forward, c, decision, tel.carrier(), whole=not body.stream)
                       for c in choices]
            async with contextlib.aclosing(choice_outputs(streams)) as outputs:
                async for i, out in outputs:
                    tel.output(out, closes=len(choices) == 1)
                    if body.stream and (event := resp.chunk(out, first=not accs[i].text, index=i)):
                        yield event
                        started = True
                    accs[i].add(out)
            final = combined_final([a.final for a in accs], per_prompt=each)
            if len(choices) > 1:
                tel.output(final)  # the request's usage and counters: all its choices'
            if ranked:
                best = [accs[i] for i in best_of_each([a.logprobs for a in accs], each, n)]
                last = resp.body(best, final, completion_tokens=sum(len(a.token_ids) for a in accs))
            elif not body.stream:
                last = resp.body(accs, final)
            elif resp.include_usage:
                yield resp.usage_chunk(final, sum(len(a.token_ids) for a in accs))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status or an error event
            err = router.failure(exc, request_id, metadata, tel)
            last = error_event(err) if started else err
    if last is not None:
        yield last
    if started:
        yield DONE


async def _relay(first: str, events: AsyncIterator) -> AsyncIterator[str]:
    try:
        yield first
        async for event in events:
            yield event
    finally:  # also on disconnect (the task is cancelled): close the request, free its KV
        await events.aclose()


async def _read_body(request: Request, limits: Limits) -> bytes:
    """The body, never buffered past the size cap: a declared ``Content-Length`` over it is refused
    before reading, and a chunked upload stops at the first chunk that crosses it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit():
        check_size(int(declared), limits)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_message_bytes:
            raise invalid(f"request body is over the {limits.max_message_bytes}-byte limit "
                          f"(stopped reading at {size} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


async def _complete(router: "Router", request: Request, kind: Kind) -> Response:
    request_id = uuid.uuid4().hex
    metadata = _metadata(request)
    try:
        raw = await _read_body(request, router.limits)
    except ServiceError as err:
        return _error(err)
    return await _answer(_lifecycle(router, kind, raw, metadata, request_id))


async def _answer(events: AsyncIterator[ServiceError | dict | str]) -> Response:
    """A lifecycle's answer: its error, its unary body, or the stream of its events."""
    first = await events.__anext__()
    if isinstance(first, ServiceError):
        await events.aclose()
        return _error(first)
    if isinstance(first, dict):
        await events.aclose()
        return JSONResponse(first)
    return StreamingResponse(_relay(first, events), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def build_openai_app(router: "Router") -> FastAPI:
    app = FastAPI(title="specserve (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)
    started = int(time.time())

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> Response:  # unknown path, method
        return JSONResponse(http_error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _complete(router, request, Kind.CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(router, request, Kind.COMPLETION)

    def card() -> dict:
        return {"id": router.served_model, "object": "model", "created": started, "owned_by": "specserve"}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            check_bearer(_metadata(request), router.token)
        except ServiceError as err:
            return _error(err)
        return JSONResponse({"object": "list", "data": [card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> Response:
        try:
            check_bearer(_metadata(request), router.token)
            if model != router.served_model:
                raise ServiceError(grpc.StatusCode.NOT_FOUND, f"the model {model!r} does not exist; this server "
                                   f"serves {router.served_model!r}", "model")
        except ServiceError as err:
            return _error(err)
        return JSONResponse(card())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:  # vLLM's: the ids a request would feed the model
        metadata = _metadata(request)
        try:
            raw = await _read_body(request, router.limits)
            out = await router.tokenize(
                metadata, lambda: tokenize_body(parse_body(raw, TokenizeBody), router.served_model), len(raw))
        except Exception as exc:  # noqa: BLE001 - every failure becomes an error body
            return _error(router.plain_failure(exc, metadata))
        return JSONResponse({"count": len(out["token_ids"]), "max_model_len": out["max_model_len"],
                             "tokens": out["token_ids"]})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:  # vLLM's: token ids -> their text
        metadata = _metadata(request)

        def read() -> list[int]:
            body = parse_body(raw, DetokenizeBody)
            check_model(body, router.served_model)
            return body.tokens

        try:
            raw = await _read_body(request, router.limits)
            text = await router.detokenize(metadata, read, len(raw))
        except Exception as exc:  # noqa: BLE001
            return _error(router.plain_failure(exc, metadata))
        return JSONResponse({"prompt": text})

    add_routes(app, router, _read_body, _metadata, _answer, _error)  # /v1/responses (deployments.responses_http)

    @app.get("/health")
    async def health() -> Response:
        ok = await router.serving()
        return JSONResponse({"status": "ok" if ok else "loading", "spec_ready": router.spec_ready,
                             "batch_ready": router.batch_ready}, status_code=200 if ok else 503)

    return app
