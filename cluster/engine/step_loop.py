"""Step loop: the thread body that drives an ``LLMEngine`` for an asynchronous front end.

Owns: a thread-safe inbox of new requests and aborts, stepping while there is work and sleeping
when there is none, handing each step's outputs to ``deliver`` in one call, failing the running
requests with an error message (never hanging their callers) when a step raises past the
engine's own per-sequence isolation (a bug, not a request's fault), and publishing an ``EngineStats``
snapshot at most every ``SNAPSHOT_EVERY_S`` while busy and whenever the engine goes idle.
Used in a thread of the caller's process (``AsyncEngine``) and in the engine process's main thread
(``cluster.engine.engine_core``). Ignores: who waits for the outputs and how they get there.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

from cluster.common.request import FinishReason, GenerationRequest, RequestOutput
from cluster.engine.faults import FaultStage, fault
from cluster.engine.protocol import EngineStats

if TYPE_CHECKING:
    from cluster.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)
# stats() snapshots (a few hundred µs with speculation: per-segment α, break-even) are taken at
# most this often while busy, and whenever the engine goes idle (exact once a request is done)
SNAPSHOT_EVERY_S = 0.05

# (request id, what to hand its caller): a delta, an exception raised at admission, or None when
# an abort found the request already gone (the caller's route can be dropped)
Delivery = tuple[str, "RequestOutput | BaseException | None"]


class StepLoop:
    def __init__(self, engine: "LLMEngine", deliver: Callable[[list[Delivery]], None],
                 publish: Callable[[EngineStats], None]) -> None:
        self.engine = engine
        self._deliver = deliver
        self._publish = publish
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[GenerationRequest] = []
        self._aborts: list[str] = []
        self._stop = False

    def submit(self, request: GenerationRequest) -> None:
        with self._lock:
            self._inbox.append(request)
            self._wake.notify_all()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
            self._wake.notify_all()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify_all()

    def num_waiting(self) -> int:
        """Requests not yet running: submitted but not admitted, plus the scheduler's queue."""
        with self._lock:
            return len(self._inbox) + len(self.engine.scheduler.waiting)

    def run(self) -> None:
        eng = self.engine
        snapshot_at = time.monotonic()
        self._publish(eng.stats())
        while True:
            with self._lock:
                while not self._stop and not self._inbox and not self._aborts and not eng.has_work():
                    self._wake.wait()
                if self._stop:
                    break
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
            # the step runs without the lock so submitters never wait a whole forward pass
            out: list[Delivery] = []
            for req in inbox:
                try:
                    eng.add_request(req)
                except Exception as exc:  # noqa: BLE001 (InvalidRequestError when nobody validated before)
                    out.append((req.request_id, exc))
            for rid in aborts:
                out.append((rid, eng.abort(rid)))
            try:
                outputs = eng.step() if eng.has_work() else []
            except Exception as exc:  # noqa: BLE001 (never hang callers: fail the running requests)
                outputs = self._fail_running(exc)
            out += [(o.request_id, o) for o in outputs]
            if out:  # deltas first: the snapshot is not on the token's path
                self._deliver(out)
            now = time.monotonic()
            if not eng.has_work() or now - snapshot_at >= SNAPSHOT_EVERY_S:
                self._publish(eng.stats())
                snapshot_at = now
        # stopping: finish everyone so no caller hangs
        final = []
        for seq in list(eng.seqs.values()):
            seq.finish(FinishReason.CANCELLED)
            final.append((seq.seq_id, eng._retire(seq)))
        if final:
            self._deliver(final)
        self._publish(eng.stats())

    def _fail_running(self, exc: Exception) -> list[RequestOutput]:
        """The running sequences end with FinishReason.ERROR and a message; waiting ones stay
        queued unless nothing runs (then the failure came from admitting them: fail them too,
        or the loop would retry the same step forever)."""
        eng = self.engine
        message = fault(FaultStage.STEP, exc).message
        victims = list(eng.scheduler.running) or list(eng.seqs.values())
        outputs = []
        for seq in victims:
            try:
                outputs.append(eng.fail(seq, message))
            except Exception:  # noqa: BLE001 (its caller still gets a final output)
                log.exception("retiring %s failed", seq.seq_id)
                eng.seqs.pop(seq.seq_id, None)
                outputs.append(RequestOutput(seq.seq_id, [], "", finished=True,
                                             finish_reason=FinishReason.ERROR, error=message))
        return outputs
