"""``RemoteProposer``: the engine-side KVSync client, a ``Proposer`` whose drafter lives elsewhere.

Owns: per-sequence bookkeeping of what the DraftServer holds (the committed tokens sent so far),
sending only the tokens committed since the last call, resending full prefixes on RESYNC or on an
epoch change (restarted draft), decoding draft probabilities, and turning every transport failure
(connection refused, deadline) into ``DraftUnavailableError`` so the engine finishes those
sequences without speculation. After a failure it stays quiet for ``retry_after_s`` and then
reconnects (possibly to a new address set by ``set_address``: the DraftServer replica moved).
Ignores: verification, adaptive K, which drafter the server runs.
"""
from __future__ import annotations

import threading
import time

import grpc

from cluster.api import stubs
from cluster.errors import VocabularyMismatchError
from cluster.spec.proposer import DrafterKind
from cluster.spec.types import DraftProposal, DraftUnavailableError, ProposeInput  # noqa: F401 (re-exported)
from cluster.telemetry.grpc_interceptors import client_interceptors
from cluster.telemetry.tracing import tracing_enabled


class RemoteProposer:
    kind = DrafterKind.REMOTE

    def __init__(self, address: str | None = None, *, timeout_s: float = 2.0,
                 retry_after_s: float = 1.0, expected_vocab_size: int | None = None) -> None:
        if timeout_s <= 0 or retry_after_s < 0:
            raise ValueError("timeout_s must be > 0 and retry_after_s >= 0")
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.expected_vocab_size = expected_vocab_size
        self._address = address
        self._channel: grpc.Channel | None = None
        self._stub = None
        self._epoch = 0
        self._sent: dict[str, list[int]] = {}  # seq id -> committed tokens the server holds
        self._lost: set[str] = set()  # tracked when the server's epoch changed: resent in full next
        self._down_until = 0.0
        self._lock = threading.RLock()
        self.num_resyncs = 0  # sequences whose full prefix was resent
        self.num_epoch_changes = 0
        self.num_failures = 0
        self.last_resynced: set[str] = set()  # seq ids whose prefix the last propose() resent

    def __getstate__(self) -> dict:
        """Picklable before use (``ProcessEngine`` ships it to the engine core process): the
        connection, the lock and what the server holds are not carried."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("_channel", "_stub", "_lock")}
        state.update(_sent={}, _lost=set(), _epoch=0)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._channel = self._stub = None
        self._lock = threading.RLock()

    @property
    def resyncs(self) -> int:  # the name the engine's stats read
        return self.num_resyncs

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

    def _disconnect(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None

    def _fail(self, what: str, exc: BaseException | None = None) -> DraftUnavailableError:
        self.num_failures += 1
        self._disconnect()
        self._down_until = time.monotonic() + self.retry_after_s
        detail = f": {exc.code().name} {exc.details()}" if isinstance(exc, grpc.RpcError) else ""
        return DraftUnavailableError(f"draft server {self._address} {what}{detail}")

    def _connect(self) -> None:
        if self._stub is not None:
            return
        if not self._address:
            raise DraftUnavailableError("no draft server address")
        if time.monotonic() < self._down_until:
            raise DraftUnavailableError(f"draft server {self._address} down; retrying later")
        self._channel = grpc.insecure_channel(self._address, options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
        if tracing_enabled():  # CLIENT spans + traceparent in metadata; no wrapper when tracing is off
            self._channel = grpc.intercept_channel(self._channel, *client_interceptors())
        self._stub = stubs.kvsync_grpc().KVSyncStub(self._channel)
        try:
            info = self._stub.Info(stubs.kvsync_pb2().InfoRequest(), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise self._fail("unreachable", exc) from None
        if (self.expected_vocab_size is not None and info.vocab_size  # 0: a vocabulary-agnostic drafter
                and info.vocab_size != self.expected_vocab_size):
            self._disconnect()
            raise VocabularyMismatchError(
                f"draft server vocabulary has {info.vocab_size} tokens, target has "
                f"{self.expected_vocab_size}: speculation would never be accepted")
        self._set_epoch(info.epoch)

    def _set_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            if self._epoch != 0:
                self.num_epoch_changes += 1
            self._epoch = epoch
            self._lost |= self._sent.keys()  # their next propose resends the whole prefix: a resync
            self._sent.clear()  # a new server holds nothing we sent to the old one

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
        params = pb2.DraftSamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k)
        if p.seed is not None:
            params.seed = p.seed
        return pb2.ProposeSeq(seq_id=inp.seq_id, base_len=base, new_tokens=new,
                              num_draft_tokens=inp.num_draft_tokens, params=params)

    def _call(self, inputs: list[ProposeInput], full: bool):
        pb2 = stubs.kvsync_pb2()
        req = pb2.ProposeRequest(epoch=self._epoch, seqs=[self._seq_pb(i, full) for i in inputs])
        try:
            return self._stub.Propose(req, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise self._fail("failed", exc) from None

    def propose(self, inputs: list[ProposeInput]) -> DraftProposal:
        pb2 = stubs.kvsync_pb2()
        with self._lock:
            self.last_resynced = set()
            self._connect()
            resp = self._call(inputs, full=False)
            if resp.status == pb2.BATCH_STATUS_EPOCH_MISMATCH:  # the server restarted
                self._set_epoch(resp.epoch)  # marks the tracked sequences lost (counted below)
                resp = self._call(inputs, full=True)
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
                again = self._call(resync, full=True)
                if again.status != pb2.BATCH_STATUS_OK:
                    raise self._fail("changed epoch during resync")
                by_id.update({s.seq_id: s for s in again.seqs})
            tokens: list[list[int]] = []
            probs: list = []
            for inp in inputs:
                s = by_id[inp.seq_id]
                if s.status != pb2.SEQ_STATUS_OK:
                    self._sent.pop(inp.seq_id, None)
                    tokens.append([])
                    probs.append(None)
                    continue
                self._sent[inp.seq_id] = list(inp.token_ids)
                draft = list(s.draft_tokens)[: inp.num_draft_tokens]
                tokens.append(draft)
                probs.append(self._decode_probs(s.draft_probs, len(draft)))
            return DraftProposal(draft_token_ids=tokens, draft_probs=probs)

    @staticmethod
    def _decode_probs(raw: bytes, k: int):
        if not raw or k == 0:
            return None
        import torch

        q = torch.frombuffer(bytearray(raw), dtype=torch.float32)
        if q.numel() % k:
            raise DraftUnavailableError(f"draft probabilities of {q.numel()} floats do not split into {k} rows")
        return q.view(k, -1)  # [K_i, V]

    def release(self, seq_id: str) -> None:
        with self._lock:
            self._lost.discard(seq_id)
            if self._sent.pop(seq_id, None) is None or self._stub is None:
                return
            try:
                self._stub.Release(stubs.kvsync_pb2().ReleaseRequest(epoch=self._epoch, seq_ids=[seq_id]),
                                   timeout=self.timeout_s)
            except grpc.RpcError:
                pass  # a draft that is gone holds nothing; a restarted one gets a new epoch

    def close(self) -> None:
        with self._lock:
            self._disconnect()

    def tracked(self) -> dict[str, int]:
        """seq id -> committed length the server is believed to hold (for tests and stats)."""
        with self._lock:
            return {k: len(v) for k, v in self._sent.items()}
