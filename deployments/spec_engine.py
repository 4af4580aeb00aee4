"""SpecEngine deployment: target + drafter, small batches, for interactive traffic.

Owns: choosing where the drafter lives. ``shared``: the engine builds its drafter from
``config.spec.drafter`` in this replica (on one GPU; fractional GPU resources allowed).
``separate``: the drafter runs in DraftServer replicas; this replica injects a KVSync
``RemoteProposer`` (with the ``auth`` token, the ``kvsync`` TLS settings, limits and step budget)
and keeps its address current by asking the DraftServer deployment every
``_REFRESH_S`` seconds (a restarted replica may come back on another port or node).
Ignores: the engine internals (``engine_server``), routing.
"""
from __future__ import annotations

import asyncio
import logging

from ray import serve

from deployments.app_config import AppConfig, Placement
from deployments.engine_server import EngineServer

log = logging.getLogger("specserve.spec_engine")
_REFRESH_S = 1.0


@serve.deployment(name="SpecEngine", max_ongoing_requests=1024, health_check_period_s=2)
class SpecEngine(EngineServer):
    speculative = True

    async def __init__(self, config: dict, draft_server=None) -> None:
        app = AppConfig(**config)
        self._draft = draft_server
        self._proposer = None
        if app.placement is Placement.SEPARATE:
            if draft_server is None:
                raise ValueError("placement 'separate' needs a DraftServer deployment handle")
            from cluster.api.auth import token_from_env
            from cluster.kvsync.client import RemoteProposer

            timeout = app.draft_server.timeout_s
            self._proposer = RemoteProposer(None, timeout_s=timeout, retry_after_s=_REFRESH_S,
                                            token=token_from_env(app.auth.token_env, "SpecEngine"),
                                            tls=app.kvsync.tls(), budget=app.kvsync.budget(timeout),
                                            limits=app.kvsync_limits())
        await self._init_engine(config, proposer=self._proposer)
        if self._proposer is not None:
            # the engine's own handle on it (ProcessEngine: a stand-in for the one in its core)
            self._proposer = self.engine.proposer
            self._refresh_task = asyncio.create_task(self._refresh_address())

    async def _refresh_address(self) -> None:
        while True:
            try:
                addr = await asyncio.wait_for(self._draft.address.remote(), timeout=5.0)
                if addr != self._proposer.address:
                    log.info("draft server address: %s", addr)
                self._proposer.set_address(addr)
            except Exception as exc:  # noqa: BLE001 (draft replica down: keep the old address, engine falls back)
                log.warning("draft server address lookup failed: %r", exc)
            await asyncio.sleep(_REFRESH_S)

    def stats(self) -> dict:
        d = super().stats()
        if self._proposer is not None:
            d["draft_address"] = self._proposer.address
            d["draft_tracked"] = len(self._proposer.tracked())
            d["draft_epoch_changes"] = self._proposer.num_epoch_changes
        return d
