"""Shared body of the SpecEngine and BatchEngine deployments: one ``EngineProtocol`` per replica.

Owns: constructing the injected engine class from ``AppConfig`` (torch threads per replica),
starting it in the background so the replica is up at once and ``ready()`` reports the engine's
real readiness, tokenizing + checking prompts next to the model (and, asked alone, tokenizing a
prompt or spelling token ids: ``tokenize`` / ``detokenize``), and streaming ``RequestOutput``
deltas back to the Router (or, with ``whole``, one merged final output: unary ``Generate`` needs no
per-token messages through the Ray hops) — or one ``EngineFailure`` record instead of raising, so
the Router can set a precise gRPC status; an unexpected exception's detail goes to this replica's
log with the request's server id, the record says only ``internal error (id ...)``. Each output (and prompt)
token's log-probabilities (when asked) get the token's bytes here, next to the
tokenizer. A request
that sent a prediction gets, on its final output, how much of it the output kept
(``prediction_overlap``, off the event loop). Closing the stream (client cancelled, deadline) aborts the request,
which frees its KV blocks on target and draft. Ignores: routing, gRPC.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
from typing import AsyncIterator

from cluster.api.requests import PromptInput, ValidatedRequest, to_generation_request, tokenize_prompt
from cluster.api.status import EngineFailure, FailureKind
from cluster.common.request import Logprob, RequestOutput, TokenLogprobs, merge_outputs
from cluster.telemetry.metrics import SpecserveMetrics, export_engine_stats_forever
from cluster.telemetry.tracing import configure_from_section
from deployments.app_config import AppConfig
from deployments.quiet_polls import quiet_polls

log = logging.getLogger("specserve.engine")


def _with_token_bytes(out: RequestOutput, token_bytes) -> RequestOutput:
    """An output's log-probabilities (output and prompt) with each token's bytes
    (``engine.token_bytes``) filled in."""
    if not (out.logprobs or out.prompt_logprobs):
        return out

    def fill(lp: Logprob) -> Logprob:
        return dataclasses.replace(lp, token=token_bytes(lp.token_id))

    def filled(entries: list[TokenLogprobs]) -> list[TokenLogprobs]:
        return [TokenLogprobs(fill(t.chosen), tuple(map(fill, t.top))) for t in entries]

    return dataclasses.replace(out, logprobs=filled(out.logprobs), prompt_logprobs=filled(out.prompt_logprobs))


async def _prediction_usage(out: RequestOutput, prediction: tuple[int, ...], output: list[int]) -> RequestOutput:
    """The final output of a request with a prediction, with the prediction's tokens the output
    kept and the rest; any other output as it is."""
    if not (out.finished and prediction):
        return out
    # imported here: its module brings torch, which a replica of an engine without it (the fake
    # engine) need not load at start
    from cluster.speculative.prediction import prediction_overlap

    kept = await asyncio.to_thread(prediction_overlap, prediction, list(output))
    return dataclasses.replace(out, accepted_prediction_tokens=kept, rejected_prediction_tokens=len(prediction) - kept)


def _ray_node_id() -> str:
    """The Ray node this replica runs on ("" outside Ray, e.g. a unit test)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 — only ever used to compare placements
        return ""


