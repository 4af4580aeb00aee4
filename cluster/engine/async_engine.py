"""Async engine: the ``EngineProtocol`` implementation over ``LLMEngine``.

Owns: the caller-side half of an engine — per-request asyncio queues fed from another thread,
merging the deltas a slow consumer has not taken yet, the bounded waiting queue, and cancellation
when a caller stops iterating. Here the engine steps in a ``StepLoop`` thread of this process
(torch releases the GIL inside kernels, so the caller's event loop stays responsive);
``ProcessEngine`` keeps this half and moves the step loop into a process of its own.
Ignores: scheduling and model details (``LLMEngine``), transport.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import TYPE_CHECKING, AsyncIterator

from cluster.common.config import EngineConfig
from cluster.common.errors import EngineOverloadedError, InvalidRequestError
from cluster.common.request import GenerationRequest, RequestOutput, merge_outputs
from cluster.engine.protocol import EngineStats
from cluster.engine.step_loop import Delivery, StepLoop

if TYPE_CHECKING:  # the model code loads only where the engine steps (a ProcessEngine's core)
    from cluster.engine.llm_engine import LLMEngine


def build_engine(config: EngineConfig, proposer=None) -> "LLMEngine":
    """Load the target (and drafter) and return a ready synchronous engine."""
    import torch

    from cluster.engine.llm_engine import LLMEngine
    from cluster.models.load import load_model

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    model = load_model(config.model, config)
    spec = None
    if config.spec is not None:
        from cluster.engine.speculation import build_spec_controller

        spec = build_spec_controller(config, model, proposer)
    return LLMEngine(config, model, spec)


class AsyncEngine:
    def __init__(self, config: EngineConfig, proposer=None, engine: "LLMEngine | None" = None) -> None:
        self.config = config
        self._proposer = proposer
        self.engine: LLMEngine | None = engine
        self._routes_lock = threading.Lock()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._step_loop: StepLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = False
        self._snapshot: EngineStats | None = None

    @property
    def proposer(self):
        """The drafter injected by the replica (KVSync ``RemoteProposer``), or None."""
        return self._proposer

    @property
    def pid(self) -> int | None:
        """The process that steps the model: this one."""
        return os.getpid()

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
        self._step_loop = StepLoop(self.engine, self._deliver, self._set_snapshot)
        self._thread = threading.Thread(target=self._step_loop.run, name="specserve-engine", daemon=True)
        self._thread.start()
        self._ready = True

    def ready(self) -> bool:
        return self._ready and self._thread is not None and self._thread.is_alive()

    async def shutdown(self) -> None:
        if self._step_loop is not None:
            self._step_loop.stop()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)
        self._ready = False

    # -- requests -----------------------------------------------------------------------------
    def _admit(self, request: GenerationRequest) -> None:
        """Raise InvalidRequestError / EngineOverloadedError for a request the engine must refuse."""
        self.engine.validate(request)
        waiting = self._step_loop.num_waiting()
        if waiting >= self.config.max_queue:
            raise EngineOverloadedError(f"waiting queue is full ({waiting} requests)")

    def _submit(self, request: GenerationRequest) -> None:
        self._step_loop.submit(request)

    def _submit_abort(self, request_id: str) -> None:
        self._step_loop.abort(request_id)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if not self.ready():
            await self.start()
        self._admit(request)  # raise before the first delta
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._routes_lock:
            if request.request_id in self._queues:
                raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
            self._queues[request.request_id] = (loop, queue)
        if not request.arrival_time:
            request.arrival_time = time.monotonic()
        self._submit(request)
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
        with self._routes_lock:
            known = request_id in self._queues
        if known:
            self._submit_abort(request_id)

    def stats(self) -> EngineStats:
        """Snapshot taken by the step loop: at most SNAPSHOT_EVERY_S old while it steps, and
        current once it is idle."""
        if self._thread is None:
            return self.engine.stats()
        return self._snapshot

    @property
    def tokenizer(self):
        """The model's tokenizer, in this process."""
        return self.engine.tokenizer

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (``cluster.models.token_bytes``)."""
        from cluster.models.token_bytes import TokenBytes

        tb = getattr(self, "_token_bytes", None)
        if tb is None or tb.tokenizer is not self.tokenizer:
            tb = self._token_bytes = TokenBytes(self.tokenizer)
        return tb(token_id)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        from cluster.models.tokenizer import chat_token_ids

        return chat_token_ids(self.tokenizer, messages)

    def _model_summary(self) -> dict:
        return model_summary(self.engine)

    def model_info(self) -> dict:
        info = self._model_summary()
        st = self.stats()
        info.update(moe=st.moe, drafter=st.drafter, spec_enabled=st.spec_enabled)
        return info

    # -- called from the step loop's thread ---------------------------------------------------
    def _set_snapshot(self, stats: EngineStats) -> None:
        self._snapshot = stats

    def _deliver(self, items: list[Delivery]) -> None:
        """Route each item to its caller's queue; a finished delta, an error or None (abort of a
        request already gone) ends the route."""
        for request_id, item in items:
            with self._routes_lock:
                target = self._queues.get(request_id)
                if target is None:
                    continue
                if item is None or isinstance(item, BaseException) or item.finished:
                    self._queues.pop(request_id, None)
            if item is None:
                continue
            loop, queue = target
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # caller's loop is closed
                pass


def model_summary(engine: "LLMEngine") -> dict:
    """The static part of ``model_info`` (the rest comes from stats)."""
    return {
        "name": engine.model.name,
        "architecture": (engine.model.hf_config.get("architectures") or ["?"])[0],
        "model_type": engine.model.hf_config.get("model_type"),
        "vocab_size": engine.runner.vocab_size,
        "max_model_len": engine.max_model_len,
        "dtype": engine.model.dtype,
    }
