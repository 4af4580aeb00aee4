"""App builder: ``deployments.app:build`` for ``serve run`` / ``serve deploy`` (args = AppConfig).

Owns: wiring the deployments with their replicas and resources from the config —
DraftServer (placement ``separate`` only) -> SpecEngine (when a drafter is set) -> Router,
BatchEngine -> Router, and the ResponseStore (``/v1/responses``' stored responses) -> Router.
Ignores: what each deployment does.
"""
from __future__ import annotations

from ray.serve import Application

from deployments.app_config import AppConfig, DeploymentKnobs, Placement
from deployments.batch_engine import BatchEngine
from deployments.draft_server import DraftServer
from deployments.response_store import ResponseStore
from deployments.router import Router
from deployments.spec_engine import SpecEngine


def _opts(knobs: DeploymentKnobs, threads: int) -> dict:
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return {"num_replicas": knobs.num_replicas,
            "ray_actor_options": {"num_cpus": knobs.num_cpus, "num_gpus": knobs.num_gpus,
                                  "runtime_env": {"env_vars": env}}}


def build_app(cfg: AppConfig) -> Application:
    config = cfg.model_dump(mode="json")
    t = cfg.torch_threads
    spec = None
    if cfg.speculative:
        draft = None
        if cfg.placement is Placement.SEPARATE:
            draft = DraftServer.options(**_opts(cfg.draft_server, t)).bind(config)
        spec = SpecEngine.options(**_opts(cfg.spec_engine, t)).bind(config, draft)
    batch = BatchEngine.options(**_opts(cfg.batch_engine, t)).bind(config)
    store = ResponseStore.bind(cfg.http.stored_responses, cfg.http.stored_response_chars)
    return Router.options(**_opts(cfg.router_deployment, 1)).bind(spec, batch, config, store)


def build(args: dict) -> Application:
    """Serve app builder: ``import_path: deployments.app:build`` with ``args`` = AppConfig fields."""
    return build_app(AppConfig(**(args or {})))
