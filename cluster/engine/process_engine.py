"""Process engine: ``AsyncEngine``'s caller side with the step loop in an engine core process.

Why: in a serving replica the event loop does Python work for every delta it passes on (Ray Serve
wraps, pickles and reports each streamed item). In one process that work holds the GIL the step
thread needs between kernels, so every token delivered slows the next step; measured here: 1 ms
of Python per delta in the caller's loop made each 48 ms decode step ~3.6 ms slower. With the
step loop in its own process (``cluster.engine.engine_core``) the two run side by side.

Owns: starting the core process and waiting for its model, a reader thread that routes the core's
outputs to callers' queues and keeps its stats snapshot, checking requests against the model's
limits here (``ModelLimits``: a bad request never waits for a step), the waiting-queue bound
(requests without a first output yet), tokenizing here with the model's own tokenizer, and
failing every open request with ``EngineUnavailableError`` when the core dies (the replica's
health check then fails, and Serve replaces the replica). A KVSync proposer given by the replica
runs in the core; ``proposer`` is a stand-in that forwards address changes and shows the core's
draft status. The model code and its weights load only in the core.
Ignores: stepping (``StepLoop`` in the core), routing, transport beyond the socket pair.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from cluster.common.config import EngineConfig
from cluster.common.errors import EngineOverloadedError, EngineUnavailableError
from cluster.common.request import GenerationRequest, ModelLimits
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.core_messages import (
    Abort, Add, Failed, Init, Outputs, Ready, SetDraftAddress, Stats, Stop, Stopped, ToCore,
)
from cluster.engine.protocol import EngineStats

log = logging.getLogger(__name__)
EXIT_CODE_WAIT_S = 2.0  # how long the reader waits for a closed core to be reaped
DEFAULT_START_TIMEOUT_S = 900.0  # first start converts the default GGUF (~35 s here); hub models take longer


class DraftStandIn:
    """The replica's handle on the KVSync proposer that runs in the engine core process."""

    def __init__(self, engine: "ProcessEngine", address: str | None) -> None:
        self._engine = engine
        self._address = address
        self.status: dict = {}  # the core's draft_status(), refreshed with every stats snapshot

    @property
    def address(self) -> str | None:
        return self._address

    def set_address(self, address: str | None) -> None:
        if address != self._address:
            self._address = address
            self._engine._send(SetDraftAddress(address))

    def tracked(self) -> dict[str, int]:
        return dict(self.status.get("tracked", {}))

    @property
    def num_epoch_changes(self) -> int:
        return int(self.status.get("epoch_changes", 0))

    @property
    def num_resyncs(self) -> int:
        return int(self.status.get("resyncs", 0))


