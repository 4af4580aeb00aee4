"""DraftServer deployment: the draft model in its own replicas (placement ``separate``).

Owns: building the drafter for this replica and serving it over KVSync with a real gRPC server
(``cluster.kvsync.server``) on ``draft_server.host`` (default: this node's IP; under Helm the
pod IP) and ``draft_server.port`` (0 = ephemeral), closed to strangers: the ``auth`` section's
bearer token on every call, TLS when ``kvsync`` names a certificate, and limits derived from the
SpecEngine's K, batch and context (``AppConfig.kvsync_limits``). ``check_health`` asks the server
itself over loopback (Info with a short deadline, same token and TLS) and fails on a drafter call
stuck for ``STUCK_DRAFTER_S``, so a dead or wedged server fails the replica and Serve replaces it.
Ray Serve's gRPC proxy only fronts ingress traffic and cannot hold a stateful per-sequence
conversation with one replica, so the SpecEngine talks to this server directly; it learns the
address from ``address()`` through a Serve handle and re-asks periodically, which also follows a
replica that Serve restarted (new port, new epoch -> full resync).
Ignores: verification, routing.
"""
from __future__ import annotations

import logging

from ray import serve

from cluster.api.auth import bearer_metadata, token_from_env
from cluster.kvsync.server import DraftServerCore, start_server
from cluster.speculative.proposer import DrafterKind, parse_drafter_choice
from cluster.telemetry.tracing import configure_from_section
from deployments.app_config import AppConfig
from deployments.quiet_polls import quiet_polls

log = logging.getLogger("specserve.draft_server")
HEALTH_DEADLINE_S = 2.0  # a server that cannot answer Info this fast is wedged
STUCK_DRAFTER_S = 30.0  # one drafter call running this long is a wedged drafter, not a slow one
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def build_proposer(app: AppConfig):
    """(proposer, vocab_size) for the configured drafter; vocab_size 0 = vocabulary-agnostic."""
    choice = parse_drafter_choice(app.drafter)
    if choice is None:
        raise ValueError("DraftServer needs a drafter")
    if app.names_suffix_corpus_file:  # AppConfig refuses it first
        raise ValueError(f"suffix_corpus {app.suffix_corpus!r}: the DraftServer does not load the target a suffix "
                         "corpus is checked against; its suffix drafters learn from traffic only")
    if choice.kind is DrafterKind.NGRAM:
        from cluster.speculative.ngram import NgramProposer

        return NgramProposer(), 0
    if choice.kind is DrafterKind.SUFFIX:  # learns from the segments of every caller (one target model)
        from cluster.speculative.suffix import SuffixProposer

        if choice.names_suffix_corpus:  # AppConfig refuses it first
            raise ValueError(f"drafter {app.drafter!r}: the DraftServer does not load the target a suffix "
                             "corpus is checked against; it serves 'suffix' from traffic only")
        return SuffixProposer(), 0
    if choice.kind is DrafterKind.PORTFOLIO:
        if choice.model:  # AppConfig refuses it first; a head needs the target's features
            raise ValueError(f"drafter {app.drafter!r}: the DraftServer serves the model-free portfolio only")
        from cluster.speculative.portfolio import default_portfolio

        return default_portfolio(), 0  # its suffix member from traffic only (no target to check a corpus by)
    # Model drafters: an independent draft model (vocabulary checked against the target's
    # tokenizer), or the target's first L layers as a draft model with this replica's own KV.
    from cluster.kvsync.drafters import build_remote_proposer

    return build_remote_proposer(choice, target_model=app.model, dtype=app.dtype,
                                 force_vocab_mismatch=app.force_vocab_mismatch,
                                 kv_cache_memory_mb=app.draft_server.kv_cache_memory_mb)


class KVSyncHealth:
    """A loopback client of this replica's own KVSync server (same token, same TLS)."""

    def __init__(self, address: str, app: AppConfig, token: str | None) -> None:
        from cluster.api import stubs

        self._channel = app.kvsync.tls().open_channel(address)
        self._stub = stubs.kvsync_grpc().KVSyncStub(self._channel)
        self._request = stubs.kvsync_pb2().InfoRequest()
        self._metadata = bearer_metadata(token)

    def check(self, core: DraftServerCore) -> None:
        import grpc

        if core.busy_for() > STUCK_DRAFTER_S:
            raise RuntimeError(f"the drafter has been running one call for {core.busy_for():.0f} s")
        try:
            info = self._stub.Info(self._request, timeout=HEALTH_DEADLINE_S, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise RuntimeError(f"KVSync server does not answer: {exc.code().name} {exc.details()}") from None
        if info.epoch != core.epoch:
            raise RuntimeError("another KVSync server answers on this replica's address")

    def close(self) -> None:
        self._channel.close()


@serve.deployment(name="DraftServer", max_ongoing_requests=64, health_check_period_s=2)
class DraftServer:
    def __init__(self, config: dict) -> None:
        import ray

        app = AppConfig(**config)
        token = token_from_env(app.auth.token_env, "DraftServer")
        quiet_polls("address")  # the SpecEngine asks for it on a timer
        configure_from_section(app.telemetry)  # before start_server: its interceptor reads it per call
        import torch  # before loading a draft model: loading and drafting use these threads

        torch.set_num_threads(app.torch_threads)
        proposer, vocab_size = build_proposer(app)
        self.core = DraftServerCore(proposer, vocab_size=vocab_size, drafter=app.drafter,
                                    limits=app.kvsync_limits(vocab_size))
        host = app.draft_server.host or ray.util.get_node_ip_address()
        if token is None and host not in _LOOPBACK_HOSTS:
            log.warning("KVSync listens on %s without auth: anyone who reaches it can read drafts and "
                        "release sequences; set auth.token_env (and a NetworkPolicy)", host)
        tls = app.kvsync.tls()
        self.server, port = start_server(self.core, host=host, port=app.draft_server.port, max_workers=8,
                                         token=token, tls=tls)
        self._address = f"{host}:{port}"
        self._health = KVSyncHealth(self._address, app, token)
        log.info("KVSync server on %s (epoch %d, auth %s, TLS %s)", self._address, self.core.epoch,
                 "on" if token else "off", "on" if tls.enabled else "off")

    def address(self) -> str:
        return self._address

    def info(self) -> dict:
        return {"address": self._address, "epoch": self.core.epoch,
                "num_sequences": self.core.num_sequences}

    def check_health(self) -> None:
        self._health.check(self.core)

    def __del__(self) -> None:
        health = getattr(self, "_health", None)
        if health is not None:
            health.close()
        server = getattr(self, "server", None)
        if server is not None:
            server.stop(0)
