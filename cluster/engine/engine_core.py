"""Engine core process: the step loop with a Python interpreter (and GIL) of its own.

``python -m cluster.engine.engine_core FD`` is started by ``ProcessEngine`` with one end of a
socket pair as FD. Messages (pickled, ``multiprocessing.connection`` framing) are the dataclasses
of ``cluster.engine.core_messages``:

  parent -> core: ``Init`` once, then ``Add``, ``Abort``, ``SetDraftAddress``, ``Stop``.
  core -> parent: ``Ready`` or ``Failed`` once, then ``Outputs`` per step, ``Stats`` per
                  snapshot, and ``Stopped`` last.

Owns: building the engine from the parent's config (tracing configured as in the replica),
reading requests on a thread of its own while the main thread steps, sending each step's outputs
as one message, and exiting when told to or when the parent's end closes (the replica died).
Ignores: asyncio queues and callers (``ProcessEngine``), scheduling (``LLMEngine``).
"""
from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
from multiprocessing.connection import Connection

from cluster.common.errors import EngineOverloadedError, InvalidRequestError
from cluster.engine.core_messages import (
    Abort, Add, Failed, FromCore, Init, Outputs, Ready, SetDraftAddress, Stats, Stop, Stopped,
)
from cluster.speculative.proposer import DraftStatus

log = logging.getLogger("specserve.engine_core")


def draft_status(proposer) -> dict | None:
    """What the replica shows about a KVSync proposer that lives here (SpecEngine stats)."""
    if not isinstance(proposer, DraftStatus):
        return None
    return {"address": proposer.address, "tracked": proposer.tracked(),
            "epoch_changes": proposer.num_epoch_changes, "resyncs": proposer.num_resyncs}


def _portable(item):
    """An exception the parent can unpickle (engine errors travel as themselves, others as text)."""
    if isinstance(item, (InvalidRequestError, EngineOverloadedError)):
        return item
    if isinstance(item, BaseException):
        return RuntimeError(f"{type(item).__name__}: {item}")
    return item


class _Sender:
    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def __call__(self, msg: FromCore) -> None:
        with self._lock:
            try:
                self._conn.send(msg)
            except (OSError, pickle.PicklingError):  # parent gone: the reader stops the loop
                log.debug("send failed", exc_info=True)


def _read(conn: Connection, loop, proposer) -> None:
    """Reader thread: requests and aborts into the step loop until stop or the parent's EOF."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        match msg:
            case Add(request):
                loop.submit(request)
            case Abort(request_id):
                loop.abort(request_id)
            case SetDraftAddress(address):
                if proposer is not None:
                    proposer.set_address(address)
            case Stop():
                break
            case _:
                log.error("unexpected message from the replica: %r", msg)
    loop.stop()


def serve(conn: Connection) -> None:
    from cluster.engine.async_engine import build_engine, model_summary
    from cluster.engine.step_loop import StepLoop
    from cluster.telemetry.tracing import configure_tracing, shutdown_tracing

    init = conn.recv()
    if not isinstance(init, Init):
        raise TypeError(f"engine core: expected Init first, got {init!r}")
    config, proposer, telemetry = init.config, init.proposer, init.telemetry
    send = _Sender(conn)
    try:
        if telemetry is not None:
            configure_tracing(telemetry)
        engine = build_engine(config, proposer)
    except BaseException as exc:  # noqa: BLE001 (reported to the parent, which raises it)
        log.exception("engine failed to load")
        send(Failed(f"{type(exc).__name__}: {exc}"))
        return
    loop = StepLoop(engine,
                    lambda items: send(Outputs([(rid, _portable(it)) for rid, it in items])),
                    lambda stats: send(Stats(stats, draft_status(proposer))))
    send(Ready(summary=model_summary(engine), limits=engine.limits,
               tokenizer_path=str(engine.model.path), stats=engine.stats()))
    threading.Thread(target=_read, args=(conn, loop, proposer), name="engine-core-reader",
                     daemon=True).start()
    try:
        loop.run()
    finally:
        shutdown_tracing()
        send(Stopped())


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="engine_core %(levelname)s %(name)s: %(message)s")
    conn = Connection(int(argv[1]))
    try:
        serve(conn)
    finally:
        # grpc / exporter threads must not keep a process whose parent has gone
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