class ProcessEngine(AsyncEngine):
    def __init__(self, config: EngineConfig, proposer=None, *,
                 start_timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        super().__init__(config, proposer)
        self.start_timeout_s = start_timeout_s
        self._draft = DraftStandIn(self, proposer.address) if proposer is not None else None
        self._conn: Connection | None = None
        self._proc: subprocess.Popen | None = None
        self._code: int | None = None  # the core's exit code, once its pipe closed
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._starting: asyncio.Future | None = None
        self._limits: ModelLimits | None = None
        self._summary: dict = {}
        self._tokenizer = None
        self._unstarted: set[str] = set()  # submitted, no output yet: the waiting queue
        self._gone = False  # the core exited; nothing new is accepted
        self._stopping = False

    @property
    def proposer(self):
        return self._draft

    @property
    def pid(self) -> int | None:
        """The core process's pid (tests kill it to check that callers are failed, not hung)."""
        return self._proc.pid if self._proc is not None else None

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._reader is not None:
            return
        if self._starting is None:
            self._starting = asyncio.ensure_future(
                asyncio.get_running_loop().run_in_executor(None, self.start_sync))
        await asyncio.shield(self._starting)

    def start_sync(self) -> None:
        """Spawn the core, send it the config, wait for its model, start the reader thread."""
        if self._reader is not None:
            return
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # the core imports what this process can (e.g. a Ray runtime_env working_dir on sys.path)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        if self.config.torch_threads:  # OpenMP reads this before torch.set_num_threads runs
            env["OMP_NUM_THREADS"] = str(self.config.torch_threads)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.engine.engine_core", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        from cluster.telemetry.tracing import current_config

        conn = Connection(ours.detach())
        with self._send_lock:  # init goes first: a draft address change waits or rides along
            if self._draft is not None:
                self._proposer.set_address(self._draft.address)
            conn.send(Init(self.config, self._proposer, current_config()))
            self._conn = conn
        deadline = time.monotonic() + self.start_timeout_s
        msg = None
        while msg is None:
            if self._conn.poll(1.0):
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    msg = Failed(f"engine process exited with code {self._proc.wait()}")
            elif self._proc.poll() is not None:
                msg = Failed(f"engine process exited with code {self._proc.returncode}")
            elif time.monotonic() > deadline:
                self._proc.kill()
                msg = Failed(f"engine process did not load its model in {self.start_timeout_s:.0f} s")
        if not isinstance(msg, Ready):
            self._gone = True
            raise EngineUnavailableError(msg.message if isinstance(msg, Failed)
                                         else f"engine process: unexpected first message {msg!r}")
        from cluster.models.tokenizer import load_tokenizer

        self._tokenizer = load_tokenizer(msg.tokenizer_path)
        self._limits, self._summary, self._snapshot = msg.limits, msg.summary, msg.stats
        self._reader = threading.Thread(target=self._read, name="specserve-engine-reader", daemon=True)
        self._reader.start()
        self._ready = True

    def ready(self) -> bool:
        return (self._ready and not self._gone and self._reader is not None and self._reader.is_alive()
                and self._proc is not None and self._proc.poll() is None)

    async def shutdown(self) -> None:
        self._stopping = True
        if self._proc is None:
            return
        self._send(Stop())
        loop = asyncio.get_running_loop()
        if self._reader is not None:
            await loop.run_in_executor(None, self._reader.join, 10)
        try:
            await loop.run_in_executor(None, self._proc.wait, 10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._ready = False

    # -- requests -----------------------------------------------------------------------------
    def _admit(self, request: GenerationRequest) -> None:
        if not self.ready():
            raise self._gone_error()
        self._limits.check(request)
        if len(self._unstarted) >= self.config.max_queue:
            raise EngineOverloadedError(f"waiting queue is full ({len(self._unstarted)} requests)")

    def _submit(self, request: GenerationRequest) -> None:
        with self._routes_lock:
            gone = self._gone
            if not gone:
                self._unstarted.add(request.request_id)
        if gone:  # the core died after _admit: fail this request like the others
            self._deliver([(request.request_id, self._gone_error())])
        else:
            self._send(Add(request))

    def _submit_abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def _send(self, msg: ToCore) -> None:
        with self._send_lock:  # checked under the lock: start_sync sets _conn after init
            if self._conn is None:  # not started: the init message will carry the state
                return
            try:
                self._conn.send(msg)
            except OSError:  # core gone: the reader fails the open requests
                pass

    def stats(self) -> EngineStats:
        return self._snapshot

    @property
    def tokenizer(self):
        """The model's tokenizer, loaded here from the core's model directory."""
        return self._tokenizer

    def _model_summary(self) -> dict:
        return dict(self._summary)

    # -- the reader thread ----------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            match msg:
                case Outputs(items):
                    with self._routes_lock:
                        for rid, _ in items:
                            self._unstarted.discard(rid)
                    self._deliver(items)
                case Stats(stats, draft):
                    self._snapshot = stats
                    if self._draft is not None and draft is not None:
                        self._draft.status = draft
                case Stopped():
                    break
                case _:
                    log.error("engine process sent an unexpected message: %r", msg)
        self._code = self._exit_code()  # before _gone: whoever sees _gone reads the code
        with self._routes_lock:
            self._gone = True
            open_ids = list(self._queues)
            self._unstarted.clear()
        if not self._stopping:
            log.error("engine process exited (code %s); failing %d open requests", self._code, len(open_ids))
        self._deliver([(rid, self._gone_error()) for rid in open_ids])

    def _exit_code(self) -> int | None:
        """The core's exit code. Its pipe closes a moment before the kernel reaps it, so wait
        briefly for the code rather than report None (this runs on the reader thread)."""
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout=EXIT_CODE_WAIT_S)
        except subprocess.TimeoutExpired:
            return None

    def _gone_error(self) -> EngineUnavailableError:
        code = self._code if self._code is not None else (self._proc.poll() if self._proc is not None else None)
        return EngineUnavailableError(f"engine process exited (code {code})")
