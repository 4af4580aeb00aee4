"""DraftServer deployment: the draft model in its own replicas (placement ``separate``).

Owns: building the drafter for this replica and serving it over KVSync with a real gRPC server
(``cluster.spec.draft_server``) on this node's IP and ``draft_server.port`` (0 = ephemeral).
Ray Serve's gRPC proxy only fronts ingress traffic and cannot hold a stateful per-sequence
conversation with one replica, so the SpecEngine talks to this server directly; it learns the
address from ``address()`` through a Serve handle and re-asks periodically, which also follows a
replica that Serve restarted (new port, new epoch -> full resync).
Ignores: verification, routing.
"""
from __future__ import annotations

import logging

from ray import serve

from cluster.spec.draft_server import DraftServerCore, start_server
from cluster.spec.proposer import DrafterKind, parse_drafter_spec
from cluster.telemetry.tracing import configure_from_section
from deployments.app_config import AppConfig
from deployments.quiet_polls import quiet_polls

log = logging.getLogger("specserve.draft_server")


def build_proposer(app: AppConfig):
    """(proposer, vocab_size) for the configured drafter; vocab_size 0 = vocabulary-agnostic."""
    spec = parse_drafter_spec(app.drafter)
    if spec is None:
        raise ValueError("DraftServer needs a drafter")
    if spec.kind is DrafterKind.NGRAM:
        from cluster.spec.ngram import NgramProposer

        return NgramProposer(), 0
    # Model drafters: an independent draft model (vocabulary checked against the target's
    # tokenizer), or the target's first L layers as a draft model with this replica's own KV.
    from cluster.spec.remote_drafters import build_remote_proposer

    return build_remote_proposer(spec, target_model=app.model, dtype=app.dtype,
                                 force_vocab_mismatch=app.force_vocab_mismatch,
                                 kv_cache_memory_mb=app.draft_server.kv_cache_memory_mb)


@serve.deployment(name="DraftServer", max_ongoing_requests=64, health_check_period_s=2)
class DraftServer:
    def __init__(self, config: dict) -> None:
        import ray

        app = AppConfig(**config)
        quiet_polls("address")  # the SpecEngine asks for it on a timer
        configure_from_section(app.telemetry)  # before start_server: its interceptor reads it per call
        import torch  # before loading a draft model: loading and drafting use these threads

        torch.set_num_threads(app.torch_threads)
        proposer, vocab_size = build_proposer(app)
        self.core = DraftServerCore(proposer, vocab_size=vocab_size, drafter=app.drafter,
                                    max_sequences=app.draft_server.max_sequences)
        host = app.draft_server.host or ray.util.get_node_ip_address()
        self.server, port = start_server(self.core, host=host, port=app.draft_server.port)
        self._address = f"{host}:{port}"
        log.info("KVSync server on %s (epoch %d)", self._address, self.core.epoch)

    def address(self) -> str:
        return self._address

    def info(self) -> dict:
        return {"address": self._address, "epoch": self.core.epoch,
                "num_sequences": self.core.num_sequences}

    def check_health(self) -> None:
        pass  # the gRPC server lives in this process: if the replica is up, so is the server

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.stop(0)
