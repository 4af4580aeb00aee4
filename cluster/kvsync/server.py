"""KVSync server core: a remote drafter's per-sequence committed state around any ``Proposer``.

Owns: answering the KVSync RPCs (protos/specserve/v1/kvsync.proto) — epoch checks, per-sequence
committed prefixes (truncate to ``base_len`` = roll back the draft's unverified tokens, append the
newly committed ones, answer RESYNC when the expected prefix is not held), one batched ``propose``
call into the wrapped drafter per RPC, the limits of ``KVSyncLimits`` (whole requests past them
are refused with INVALID_ARGUMENT before any state changes), per-caller namespaces with LRU
eviction past ``max_sequences`` per caller, dropping requests whose deadline passed while they
waited (a resumed server does not chew through a backlog nobody waits for), the draft's own
sampling seed (derived from the request's seed with a fixed salt, so drafting and the engine's
acceptance test never share one random stream), the protocol version, and for a drafter that
reads the target's features (``feature_layers``: an EAGLE head) the positions of each sequence
whose features it holds — features of a Propose go to its ``record`` after the tokens are
applied; a version-1 caller is refused with FAILED_PRECONDITION and a sequence that asks for
drafts without the features of its committed positions but the last with INVALID_ARGUMENT —
and starting a ``grpc.Server`` for it with the bearer-token check, TLS and message size limits.
The wrapped proposer keeps its own KV state and is told the full committed token list each call
(its contract), so it rolls back exactly what the server's state implies.
Ignores: Ray (the DraftServer deployment wraps this), which drafter runs (draft model, layer skip,
n-gram) and how it is built.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import secrets
import threading
import time
from collections import OrderedDict
from concurrent import futures
from contextlib import contextmanager
from typing import Callable

import grpc

from cluster.api import stubs
from cluster.api.auth import BearerAuthInterceptor
from cluster.api.status import ServiceError
from cluster.common.request import SamplingParams
from cluster.kvsync.limits import MAX_SEQ_ID_CHARS, KVSyncLimits
from cluster.kvsync.tls import KVSyncTLS
from cluster.speculative.proposer import Proposer
from cluster.speculative.types import ProposeInput
from cluster.telemetry.grpc_interceptors import TracingServerInterceptor
from cluster.telemetry.tracing import add_event

log = logging.getLogger(__name__)

CALLER_METADATA = "kvsync-caller"  # a caller's stable name (RemoteProposer: one per instance)
PROTOCOL_VERSION = 3  # 1: tokens only; 2: + target features; 3: + draft scopes (protos/specserve/v1/kvsync.proto)
FEATURES_VERSION = 2  # the first version that carries target features
SCOPES_VERSION = 3  # the first version whose server drafts a sequence from its draft scope only
_DRAFT_SEED_SALT = b"specserve/kvsync/draft"
_INVALID = grpc.StatusCode.INVALID_ARGUMENT


def draft_seed(seed: int) -> int:
    """The draft side's generator seed for a request seeded with ``seed``: a keyed hash, so the
    draft stream is independent of the engine's acceptance stream (seeded with ``seed`` itself)
    yet reproducible."""
    digest = hashlib.blake2b(str(int(seed)).encode(), key=_DRAFT_SEED_SALT, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: torch.Generator.manual_seed range


def caller_of(metadata, peer: str) -> str:
    """The caller's namespace: its ``kvsync-caller`` metadata, else its peer host (no port, so a
    reconnect from the same host keeps its sequences)."""
    for key, value in metadata or ():
        if key == CALLER_METADATA:
            if not value or len(value) > MAX_SEQ_ID_CHARS:
                raise ServiceError(_INVALID, f"{CALLER_METADATA} metadata must be 1-{MAX_SEQ_ID_CHARS} characters")
            return value
    return peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer


class DraftServerCore:
    def __init__(self, proposer: Proposer, vocab_size: int, drafter: str = "",
                 vocab_hash: str = "", max_sequences: int = 4096,
                 limits: KVSyncLimits | None = None) -> None:
        if vocab_size < 0 or max_sequences < 1:  # vocab_size 0: vocabulary-agnostic (n-gram)
            raise ValueError("vocab_size must be >= 0 and max_sequences >= 1")
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.drafter = drafter
        self.vocab_hash = vocab_hash
        # a drafter that reads the target's features (EAGLE head): the layers, values per position
        # and the target it was trained for, as Info tells the caller
        self.feature_layers = tuple(getattr(proposer, "feature_layers", ()))
        self.feature_width = int(getattr(proposer, "feature_width", 0)) if self.feature_layers else 0
        self.feature_target = str(getattr(proposer, "target_fingerprint", "")) if self.feature_layers else ""
        # limits: what callers may ask (``max_sequences`` only applies without them); the q and
        # feature widths are this drafter's whatever the caller's limits said
        self.limits = dataclasses.replace(limits or KVSyncLimits(max_sequences=max_sequences),
                                          vocab_size=vocab_size, feature_width=self.feature_width)
        self.epoch = secrets.randbits(63) or 1  # new on every start: restarts are detectable
        # caller -> (seq id -> committed tokens), both least recently used first
        self._callers: OrderedDict[str, OrderedDict[str, list[int]]] = OrderedDict()
        self._generators: dict[str, object] = {}  # keyed like the wrapped proposer: caller/seq id
        self._features: dict[str, int] = {}  # caller/seq id -> positions [0, n) whose features are held
        self._lock = threading.Lock()  # the wrapped proposer is not assumed thread-safe
        self.num_resyncs_requested = 0
        self.num_expired = 0  # requests dropped because their deadline passed while waiting
        self._busy_since: float | None = None  # when the running drafter call started

    @property
    def max_sequences(self) -> int:
        return self.limits.max_sequences

    @property
    def num_sequences(self) -> int:
        return sum(len(seqs) for seqs in self._callers.values())

    def held(self, seq_id: str, caller: str | None = None) -> list[int] | None:
        """What is held for ``seq_id`` (of ``caller``, or of any caller)."""
        with self._lock:
            for name, seqs in self._callers.items():
                if (caller is None or name == caller) and seq_id in seqs:
                    return list(seqs[seq_id])
            return None

    @staticmethod
    def _key(caller: str, seq_id: str) -> str:
        return f"{caller}/{seq_id}"  # the wrapped proposer's id: callers never share a sequence

    def _forget(self, caller: str, seq_id: str) -> bool:
        seqs = self._callers.get(caller)
        if seqs is None or seqs.pop(seq_id, None) is None:
            return False
        key = self._key(caller, seq_id)
        self._generators.pop(key, None)
        self._features.pop(key, None)
        self.proposer.release(key)
        return True

    def _forget_caller(self, caller: str) -> None:
        for seq_id in list(self._callers.get(caller, ())):
            self._forget(caller, seq_id)
        self._callers.pop(caller, None)

    def _generator(self, key: str, params: SamplingParams):
        if params.greedy:
            return None
        gen = self._generators.get(key)
        if gen is None:
            import torch

            gen = torch.Generator()
            gen.manual_seed(draft_seed(params.seed) if params.seed is not None else secrets.randbits(62))
            self._generators[key] = gen
        return gen

    def _check(self, request) -> None:
        """Refuse a request past the limits as a whole, before any state changes."""
        lim = self.limits
        if self.feature_width and request.protocol_version < FEATURES_VERSION:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"this DraftServer runs {self.drafter or 'a drafter'} that reads the target's "
                               f"features (layers {list(self.feature_layers)}); the caller speaks KVSync protocol "
                               f"version {request.protocol_version or 1}, which carries none: upgrade the "
                               f"SpecEngine to version {PROTOCOL_VERSION}")
        if len(request.seqs) > lim.max_batch or len(request.release_seq_ids) > lim.max_batch:
            raise ServiceError(_INVALID, f"at most {lim.max_batch} sequences per call "
                                         f"(got {len(request.seqs)}, releasing {len(request.release_seq_ids)})")
        ids = [s.seq_id for s in request.seqs]
        if len(set(ids)) != len(ids):
            raise ServiceError(_INVALID, "a sequence id appears twice in one Propose")
        for s in request.seqs:
            if not s.seq_id or len(s.seq_id) > MAX_SEQ_ID_CHARS:
                raise ServiceError(_INVALID, f"seq_id must be 1-{MAX_SEQ_ID_CHARS} characters")
            for name in ("segment", "draft_scope"):
                value = getattr(s, name)
                if len(value) > MAX_SEQ_ID_CHARS:
                    raise ServiceError(_INVALID, f"{name} must be at most {MAX_SEQ_ID_CHARS} characters")
                if not value.isprintable():  # keeps memory_key(segment, draft_scope) one-to-one
                    raise ServiceError(_INVALID, f"{name} of {s.seq_id!r} has a control character")
            if s.num_draft_tokens > lim.max_draft_tokens:
                raise ServiceError(_INVALID, f"num_draft_tokens {s.num_draft_tokens} for {s.seq_id!r} "
                                             f"exceeds this server's limit of {lim.max_draft_tokens}")
            if not 0.0 <= s.stop_confidence < 1.0:  # NaN fails too
                raise ServiceError(_INVALID, f"stop_confidence {s.stop_confidence} for {s.seq_id!r} must be in [0, 1)")
            if s.base_len + len(s.new_tokens) > lim.max_seq_tokens:
                raise ServiceError(_INVALID, f"sequence {s.seq_id!r} would hold {s.base_len + len(s.new_tokens)} "
                                             f"tokens; the limit is {lim.max_seq_tokens}")
            if self.vocab_size and any(t < 0 or t >= self.vocab_size for t in s.new_tokens):
                raise ServiceError(_INVALID, f"sequence {s.seq_id!r} has token ids outside [0, {self.vocab_size})")
            if any(t < 0 for t in s.new_tokens):
                raise ServiceError(_INVALID, f"sequence {s.seq_id!r} has negative token ids")
            if s.HasField("features"):
                self._check_feature_rows(s)

    def _check_feature_rows(self, s) -> None:
        from cluster.kvsync.features import check_features

        if not self.feature_width:
            raise ServiceError(_INVALID, f"sequence {s.seq_id!r} carries target features; this drafter reads none")
        try:
            check_features(s.features, self.feature_width)
        except ValueError as exc:
            raise ServiceError(_INVALID, f"sequence {s.seq_id!r}: {exc}") from None
        if s.features.start_pos + s.features.num_positions > s.base_len + len(s.new_tokens):
            raise ServiceError(_INVALID, f"sequence {s.seq_id!r} has features past its committed tokens")

    def _check_feature_coverage(self, request, caller: str) -> None:
        """Refuse, before any state changes, a sequence that asks for drafts while the features of
        its committed positions but the last are not all held (held rows stay contiguous from 0)."""
        seqs = self._callers.get(caller, {})
        released = set(request.release_seq_ids)
        for s in request.seqs:
            have = 0
            if s.base_len:
                held = None if s.seq_id in released else seqs.get(s.seq_id)
                if held is None or len(held) < s.base_len:
                    continue  # answered RESYNC
                have = min(self._features.get(self._key(caller, s.seq_id), 0), s.base_len)
            if s.HasField("features"):
                if s.features.start_pos > have:
                    raise ServiceError(_INVALID, f"sequence {s.seq_id!r}: features start at position "
                                                 f"{s.features.start_pos} but only [0, {have}) are held")
                have = max(have, s.features.start_pos + s.features.num_positions)
            needed = s.base_len + len(s.new_tokens) - 1
            if s.num_draft_tokens > 0 and have < needed:
                raise ServiceError(_INVALID, f"sequence {s.seq_id!r} asks for drafts with target features of "
                                             f"positions [0, {have}); this drafter needs [0, {needed}) "
                                             f"(every committed position but the last)")

    def _record_features(self, key: str, s, held: list[int]) -> None:
        """Hand the Propose's feature rows of this sequence to the drafter; track what it holds."""
        have = min(self._features.get(key, 0), s.base_len)  # rows past the rollback are stale
        if s.HasField("features"):
            from cluster.kvsync.features import decode_features
            from cluster.models.runner import SeqChunk

            f = s.features
            end = f.start_pos + f.num_positions
            self.proposer.record([SeqChunk(key, held[f.start_pos:end], f.start_pos, 0)], decode_features(f))
            have = max(have, end)
        self._features[key] = have

    @staticmethod
    def _params(seq) -> SamplingParams:
        p = seq.params
        try:
            return SamplingParams(max_tokens=1, temperature=max(0.0, p.temperature),
                                  top_p=p.top_p if 0.0 < p.top_p <= 1.0 else 1.0,
                                  top_k=p.top_k, min_p=p.min_p, seed=p.seed if p.HasField("seed") else None)
        except ValueError as exc:
            raise ServiceError(_INVALID, f"sequence {seq.seq_id!r}: {exc}") from None

    def _seqs_of(self, caller: str) -> OrderedDict[str, list[int]]:
        seqs = self._callers.get(caller)
        if seqs is None:
            seqs = self._callers[caller] = OrderedDict()
            while len(self._callers) > self.limits.max_callers:  # the least recently seen caller
                self._forget_caller(next(iter(self._callers)))
        self._callers.move_to_end(caller)
        return seqs

    @contextmanager
    def _locked(self, time_left: Callable[[], float | None] | None):
        """Hold the lock, waiting no longer than the caller's deadline: a request nobody waits
        for any more is dropped unprocessed instead of queueing behind a slow drafter."""
        left = time_left() if time_left is not None else None
        if not self._lock.acquire(timeout=-1 if left is None else max(0.0, left)):
            self.num_expired += 1
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed waiting for the drafter")
        try:
            left = time_left() if time_left is not None else None
            if left is not None and left <= 0:
                self.num_expired += 1
                raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed waiting for the drafter")
            yield
        finally:
            self._lock.release()

    def busy_for(self) -> float:
        """Seconds the current drafter call has been running (0 when idle): the health check's
        sign of a wedged drafter."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def propose(self, request, caller: str = "", time_left: Callable[[], float | None] | None = None):
        """time_left: seconds until the caller's deadline (None: no deadline)."""
        pb2 = stubs.kvsync_pb2()
        if request.epoch != self.epoch:
            return pb2.ProposeResponse(epoch=self.epoch, status=pb2.BATCH_STATUS_EPOCH_MISMATCH)
        self._check(request)
        params = [self._params(s) for s in request.seqs]
        with self._locked(time_left):
            if self.feature_width:
                self._check_feature_coverage(request, caller)
            for seq_id in request.release_seq_ids:
                self._forget(caller, seq_id)
            seqs = self._seqs_of(caller)
            results = [pb2.SeqProposal(seq_id=s.seq_id) for s in request.seqs]
            inputs: list[ProposeInput] = []
            rows: list[int] = []
            for i, (s, p) in enumerate(zip(request.seqs, params)):
                held = seqs.get(s.seq_id)
                if s.base_len == 0:
                    held = list(s.new_tokens)
                elif held is None or len(held) < s.base_len:
                    results[i].status = pb2.SEQ_STATUS_RESYNC
                    add_event("draft.resync", {"specserve.request_id": s.seq_id,
                                               "specserve.draft.reason": "prefix not held"})
                    self.num_resyncs_requested += 1
                    continue
                else:
                    del held[s.base_len:]  # roll back to what the engine says is committed
                    held.extend(s.new_tokens)
                if not held:
                    results[i].status = pb2.SEQ_STATUS_RESYNC
                    continue
                seqs[s.seq_id] = held
                seqs.move_to_end(s.seq_id)
                if self.feature_width:
                    self._record_features(self._key(caller, s.seq_id), s, held)
                results[i].committed_len = len(held)
                if s.num_draft_tokens > 0:
                    key = self._key(caller, s.seq_id)
                    inputs.append(ProposeInput(seq_id=key, token_ids=list(held),
                                               num_draft_tokens=int(s.num_draft_tokens), params=p,
                                               generator=self._generator(key, p), segment=s.segment,
                                               draft_scope=s.draft_scope, stop_confidence=s.stop_confidence))
                    rows.append(i)
            if inputs:
                self._busy_since = time.monotonic()
                try:
                    proposal = self.proposer.propose(inputs)
                except Exception as exc:  # the engine falls back to plain steps; the log keeps the rest
                    log.exception("drafter failed on %d sequences", len(inputs))
                    raise ServiceError(grpc.StatusCode.INTERNAL, f"drafter failed: {type(exc).__name__}") from None
                finally:
                    self._busy_since = None
                for row, inp, toks, probs in zip(rows, inputs, proposal.draft_token_ids,
                                                 proposal.draft_probs):
                    toks = list(toks)[: inp.num_draft_tokens]
                    results[row].draft_tokens.extend(int(t) for t in toks)
                    if probs is not None and not inp.params.greedy and toks:
                        q = probs[: len(toks)].float().contiguous()  # [K_i, V]
                        results[row].draft_probs = q.numpy().tobytes()
            while len(seqs) > self.limits.max_sequences:  # LRU within the caller: they will RESYNC
                self._forget(caller, next(iter(seqs)))
            return pb2.ProposeResponse(epoch=self.epoch, status=pb2.BATCH_STATUS_OK, seqs=results)

    def release(self, request, caller: str = ""):
        pb2 = stubs.kvsync_pb2()
        if len(request.seq_ids) > self.limits.max_batch:
            raise ServiceError(_INVALID, f"at most {self.limits.max_batch} ids per Release")
        with self._lock:
            return pb2.ReleaseResponse(released=sum(self._forget(caller, s) for s in request.seq_ids))

    def info(self):
        return stubs.kvsync_pb2().InfoResponse(epoch=self.epoch, vocab_size=self.vocab_size,
                                               drafter=self.drafter, vocab_hash=self.vocab_hash,
                                               num_sequences=self.num_sequences,
                                               protocol_version=PROTOCOL_VERSION,
                                               feature_layers=self.feature_layers,
                                               feature_width=self.feature_width,
                                               feature_target=self.feature_target)


