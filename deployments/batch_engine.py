"""BatchEngine deployment: target only, continuous batching with large batches.

Owns: nothing beyond ``EngineServer`` with speculation off; separate class so Serve scales and
places it independently (replicas, CPUs/GPUs from ``batch_engine`` knobs). Ignores: drafting.
"""
from __future__ import annotations

from ray import serve

from deployments.engine_server import EngineServer


@serve.deployment(name="BatchEngine", max_ongoing_requests=1024, health_check_period_s=2)
class BatchEngine(EngineServer):
    speculative = False

    async def __init__(self, config: dict) -> None:
        await self._init_engine(config)
