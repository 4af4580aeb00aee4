"""KVSync server core: a remote drafter's per-sequence committed state around any ``Proposer``.

Owns: answering the KVSync RPCs (protos/specserve/v1/kvsync.proto) — epoch checks, per-sequence
committed prefixes (truncate to ``base_len`` = roll back the draft's unverified tokens, append the
newly committed ones, answer RESYNC when the expected prefix is not held), one batched ``propose``
call into the wrapped drafter per RPC, LRU eviction past ``max_sequences`` — and starting a
``grpc.Server`` for it. The wrapped proposer keeps its own KV state and is told the full committed
token list each call (its contract), so it rolls back exactly what the server's state implies.
Ignores: Ray (the DraftServer deployment wraps this), which drafter runs (draft model, layer skip,
n-gram) and how it is built.
"""
from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from concurrent import futures

import grpc

from cluster.api import stubs
from cluster.engine.request import SamplingParams
from cluster.spec.proposer import Proposer
from cluster.spec.types import ProposeInput
from cluster.telemetry.grpc_interceptors import TracingServerInterceptor
from cluster.telemetry.tracing import add_event


class DraftServerCore:
    def __init__(self, proposer: Proposer, vocab_size: int, drafter: str = "",
                 vocab_hash: str = "", max_sequences: int = 4096) -> None:
        if vocab_size < 0 or max_sequences < 1:  # vocab_size 0: vocabulary-agnostic (n-gram)
            raise ValueError("vocab_size must be >= 0 and max_sequences >= 1")
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.drafter = drafter
        self.vocab_hash = vocab_hash
        self.max_sequences = max_sequences
        self.epoch = secrets.randbits(63) or 1  # new on every start: restarts are detectable
        self._seqs: OrderedDict[str, list[int]] = OrderedDict()  # seq id -> committed tokens
        self._generators: dict[str, object] = {}
        self._lock = threading.Lock()  # the wrapped proposer is not assumed thread-safe
        self.num_resyncs_requested = 0

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def held(self, seq_id: str) -> list[int] | None:
        with self._lock:
            held = self._seqs.get(seq_id)
            return None if held is None else list(held)

    def _forget(self, seq_id: str) -> None:
        if self._seqs.pop(seq_id, None) is not None:
            self._generators.pop(seq_id, None)
            self.proposer.release(seq_id)

    def _generator(self, seq_id: str, params: SamplingParams):
        if params.greedy:
            return None
        gen = self._generators.get(seq_id)
        if gen is None:
            import torch

            gen = torch.Generator()
            gen.manual_seed(params.seed if params.seed is not None else secrets.randbits(62))
            self._generators[seq_id] = gen
        return gen

    def propose(self, request):
        pb2 = stubs.kvsync_pb2()
        if request.epoch != self.epoch:
            return pb2.ProposeResponse(epoch=self.epoch, status=pb2.BATCH_STATUS_EPOCH_MISMATCH)
        with self._lock:
            results = [pb2.SeqProposal(seq_id=s.seq_id) for s in request.seqs]
            inputs: list[ProposeInput] = []
            rows: list[int] = []
            for i, s in enumerate(request.seqs):
                held = self._seqs.get(s.seq_id)
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
                self._seqs[s.seq_id] = held
                self._seqs.move_to_end(s.seq_id)
                results[i].committed_len = len(held)
                if s.num_draft_tokens > 0:
                    p = s.params
                    params = SamplingParams(max_tokens=1, temperature=max(0.0, p.temperature),
                                            top_p=p.top_p if 0.0 < p.top_p <= 1.0 else 1.0,
                                            top_k=p.top_k, seed=p.seed if p.HasField("seed") else None)
                    inputs.append(ProposeInput(seq_id=s.seq_id, token_ids=list(held),
                                               num_draft_tokens=int(s.num_draft_tokens), params=params,
                                               generator=self._generator(s.seq_id, params)))
                    rows.append(i)
            if inputs:
                proposal = self.proposer.propose(inputs)
                for row, inp, toks, probs in zip(rows, inputs, proposal.draft_token_ids,
                                                 proposal.draft_probs):
                    toks = list(toks)[: inp.num_draft_tokens]
                    results[row].draft_tokens.extend(int(t) for t in toks)
                    if probs is not None and not inp.params.greedy and toks:
                        q = probs[: len(toks)].float().contiguous()  # [K_i, V]
                        results[row].draft_probs = q.numpy().tobytes()
            while len(self._seqs) > self.max_sequences:  # LRU: the evicted ones will RESYNC
                self._forget(next(iter(self._seqs)))
            return pb2.ProposeResponse(epoch=self.epoch, status=pb2.BATCH_STATUS_OK, seqs=results)

    def release(self, request):
        pb2 = stubs.kvsync_pb2()
        with self._lock:
            n = 0
            for seq_id in request.seq_ids:
                if seq_id in self._seqs:
                    n += 1
                self._forget(seq_id)
            return pb2.ReleaseResponse(released=n)

    def info(self):
        return stubs.kvsync_pb2().InfoResponse(epoch=self.epoch, vocab_size=self.vocab_size,
                                               drafter=self.drafter, vocab_hash=self.vocab_hash,
                                               num_sequences=len(self._seqs))


def _servicer(core: DraftServerCore):
    base = stubs.kvsync_grpc().KVSyncServicer

    class KVSyncServicer(base):
        def Propose(self, request, context):  # noqa: N802 (gRPC naming)
            return core.propose(request)

        def Release(self, request, context):  # noqa: N802
            return core.release(request)

        def Info(self, request, context):  # noqa: N802
            return core.info()

    return KVSyncServicer()


def start_server(core: DraftServerCore, host: str = "127.0.0.1", port: int = 0,
                 max_workers: int = 4) -> tuple[grpc.Server, int]:
    """Start a KVSync gRPC server; returns (server, bound port). Stop with ``server.stop(grace)``."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         interceptors=[TracingServerInterceptor()],  # no-op while tracing is off
                         options=[("grpc.max_send_message_length", 64 << 20),
                                  ("grpc.max_receive_message_length", 64 << 20)])
    stubs.kvsync_grpc().add_KVSyncServicer_to_server(_servicer(core), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind KVSync server to {host}:{port}")
    server.start()
    return server, bound
