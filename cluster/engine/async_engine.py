"""Async engine: the ``EngineProtocol`` implementation over ``LLMEngine``.

Owns: a dedicated step-loop thread (torch releases the GIL inside kernels, so the caller's event
loop stays responsive), a thread-safe inbox for new requests and aborts, fan-out of each step's
outputs to per-request asyncio queues, the bounded waiting queue, and cancellation when a caller
stops iterating. Ignores: scheduling and model details (``LLMEngine``), transport.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import AsyncIterator

import torch

from cluster.engine.config import EngineConfig
from cluster.engine.llm_engine import LLMEngine, LoadedModel
from cluster.engine.protocol import EngineStats
from cluster.engine.request import (
    EngineOverloadedError, FinishReason, GenerationRequest, RequestOutput, merge_outputs,
)

log = logging.getLogger(__name__)
# stats() snapshots (a few hundred µs with speculation: per-segment α, break-even) are taken at
# most this often while busy, and whenever the engine goes idle (exact once a request is done)
SNAPSHOT_EVERY_S = 0.05


def build_engine(config: EngineConfig, proposer=None) -> LLMEngine:
    """Load the target (and drafter) and return a ready synchronous engine."""
    from cluster.models.load import load_model

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    model = load_model(config.model, config)
    spec = None
    if config.spec is not None:
        from cluster.spec.controller import build_spec_controller

        spec = build_spec_controller(config, model, proposer)
    return LLMEngine(config, model, spec)


class AsyncEngine:
    def __init__(self, config: EngineConfig, proposer=None, engine: LLMEngine | None = None) -> None:
        self.config = config
        self._proposer = proposer
        self.engine: LLMEngine | None = engine
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[GenerationRequest] = []
        self._aborts: list[str] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._ready = False
        self._snapshot: EngineStats | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        if self.engine is None:
            self.engine = await asyncio.get_running_loop().run_in_executor(
                None, build_engine, self.config, self._proposer)
        self.start_sync()

    def start_sync(self) -> None:
        """Start the loop thread (engine built already) — for callers without an event loop."""
        if self._thread is not None:
            return
        if self.engine is None:
            self.engine = build_engine(self.config, self._proposer)
        self._snapshot = self.engine.stats()
        self._thread = threading.Thread(target=self._loop, name="specserve-engine", daemon=True)
        self._thread.start()
        self._ready = True

    def ready(self) -> bool:
        return self._ready and self._thread is not None and self._thread.is_alive()

    async def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)
        self._ready = False

    # -- requests -----------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if not self.ready():
            await self.start()
        assert self.engine is not None
        self.engine.validate(request)  # raise InvalidRequestError before the first delta
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            waiting = len(self.engine.scheduler.waiting) + len(self._inbox)
            if waiting >= self.config.max_queue:
                raise EngineOverloadedError(f"waiting queue is full ({waiting} requests)")
            if request.request_id in self._queues:
                from cluster.engine.request import InvalidRequestError

                raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
            if not request.arrival_time:
                request.arrival_time = time.monotonic()
            self._queues[request.request_id] = (loop, queue)
            self._inbox.append(request)
            self._wake.notify_all()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                # A consumer slower than the engine gets the deltas already waiting as one
                # (fewer messages through the serving hops; same tokens and text).
                pending_exc = None
                while not item.finished and not queue.empty():
                    nxt = queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        pending_exc = nxt
                        break
                    item = merge_outputs(item, nxt)
                yield item
                if pending_exc is not None:
                    raise pending_exc
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                await self.abort(request.request_id)

    async def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._queues:
                self._aborts.append(request_id)
                self._wake.notify_all()

    def stats(self) -> EngineStats:
        """Snapshot taken by the loop thread: at most SNAPSHOT_EVERY_S old while it steps, and
        current once it is idle."""
        if self._thread is None:
            return self.engine.stats()
        return self._snapshot

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in self.engine.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        from cluster.models.tokenizer import chat_token_ids

        return chat_token_ids(self.engine.tokenizer, messages)

    def model_info(self) -> dict:
        e = self.engine
        info = {
            "name": e.model.name,
            "architecture": (e.model.hf_config.get("architectures") or ["?"])[0],
            "model_type": e.model.hf_config.get("model_type"),
            "vocab_size": e.runner.vocab_size,
            "max_model_len": e.max_model_len,
            "dtype": e.model.dtype,
        }
        st = self.stats()
        info.update(moe=st.moe, drafter=st.drafter, spec_enabled=st.spec_enabled)
        return info

    # -- the loop thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        eng = self.engine
        self._snapshot, snapshot_at = eng.stats(), time.monotonic()
        while True:
            with self._lock:
                while not self._stop and not self._inbox and not self._aborts and not eng.has_work():
                    self._wake.wait()
                if self._stop:
                    break
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
            # the step runs without the lock so callers never wait a whole forward pass
            for req in inbox:
                try:
                    eng.add_request(req)
                except Exception as exc:  # validated already; anything here is a bug report
                    self._emit(req.request_id, exc)
            for rid in aborts:
                out = eng.abort(rid)
                if out is not None:
                    self._emit(rid, out)
                with self._lock:
                    self._queues.pop(rid, None)
            try:
                outputs = eng.step() if eng.has_work() else []
            except Exception:  # never hang callers: fail the running requests
                log.exception("engine step failed")
                outputs = [self._fail(seq) for seq in list(eng.seqs.values())]
            for out in outputs:  # deltas first: the snapshot is not on the token's path
                self._emit(out.request_id, out)
            now = time.monotonic()
            if not eng.has_work() or now - snapshot_at >= SNAPSHOT_EVERY_S:
                self._snapshot, snapshot_at = eng.stats(), now
        # shutting down: finish everyone so no caller hangs
        for seq in list(eng.seqs.values()):
            seq.finish(FinishReason.CANCELLED)
            self._emit(seq.seq_id, eng._retire(seq))
        self._snapshot = eng.stats()

    def _fail(self, seq) -> RequestOutput:
        seq.finish(FinishReason.ERROR)
        out = self.engine._retire(seq)
        out.error = "engine step failed"
        return out

    def _emit(self, request_id: str, item) -> None:
        with self._lock:
            target = self._queues.get(request_id)
            if target is None:
                return
            if isinstance(item, BaseException) or item.finished:
                self._queues.pop(request_id, None)
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # caller's loop is closed
            pass

