"""The engine protocol that deployments depend on (Ray Serve LLM style injection).

Owns: the async surface a serving layer needs from an engine. ``cluster.engine.async_engine``
implements it over the real model; a fake implementation lets router and gRPC tests run fast.
Ignores: how the engine schedules or speculates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, runtime_checkable

from cluster.common.request import GenerationRequest, RequestOutput


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    num_preemptions: int = 0
    # prefix caching: full prompt blocks looked up at admission, and those found (each saved a
    # block of prefill); cached blocks held by no request count in kv_blocks_free
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_enabled: bool = False
    drafter: str | None = None
    moe: bool = False
    moe_gate_open: bool = True  # False: MoE target not yet validated, speculation off
    draft_fallbacks: int = 0
    draft_resyncs: int = 0
    # lowest α (per position) at which speculating pays under the measured step costs (adaptive K)
    break_even_alpha: float | None = None
    # portfolio drafter: member -> {steps, draft_tokens, accepted_tokens} of the drafts it produced;
    # "prediction": the drafts of requests' predicted outputs (any drafter)
    drafter_steps: dict[str, dict] = field(default_factory=dict)
    # segment -> SpecStats.to_dict() (lifetime "alpha" and "acceptance_rate"), with the SpecEngine's
    # "live_alpha" / "live_draft_tokens" (per position, decayed: what the Router gates on) and
    # "moe_gate_open"
    spec_by_segment: dict[str, dict] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


@runtime_checkable
class EngineProtocol(Protocol):
    """What a serving layer may call. All methods are safe to call from one asyncio loop."""

    # the drafter the replica injected (KVSync RemoteProposer), or a stand-in that forwards to
    # where it runs (ProcessEngine); None without one
    proposer: object
    pid: int | None  # the process that steps the model (ProcessEngine: its core process)

    async def start(self) -> None:
        """Load models and start the step loop. Idempotent."""

    def ready(self) -> bool:
        """True once the engine can accept requests."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Submit a request and iterate its deltas; the last one has ``finished=True``.

        Raises InvalidRequestError (bad input) or EngineOverloadedError (queue full) before the
        first delta. Closing the iterator early (client gone) cancels the request and frees its KV.
        """

    async def abort(self, request_id: str) -> None:
        """Cancel a request; its KV blocks (target and draft) are freed at once."""

    def stats(self) -> EngineStats: ...

    def tokenize(self, text: str) -> list[int]: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (what its log-probability is reported with)."""

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat (role/content dicts) with the generation prompt appended."""

    def model_info(self) -> dict:
        """name, architecture, vocab_size, max_model_len, dtype, moe, drafter, spec settings."""

    async def shutdown(self) -> None: ...
