"""OpenAI's Responses API on the Router's HTTP app: ``POST /v1/responses``, ``GET`` and ``DELETE``
``/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``, ``POST /v1/responses/{id}/cancel``
(refused: no response runs in the background).

Owns: one Responses request's life — bearer auth first, then the body (``cluster.api.responses_api``),
the previous response's conversation from the ResponseStore when it names one (400 when the store
does not have it), the chat request that body asks for through the Router's own ``admit`` (so every
rule, limit, route and tool plan is the chat endpoint's) and ``forward``, the response or its
event stream (``cluster.api.responses_api_output``; a stream answers its status once the engine
produced output, so a refused prompt is still a 400), and the record stored for ``store: true``
before the response (or its last event) is sent, so a client that continues it at once finds it.
``store: true`` with ``http.stored_responses`` 0 is 400 (nothing would be kept). A client that
disconnects cancels the task: the engine request is aborted and its KV freed; nothing is stored.
Ignores: the rules themselves, routing policy, how records are kept (``deployments.response_store``).
"""
from __future__ import annotations

import contextlib
import json
import uuid
from typing import TYPE_CHECKING, AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cluster.api.auth import check_bearer
from cluster.api.openai_errors import error_body
from cluster.api.openai_schemas import ChatCompletionRequest, chat_fields, parse_body
from cluster.api.requests import check_size
from cluster.api.responses import Accumulator
from cluster.api.responses_api import ResponseRequest, chat_body, conversation, json_size
from cluster.api.responses_api_output import ResponseEvents, ResponseShape
from cluster.api.responses_input_items import input_items, item_page
from cluster.api.status import ServiceError, invalid
from cluster.telemetry import semconv as sc
from cluster.telemetry.router_telemetry import API_OPENAI, RequestTelemetry

if TYPE_CHECKING:
    from deployments.router import Router


async def _history(router: "Router", body: ResponseRequest) -> list[dict]:
    """The conversation the body continues (none without ``previous_response_id``)."""
    if body.stored and not router.cfg.http.stored_responses:
        raise invalid("store true is not available: this server keeps no responses (http.stored_responses is 0); "
                      "send store: false", "store")
    if not body.previous_response_id:
        return []
    record = None
    if router.cfg.http.stored_responses:
        record = await router.response_store.get.remote(body.previous_response_id)
    if record is None:
        raise invalid(f"previous response {body.previous_response_id!r} not found: it was stored with store false, "
                      "deleted, evicted, or kept by a server since restarted", "previous_response_id")
    return record["conversation"]


async def _store(router: "Router", shape: ResponseShape, history: list[dict], response: dict) -> None:
    if not shape.body.stored:
        return
    turns = conversation(history, shape.body, response["output"])
    record = {"response": response, "conversation": turns, "input_items": input_items(shape.body, shape.id)}
    await router.response_store.put.remote(shape.id, record, json_size(record))


async def lifecycle(router: "Router", raw: bytes, metadata: list, request_id: str,
                    ) -> AsyncIterator[ServiceError | dict | str]:
    """One request: yields a ``ServiceError`` (nothing was sent yet), or the unary response, or
    the stream's events (the first only once the engine produced output)."""
    started, last = False, None
    events: ResponseEvents | None = None
    with RequestTelemetry(router.metrics, model=router.cfg.model, metadata=metadata, operation=sc.OP_CHAT,
                          api=API_OPENAI) as tel:
        try:
            check_size(len(raw), router.limits)  # before parsing what may be a huge body
            check_bearer(metadata, router.token)  # before the store is asked anything
            body = parse_body(raw, ResponseRequest)
            history = await _history(router, body)
            chat = parse_body(json.dumps(chat_body(body, history)).encode(), ChatCompletionRequest)
            vreq, decision = await router.admit(metadata, request_id,
                                                lambda: chat_fields(chat, len(raw), router.served_model))
            tel.set_stream(body.stream)
            tel.routed(vreq, decision, inflight=router.spec_in_flight)
            shape = ResponseShape(request_id, body, router.served_model, decision, chat.tool_plan)
            # a stream's events keep its text and log-probabilities; a unary response's, the accumulator
            events = ResponseEvents(shape) if body.stream else None
            acc = None if body.stream else Accumulator(request_id, decision)
            async with contextlib.aclosing(router.forward(vreq, decision, tel.carrier(), whole=not body.stream)) as outs:
                async for out in outs:
                    tel.output(out, closes=True)
                    if acc is not None:
                        acc.add(out)
                    made = [] if events is None else ([] if started else events.start()) + events.feed(out)
                    if out.finished:  # one whole response, stored before it (or its last event) leaves
                        whole = events.response if acc is None else shape.whole("".join(acc.text), out, acc.logprobs)
                        await _store(router, shape, history, whole)
                        last = None if acc is None else whole
                    for e in made:
                        yield e
                    started = started or bool(made)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status or an error event
            err = router.failure(exc, request_id, metadata, tel)
            if started:
                _, payload = error_body(err)
                last = events.error(payload["error"]["code"], err.message, err.param)
            else:
                last = err
    if last is not None:
        yield last


def add_routes(app: FastAPI, router: "Router", read_body, metadata_of, answer, error) -> None:
    """Mount the Responses API on the Router's OpenAI app, with the app's own bounded body reader,
    header mapping, answer (error, body or event stream, closed on disconnect) and error body."""

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        metadata = metadata_of(request)
        try:
            raw = await read_body(request, router.limits)
        except ServiceError as err:
            return error(err)
        return await answer(lifecycle(router, raw, metadata, uuid.uuid4().hex))

    async def _stored(request: Request, response_id: str) -> dict:
        check_bearer(metadata_of(request), router.token)
        record = None
        if router.cfg.http.stored_responses:
            record = await router.response_store.get.remote(response_id)
        if record is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"response {response_id!r} not found")
        return record

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> Response:
        try:
            return JSONResponse((await _stored(request, response_id))["response"])
        except ServiceError as err:
            return error(err)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request) -> Response:
        try:
            record = await _stored(request, response_id)
            if "input_items" not in record:  # stored by a version that did not keep them
                raise ServiceError(grpc.StatusCode.NOT_FOUND, f"the input items of response {response_id!r} "
                                   "were not stored (it was stored by an earlier version of this server)")
            return JSONResponse(item_page(record["input_items"], dict(request.query_params)))
        except ServiceError as err:
            return error(err)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request) -> Response:
        try:
            await _stored(request, response_id)
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"response {response_id!r} cannot be cancelled: "
                               "only a background response can be, and this server runs none (it refuses "
                               "background: true)")
        except ServiceError as err:
            return error(err)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> Response:
        try:
            await _stored(request, response_id)
            await router.response_store.delete.remote(response_id)
        except ServiceError as err:
            return error(err)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
