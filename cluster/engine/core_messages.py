"""Messages between ``ProcessEngine`` (the replica) and its engine core process.

Owns: one dataclass per message kind, in each direction (pickled over a
``multiprocessing.connection`` socket pair). Ignores: what either side does with them
(``cluster.engine.process_engine``, ``cluster.engine.engine_core``).

  parent -> core: ``Init`` once, then ``Add``, ``Abort``, ``SetDraftAddress``, ``Stop``.
  core -> parent: ``Ready`` or ``Failed`` once, then ``Outputs`` per step, ``Stats`` per snapshot,
                  and ``Stopped`` last.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from cluster.common.config import EngineConfig
from cluster.common.request import GenerationRequest, ModelLimits, RequestOutput
from cluster.engine.protocol import EngineStats

# -- parent -> core ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Init:
    config: EngineConfig
    proposer: Any  # the replica's KVSync proposer (it runs in the core), or None
    telemetry: Any  # the replica's TelemetryConfig, so the core traces as the replica does; or None


@dataclass(frozen=True, slots=True)
class Add:
    request: GenerationRequest


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class SetDraftAddress:
    address: str | None


@dataclass(frozen=True, slots=True)
class Stop:
    pass


ToCore = Union[Init, Add, Abort, SetDraftAddress, Stop]

# -- core -> parent ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    summary: dict  # model_summary() of the loaded engine
    limits: ModelLimits
    tokenizer_path: str  # the parent loads the same tokenizer from here
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class Failed:
    message: str


@dataclass(frozen=True, slots=True)
class Outputs:
    # one step's deliveries: (request id, its delta | the exception that ended it | None)
    items: list[tuple[str, RequestOutput | BaseException | None]]


@dataclass(frozen=True, slots=True)
class Stats:
    stats: EngineStats
    draft: dict | None  # the core's draft_status() of a KVSync proposer, or None


@dataclass(frozen=True, slots=True)
class Stopped:
    pass


FromCore = Union[Ready, Failed, Outputs, Stats, Stopped]