class EngineServer:
    speculative: bool = False

    async def _init_engine(self, config: dict, proposer=None) -> None:
        self.app = AppConfig(**config)
        quiet_polls("stats")  # the Router asks each engine twice a second
        configure_from_section(self.app.telemetry)
        self.limits = self.app.limits_config()
        self._set_threads(self.app.torch_threads)
        engine_cls = self.app.engine_impl.load()
        self.engine = engine_cls(self.app.engine_config(self.speculative), proposer=proposer,
                                 **self.app.engine_impl.options)
        self._set_threads(self.app.torch_threads)  # the engine may have imported torch just now
        self._start_error: BaseException | None = None
        self._start_task = asyncio.create_task(self._start())
        self._in_flight = 0
        self._abandoned = 0  # streams closed before their final output (client cancel, deadline)
        self._node_id = _ray_node_id()
        self._metrics = SpecserveMetrics()  # Ray Serve metrics inside the replica
        self._stats_task = asyncio.create_task(export_engine_stats_forever(
            self._metrics, self.stats, "spec" if self.speculative else "batch"))

    @staticmethod
    def _set_threads(n: int) -> None:
        if "torch" in sys.modules:
            import torch

            torch.set_num_threads(n)

    async def _start(self) -> None:
        try:
            await self.engine.start()
        except BaseException as exc:  # surfaced by check_health: Serve restarts the replica
            self._start_error = exc
            log.exception("engine failed to start")

    def check_health(self) -> None:
        if self._start_error is not None:
            raise RuntimeError(f"engine failed to start: {self._start_error!r}")
        if self._start_task.done() and not self.engine.ready():  # e.g. its core process died
            raise RuntimeError("engine stopped")

    def ready(self) -> bool:
        return self._start_error is None and self.engine.ready()

    def stats(self) -> dict:
        d = self.engine.stats().to_dict() if self.ready() else {}
        d["ready"] = self.ready()
        d["in_flight"] = self._in_flight
        d["requests_abandoned"] = self._abandoned
        d["engine_pid"] = self.engine.pid  # ProcessEngine: the core process (its own GIL)
        d["node_id"] = self._node_id  # the Router's paths_share_hardware "auto" compares these
        return d

    def model_info(self) -> dict:
        return self.engine.model_info() if self.ready() else {}

    def tokenize(self, prompt: PromptInput) -> dict | EngineFailure:
        """{"token_ids": the ids ``generate`` would feed the model for ``prompt`` (text or a chat),
        "max_model_len"}, or the failure (the engine not ready, nothing left after tokenization)."""
        if not self.ready():
            return EngineFailure(FailureKind.UNAVAILABLE, "engine is not ready yet")
        try:
            return {"token_ids": tokenize_prompt(prompt, self.engine, self._vocab_size()),
                    "max_model_len": int(self.engine.model_info().get("max_model_len") or 0)}
        except Exception as exc:  # noqa: BLE001 - a record, never a raise (the Router maps it)
            return self._failure(exc, "tokenize")

    def detokenize(self, token_ids: list[int]) -> str | EngineFailure:
        """The text ``token_ids`` stand for (each token's bytes, joined and decoded as UTF-8; an
        incomplete character is U+FFFD), or the failure (an id outside the vocabulary)."""
        if not self.ready():
            return EngineFailure(FailureKind.UNAVAILABLE, "engine is not ready yet")
        vocab = self._vocab_size()
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            return EngineFailure(FailureKind.INVALID_ARGUMENT, f"token_ids out of range [0, {vocab}): {bad[:5]}")
        return b"".join(self.engine.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")

    def _vocab_size(self) -> int:
        return int(self.engine.model_info().get("vocab_size") or 0) or sys.maxsize

    @staticmethod
    def _failure(exc: Exception, request_id: str, label: str = "") -> EngineFailure:
        failure = EngineFailure.from_exception(exc, request_id)
        if failure.kind is FailureKind.INTERNAL:  # not the engine's own user-facing error: log it all
            log.error("request %s (label %r) failed in the engine", request_id, label, exc_info=exc)
        elif failure.kind is FailureKind.UNAVAILABLE:
            log.warning("request %s (label %r): %s", request_id, label, exc)
        return failure

    async def generate(self, req: ValidatedRequest, trace_carrier: dict[str, str] | None = None,
                       whole: bool = False) -> AsyncIterator[RequestOutput | EngineFailure]:
        if not self.ready():
            yield EngineFailure(FailureKind.UNAVAILABLE, "engine is not ready yet")
            return
        self._in_flight += 1
        stream = None
        finished = False
        try:
            try:
                gen_req = to_generation_request(req, self.engine, self.limits, self._vocab_size(),
                                                arrival_time=time.monotonic())
                gen_req.trace_carrier = trace_carrier or {}  # Router span -> engine spans
                stream = self.engine.generate(gen_req)
                first = await stream.__anext__()
            except StopAsyncIteration:
                yield EngineFailure(FailureKind.INTERNAL, "engine produced no output")
                return
            except Exception as exc:  # noqa: BLE001 (InvalidRequestError, EngineOverloadedError, ...: a record)
                yield self._failure(exc, req.request_id, req.label)
                return
            finished = first.finished
            predicted, output = gen_req.prediction_token_ids, list(first.new_token_ids)
            token_bytes = self.engine.token_bytes
            try:
                if whole:
                    merged = first
                    async for out in stream:
                        finished = out.finished
                        merged = merge_outputs(merged, out)
                    yield _with_token_bytes(await _prediction_usage(merged, predicted, merged.new_token_ids), token_bytes)
                    return
                yield _with_token_bytes(await _prediction_usage(first, predicted, output), token_bytes)
                async for out in stream:
                    finished = out.finished
                    output += out.new_token_ids
                    yield _with_token_bytes(await _prediction_usage(out, predicted, output), token_bytes)
            except Exception as exc:  # noqa: BLE001 (EngineUnavailableError: the engine's core process died)
                finished = True  # the engine has dropped the request already
                yield self._failure(exc, req.request_id, req.label)
        finally:
            self._in_flight -= 1
            if stream is not None and not finished:
                # client went away (cancel, deadline): free the request's KV now
                self._abandoned += 1
                await stream.aclose()
                await self.engine.abort(req.request_id)
