"""``RemoteProposer``: the engine-side KVSync client, a ``Proposer`` whose drafter lives elsewhere.

Owns: per-sequence bookkeeping of what the DraftServer holds (the committed tokens sent so far),
sending only the tokens committed since the last call, resending full prefixes on RESYNC or on an
epoch change (restarted draft), decoding draft probabilities (refused unless their width is the
target's vocabulary, ``expected_vocab_size``), and turning every transport failure (connection
refused, deadline, refusal) into ``DraftUnavailableError`` so the engine runs that step without
speculation. One propose (all its RPCs: connect, call, resync) never takes longer than the
``DraftBudget`` derived from the measured target step time: a hung DraftServer costs a step at most
the budget, and the controller's back-off keeps the following steps plain. Releases are queued and
piggybacked on the next Propose; those no Propose picked up within ``release_idle_s`` (an idle
or non-speculating engine) are sent by a background thread (``flush_releases`` sends them now):
never a synchronous RPC inside a step. Every call carries the bearer token (when auth is on) and this engine's
caller name; the channel uses TLS when certificates are configured. After a connection failure it
stays quiet for ``retry_after_s`` and then reconnects (possibly to a new address set by
``set_address``: the DraftServer replica moved). It speaks KVSync ``PROTOCOL_VERSION``; for a
DraftServer whose drafter reads the target's features (Info names ``feature_layers``: an EAGLE
head) it checks the head's target and width against this engine's target, has its
``FeatureBuffer`` (the tap ``attach_target`` installs on the target runner) record those layers,
and sends with each sequence's tokens the features of the committed positions the server lacks
(all of them on a resync); a sequence without features from position 0 (prefilled before the
server named its layers: Info is asked on attach and on a new address, not only at the first
propose) is not drafted. A server older than ``SCOPES_VERSION`` would draft a sequence with a
draft scope from every scope's traffic: such sequences only sync their state there (no drafts,
logged once).
Ignores: verification, adaptive K, which drafter the server runs.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import deque

import grpc

from cluster.api import stubs
from cluster.api.auth import bearer_metadata
from cluster.common.errors import VocabularyMismatchError
from cluster.kvsync.budget import DraftBudget
from cluster.kvsync.limits import KVSyncLimits
from cluster.kvsync.server import CALLER_METADATA, PROTOCOL_VERSION, SCOPES_VERSION
from cluster.kvsync.tls import KVSyncTLS
from cluster.speculative.proposer import DrafterKind
from cluster.speculative.types import DraftProposal, DraftUnavailableError, ProposeInput
from cluster.telemetry.grpc_interceptors import client_interceptors
from cluster.telemetry.tracing import tracing_enabled

log = logging.getLogger(__name__)

_MAX_PENDING_RELEASES = 4096  # past it the oldest are dropped: the server's LRU forgets them anyway
_UNKNOWN_VOCAB = 1 << 18  # q width assumed for the reply size limit before the target's is known


class RemoteVocabularyMismatchError(VocabularyMismatchError, DraftUnavailableError):
    """The draft's q width is not the target's vocabulary: refused, and the step goes plain."""


class RemoteProposer:
    kind = DrafterKind.REMOTE

    def __init__(self, address: str | None = None, *, timeout_s: float = 2.0,
                 retry_after_s: float = 1.0, expected_vocab_size: int | None = None,
                 token: str | None = None, tls: KVSyncTLS | None = None,
                 budget: DraftBudget | None = None, limits: KVSyncLimits | None = None,
                 release_idle_s: float = 0.5, feature_dtype: str = "bfloat16") -> None:
        """timeout_s: the longest a propose may take (the budget's cap); budget: how long it may
        take given the measured step time (default: ``DraftBudget(cap_s=timeout_s)``);
        feature_dtype: how target features travel (float32, float16 or bfloat16)."""
        if timeout_s <= 0 or retry_after_s < 0 or release_idle_s <= 0:
            raise ValueError("timeout_s and release_idle_s must be > 0 and retry_after_s >= 0")
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.release_idle_s = release_idle_s
        self.expected_vocab_size = expected_vocab_size
        self.budget = budget or DraftBudget(cap_s=timeout_s, floor_s=min(0.02, timeout_s))
        self.limits = limits or KVSyncLimits()
        self.feature_dtype = feature_dtype
        self._features = None  # FeatureBuffer on the target runner (attach_target)
        self._channel_feature_width = 0  # feature width the channel's message limits allow
        self._token = token
        self._tls = tls or KVSyncTLS()
        self.caller = uuid.uuid4().hex  # this engine's namespace on the server
        self._address = address
        self._channel: grpc.Channel | None = None
        self._stub = None
        self._confirmed = False  # Info answered on this channel (epoch and vocabulary known)
        self._server_version = PROTOCOL_VERSION  # the server's KVSync version, from its Info
        self._unscoped_logged = False  # a scoped sequence went undrafted on an older server (logged once)
        self._epoch = 0
        self._sent: dict[str, list[int]] = {}  # seq id -> committed tokens the server holds
        self._lost: set[str] = set()  # tracked when the server's epoch changed: resent in full next
        self._releases: deque[str] = deque(maxlen=_MAX_PENDING_RELEASES)  # retired, not yet told
        # sent in a call that failed (late): the server may hold them, so their release is sent too
        self._unsure: set[str] = set()
        self._last_propose = 0.0
        self._flusher: threading.Thread | None = None  # started by the first release
        self._stop = threading.Event()
        self._down_until = 0.0
        self._refused = ""  # why the last connect was refused (shown while it stays down)
        self._lock = threading.RLock()
        self.num_resyncs = 0  # sequences whose full prefix was resent
        self.num_epoch_changes = 0
        self.num_failures = 0
        self.num_late = 0  # proposes abandoned at the budget (the step went plain)
        self.last_resynced: set[str] = set()  # seq ids whose prefix the last propose() resent

    def __getstate__(self) -> dict:
        """Picklable before use (``ProcessEngine`` ships it to the engine core process): the
        connection, the lock, the feature tap and what the server holds are not carried."""
        local = ("_channel", "_stub", "_lock", "_confirmed", "_flusher", "_stop", "_features")
        state = {k: v for k, v in self.__dict__.items() if k not in local}
        state.update(_sent={}, _lost=set(), _epoch=0, _releases=deque(maxlen=_MAX_PENDING_RELEASES),
                     _unsure=set(), _channel_feature_width=0)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._channel = self._stub = None
        self._confirmed = False
        self._features = None  # attach_target installs one on the runner of this process
        self._lock = threading.RLock()
        self._flusher, self._stop = None, threading.Event()

    def attach_target(self, runner) -> None:
        """Install this proposer's feature tap on the target runner (``TargetFeatureReader``); it
        records nothing until a DraftServer asks for features. A runner without a feature tap (not
        the native Llama runner) gets none: a feature-reading DraftServer is then refused."""
        if not hasattr(runner, "feature_tap"):
            return
        if runner.feature_tap is not None:
            raise ValueError("the target runner already feeds another feature tap")
        from cluster.kvsync.features import FeatureBuffer
        from cluster.speculative.eagle_head import target_identity

        self._features = FeatureBuffer(runner.model.arch.hidden_size,
                                       target_identity(runner.model).fingerprint, self.feature_dtype)
        runner.feature_tap = self._features
        if self._address:
            self._probe()

    def _probe(self) -> None:
        """Ask Info now (engine start, new address), not at the first propose: sequences prefilled
        before the server named its feature layers have no features to draft from."""
        with self._lock:
            try:
                self._connect(time.monotonic() + self.timeout_s)
            except DraftUnavailableError:
                pass  # logged where refused; the next propose retries

    @property
    def resyncs(self) -> int:  # the name the engine's stats read
        return self.num_resyncs

    def observe_target_step(self, forward_s: float) -> None:
        """The controller reports each target forward: the propose budget follows the step time."""
        self.budget.observe(forward_s)

    # -- connection ------------------------------------------------------------------------
    @property
    def address(self) -> str | None:
        return self._address

    def set_address(self, address: str | None) -> None:
        with self._lock:
            if address != self._address:
                self._address = address
                self._disconnect()
                self._down_until = 0.0
                if address and self._features is not None:  # off the caller's thread (a step may wait)
                    threading.Thread(target=self._probe, name="kvsync-info", daemon=True).start()

    def _disconnect(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None
        self._confirmed = False

    def _fail(self, what: str, exc: BaseException | None = None) -> DraftUnavailableError:
        self.num_failures += 1
        if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            # late, not gone: keep the channel; the controller's back-off keeps the next steps plain
            self.num_late += 1
            return DraftUnavailableError(f"draft server {self._address} gave no answer within the "
                                         f"step's budget; this step runs without drafts")
        if isinstance(exc, grpc.RpcError) and exc.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                                             grpc.StatusCode.INVALID_ARGUMENT,
                                                             grpc.StatusCode.FAILED_PRECONDITION):
            log.error("draft server %s refused KVSync (%s: %s): check auth.token_env, the kvsync "
                      "section and num_draft_tokens on both sides", self._address, exc.code().name, exc.details())
        self._disconnect()
        self._down_until = time.monotonic() + self.retry_after_s
        detail = f": {exc.code().name} {exc.details()}" if isinstance(exc, grpc.RpcError) else ""
        return DraftUnavailableError(f"draft server {self._address} {what}{detail}")

    def _left(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            self.num_failures += 1
            self.num_late += 1
            raise DraftUnavailableError(f"draft server {self._address}: the step's budget is spent")
        return left

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return (*bearer_metadata(self._token), (CALLER_METADATA, self.caller))

    def _open_channel(self) -> grpc.Channel:
        vocab = self.expected_vocab_size or _UNKNOWN_VOCAB
        sends = dataclasses.replace(self.limits, feature_width=self._channel_feature_width)
        options = [("grpc.max_send_message_length", sends.request_bytes),
                   ("grpc.max_receive_message_length",
                    dataclasses.replace(self.limits, vocab_size=vocab).response_bytes)]
        return self._tls.open_channel(self._address, options)

    def _connect(self, deadline: float) -> None:
        if self._confirmed:
            return
        if not self._address:
            raise DraftUnavailableError("no draft server address")
        if self._channel is None:
            if time.monotonic() < self._down_until:
                raise DraftUnavailableError(f"draft server {self._address} down; retrying later{self._refused}")
            self._new_channel()
        try:
            info = self._stub.Info(stubs.kvsync_pb2().InfoRequest(protocol_version=PROTOCOL_VERSION),
                                   timeout=self._left(deadline), metadata=self._metadata())
        except grpc.RpcError as exc:
            # late: the channel keeps connecting (TCP, TLS) in the background and the next step
            # asks again; anything else: dropped, and retried after retry_after_s
            raise self._fail("unreachable", exc) from None
        if (self.expected_vocab_size is not None and info.vocab_size  # 0: a vocabulary-agnostic drafter
                and info.vocab_size != self.expected_vocab_size):
            raise self._vocab_mismatch(f"draft server vocabulary has {info.vocab_size} tokens")
        self._take_feature_request(info)
        if info.feature_width != self._channel_feature_width:  # message limits for its feature rows
            self._channel_feature_width = info.feature_width
            self._channel.close()
            self._new_channel()
        self._set_epoch(info.epoch)
        self._server_version = info.protocol_version or 1
        self._confirmed = True
        self._refused = ""

    def _new_channel(self) -> None:
        self._channel = self._open_channel()
        if tracing_enabled():  # CLIENT spans + traceparent in metadata; no wrapper when tracing is off
            self._channel = grpc.intercept_channel(self._channel, *client_interceptors())
        self._stub = stubs.kvsync_grpc().KVSyncStub(self._channel)

    def _take_feature_request(self, info) -> None:
        """Have the tap record the layers a feature-reading drafter asks for, or refuse it."""
        from cluster.kvsync.features import feature_request_refusal

        why = feature_request_refusal(info, self._features)
        if why:
            raise self._refuse(DraftUnavailableError, why)
        if self._features is not None:
            self._features.want(tuple(info.feature_layers))

    def _vocab_mismatch(self, what: str) -> RemoteVocabularyMismatchError:
        return self._refuse(RemoteVocabularyMismatchError, f"{what}, target has {self.expected_vocab_size}")

    def _refuse(self, cls: type[DraftUnavailableError], what: str) -> DraftUnavailableError:
        self.num_failures += 1
        self._disconnect()
        self._down_until = time.monotonic() + self.retry_after_s
        msg = f"{what}: refused, the engine decodes without speculation (draft server {self._address})"
        self._refused = f" (refused: {what})"
        log.error("%s", msg)
        return cls(msg)

    def _set_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            if self._epoch != 0:
                self.num_epoch_changes += 1
            self._epoch = epoch
            self._lost |= self._sent.keys()  # their next propose resends the whole prefix: a resync
            self._sent.clear()  # a new server holds nothing we sent to the old one
            self._releases.clear()  # nor anything to release
            self._unsure.clear()

    # -- Proposer --------------------------------------------------------------------------
    def _seq_pb(self, inp: ProposeInput, full: bool):
        pb2 = stubs.kvsync_pb2()
        sent = None if full else self._sent.get(inp.seq_id)
        tokens = inp.token_ids
        if sent is not None and len(sent) <= len(tokens) and tokens[: len(sent)] == sent:
            base, new = len(sent), tokens[len(sent):]
        else:
            base, new = 0, tokens
        p = inp.params
        params = pb2.DraftSamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p)
        if p.seed is not None:
            params.seed = p.seed
        k = min(inp.num_draft_tokens, self.limits.max_draft_tokens)
        if inp.draft_scope and self._server_version < SCOPES_VERSION and k:
            k = 0  # it would draft from every scope's answers: sync only
            if not self._unscoped_logged:
                self._unscoped_logged = True
                log.warning("draft server %s speaks KVSync %d (draft scopes need %d): requests with a "
                            "draft_scope get no drafts from it", self._address, self._server_version, SCOPES_VERSION)
        seq = pb2.ProposeSeq(seq_id=inp.seq_id, base_len=base, new_tokens=new, num_draft_tokens=k,
                             params=params, segment=inp.segment, stop_confidence=inp.stop_confidence,
                             draft_scope=inp.draft_scope)
        # features the server lacks: it holds [0, base - 1) (sent with the tokens it holds), and
        # the last committed token's has not been computed yet
        start, end = max(base - 1, 0), len(tokens) - 1
        if self._wants_features() and end > start:
            seq.features.CopyFrom(self._features.encode(inp.seq_id, start, end))
        return seq

    def _wants_features(self) -> bool:
        return self._features is not None and bool(self._features.feature_layers)

    def _call(self, inputs: list[ProposeInput], full: bool, deadline: float, releases=()):
        pb2 = stubs.kvsync_pb2()
        req = pb2.ProposeRequest(epoch=self._epoch, seqs=[self._seq_pb(i, full) for i in inputs],
                                 release_seq_ids=list(releases), protocol_version=PROTOCOL_VERSION)
        try:
            return self._stub.Propose(req, timeout=self._left(deadline), metadata=self._metadata())
        except (grpc.RpcError, DraftUnavailableError) as exc:
            # not known to be done or not: releases are sent again, and the sequences may be held
            self._releases.extendleft(reversed(releases))
            self._unsure.update(i.seq_id for i in inputs)
            if isinstance(exc, grpc.RpcError):
                raise self._fail("failed", exc) from None
            raise

    def _take_releases(self) -> list[str]:
        n = min(len(self._releases), self.limits.max_batch)
        return [self._releases.popleft() for _ in range(n)]

    def propose(self, inputs: list[ProposeInput]) -> DraftProposal:
        pb2 = stubs.kvsync_pb2()
        with self._lock:
            self._last_propose = time.monotonic()
            deadline = self._last_propose + self.budget.seconds
            self.last_resynced = set()
            self._connect(deadline)
            every = inputs
            if self._wants_features():  # those without features from position 0 cannot be drafted
                inputs = [i for i in every if self._features.covers(i.seq_id, len(i.token_ids) - 1)]
                if not inputs:
                    return DraftProposal(draft_token_ids=[[] for _ in every], draft_probs=[None for _ in every])
            resp = self._call(inputs, full=False, deadline=deadline, releases=self._take_releases())
            if resp.status == pb2.BATCH_STATUS_EPOCH_MISMATCH:  # the server restarted
                self._set_epoch(resp.epoch)  # marks the tracked sequences lost (counted below)
                resp = self._call(inputs, full=True, deadline=deadline)
                if resp.status != pb2.BATCH_STATUS_OK:
                    raise self._fail("keeps changing epoch")
            lost = [i.seq_id for i in inputs if i.seq_id in self._lost]
            if lost:  # the draft restarted (new epoch at connect or in the reply) and lost them
                self.num_resyncs += len(lost)
                self.last_resynced |= set(lost)
                self._lost.difference_update(lost)
            by_id = {s.seq_id: s for s in resp.seqs}
            resync = [i for i in inputs if by_id[i.seq_id].status == pb2.SEQ_STATUS_RESYNC]
            if resync:
                self.num_resyncs += len(resync)
                self.last_resynced |= {i.seq_id for i in resync}
                for inp in resync:
                    self._sent.pop(inp.seq_id, None)
                again = self._call(resync, full=True, deadline=deadline)
                if again.status != pb2.BATCH_STATUS_OK:
                    raise self._fail("changed epoch during resync")
                by_id.update({s.seq_id: s for s in again.seqs})
            tokens: list[list[int]] = []
            probs: list = []
            for inp in every:
                s = by_id.get(inp.seq_id)
                if s is None:  # not sent: no features to draft from
                    tokens.append([])
                    probs.append(None)
                    continue
                if s.status != pb2.SEQ_STATUS_OK:
                    self._sent.pop(inp.seq_id, None)
                    tokens.append([])
                    probs.append(None)
                    continue
                self._sent[inp.seq_id] = list(inp.token_ids)
                self._unsure.discard(inp.seq_id)
                draft = list(s.draft_tokens)[: inp.num_draft_tokens]
                tokens.append(draft)
                probs.append(self._decode_probs(s.draft_probs, len(draft)))
            return DraftProposal(draft_token_ids=tokens, draft_probs=probs)

    def _decode_probs(self, raw: bytes, k: int):
        if not raw or k == 0:
            return None
        import torch

        q = torch.frombuffer(bytearray(raw), dtype=torch.float32)
        if q.numel() % k:
            raise DraftUnavailableError(f"draft probabilities of {q.numel()} floats do not split into {k} rows")
        width = q.numel() // k
        if self.expected_vocab_size is not None and width != self.expected_vocab_size:
            raise self._vocab_mismatch(f"draft probabilities are {width} wide")
        return q.view(k, width)  # [K_i, V]

    def release(self, seq_id: str) -> None:
        """Queue ``seq_id`` for release: sent with the next propose (or ``flush_releases``)."""
        with self._lock:
            self._lost.discard(seq_id)
            if self._features is not None:
                self._features.forget(seq_id)
            held = self._sent.pop(seq_id, None) is not None
            if held or seq_id in self._unsure:
                self._unsure.discard(seq_id)
                self._releases.append(seq_id)
                if self._flusher is None:
                    self._flusher = threading.Thread(target=self._flush_idle, name="kvsync-release", daemon=True)
                    self._flusher.start()

    def _flush_idle(self) -> None:
        """Background: send releases that no Propose carried within ``release_idle_s``. The RPC
        runs outside the lock, so a step's propose never waits for it."""
        pb2 = stubs.kvsync_pb2()
        while not self._stop.wait(self.release_idle_s):
            while self._send_idle_batch(pb2):
                pass

    def _send_idle_batch(self, pb2) -> bool:
        """One batch of releases no propose carried; True when it was sent (more may wait)."""
        with self._lock:
            if (not self._releases or not self._confirmed
                    or time.monotonic() - self._last_propose < self.release_idle_s):
                return False
            batch, stub, epoch, metadata = self._take_releases(), self._stub, self._epoch, self._metadata()
        try:
            stub.Release(pb2.ReleaseRequest(epoch=epoch, seq_ids=batch), timeout=self.budget.cap_s,
                         metadata=metadata)
            return True
        except grpc.RpcError:
            with self._lock:
                if self._epoch == epoch:  # still owed to this server: try again later
                    self._releases.extendleft(reversed(batch))
            return False

    def flush_releases(self) -> int:
        """Send the queued releases now (on close, in tests); returns how many the server freed.
        Failures are ignored: a draft that is gone holds nothing, a restarted one a new epoch."""
        pb2 = stubs.kvsync_pb2()
        freed = 0
        with self._lock:
            while self._releases and self._confirmed:
                batch = self._take_releases()
                try:
                    freed += self._stub.Release(pb2.ReleaseRequest(epoch=self._epoch, seq_ids=batch),
                                                timeout=self.budget.cap_s, metadata=self._metadata()).released
                except grpc.RpcError:
                    break
            self._releases.clear()
        return freed

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self.flush_releases()
            self._disconnect()

    def tracked(self) -> dict[str, int]:
        """seq id -> committed length the server is believed to hold (for tests and stats)."""
        with self._lock:
            return {k: len(v) for k, v in self._sent.items()}

    def pending_releases(self) -> list[str]:
        with self._lock:
            return list(self._releases)
