"""Messages to and from the engine core process: each kind survives the socket pair as itself, and
the core's reader turns each parent message into its step-loop call (an unknown one is logged,
not acted on)."""
from __future__ import annotations

import threading
from multiprocessing import Pipe

import pytest

from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.errors import InvalidRequestError
from cluster.common.request import FinishReason, GenerationRequest, ModelLimits, RequestOutput, SamplingParams
from cluster.engine import engine_core
from cluster.engine.core_messages import (
    Abort, Add, Failed, Init, Outputs, Ready, SetDraftAddress, Stats, Stop, Stopped,
)
from cluster.engine.protocol import EngineStats

REQUEST = GenerationRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4))
STATS = EngineStats(num_running=1, num_waiting=0, kv_blocks_total=8, kv_blocks_free=7)


@pytest.mark.parametrize("msg", [
    Init(EngineConfig(spec=SpecConfig(drafter="ngram")), None, None),
    Add(REQUEST),
    Abort("r1"),
    SetDraftAddress("127.0.0.1:5"),
    Stop(),
    Ready({"name": "tiny"}, ModelLimits(100, 64, 256), "/models/tiny", STATS),
    Failed("ValueError: no model"),
    Outputs([("r1", RequestOutput("r1", [7], "x", True, FinishReason.LENGTH)), ("r2", None)]),
    Stats(STATS, {"address": None, "tracked": {}}),
    Stopped(),
], ids=lambda m: type(m).__name__)
def test_each_message_crosses_the_pipe_as_itself(msg):
    ours, theirs = Pipe()
    ours.send(msg)
    assert theirs.recv() == msg


def test_an_exception_in_outputs_crosses_as_itself():
    ours, theirs = Pipe()
    ours.send(Outputs([("r1", InvalidRequestError("prompt is empty"))]))
    (rid, exc), = theirs.recv().items
    assert rid == "r1" and isinstance(exc, InvalidRequestError) and str(exc) == "prompt is empty"


class _Loop:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.stopped = threading.Event()

    def submit(self, request) -> None:
        self.calls.append(("submit", request.request_id))

    def abort(self, request_id) -> None:
        self.calls.append(("abort", request_id))

    def stop(self) -> None:
        self.stopped.set()


class _Proposer:
    def __init__(self) -> None:
        self.addresses: list[str | None] = []

    def set_address(self, address) -> None:
        self.addresses.append(address)


def test_the_core_reader_acts_on_each_message_and_stops_on_stop(caplog):
    parent, core = Pipe()
    loop, proposer = _Loop(), _Proposer()
    reader = threading.Thread(target=engine_core._read, args=(core, loop, proposer), daemon=True)
    reader.start()
    for msg in (Add(REQUEST), ("abort", "r1"), Abort("r1"), SetDraftAddress(None), Stop(), Abort("late")):
        parent.send(msg)
    reader.join(10)
    assert not reader.is_alive() and loop.stopped.is_set()
    assert loop.calls == [("submit", "r1"), ("abort", "r1")]  # the old tuple form is not acted on
    assert proposer.addresses == [None]
    assert "unexpected message" in caplog.text