def _servicer(core: DraftServerCore):
    base = stubs.kvsync_grpc().KVSyncServicer

    def answer(context, call):
        try:
            return call(caller_of(context.invocation_metadata(), context.peer()))
        except ServiceError as exc:
            context.abort(exc.code, exc.message)

    class KVSyncServicer(base):
        def Propose(self, request, context):  # noqa: N802 (gRPC naming)
            return answer(context, lambda caller: core.propose(request, caller, context.time_remaining))

        def Release(self, request, context):  # noqa: N802
            return answer(context, lambda caller: core.release(request, caller))

        def Info(self, request, context):  # noqa: N802
            return core.info()

    return KVSyncServicer()


def start_server(core: DraftServerCore, host: str = "127.0.0.1", port: int = 0,
                 max_workers: int = 4, *, token: str | None = None,
                 tls: KVSyncTLS | None = None) -> tuple[grpc.Server, int]:
    """Start a KVSync gRPC server; returns (server, bound port). Stop with ``server.stop(grace)``.
    token: the bearer token every call must carry (None: auth off). tls: serve TLS when enabled."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         interceptors=[BearerAuthInterceptor(token),  # before any handler runs
                                       TracingServerInterceptor()],  # no-op while tracing is off
                         options=[("grpc.max_send_message_length", core.limits.response_bytes),
                                  ("grpc.max_receive_message_length", core.limits.request_bytes)])
    stubs.kvsync_grpc().add_KVSyncServicer_to_server(_servicer(core), server)
    address = f"{host}:{port}"
    if tls is not None and tls.enabled:
        bound = server.add_secure_port(address, tls.server_credentials())
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind KVSync server to {address}")
    server.start()
    return server, bound
