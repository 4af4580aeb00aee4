"""KVSync closed to strangers, over real gRPC on 127.0.0.1: the bearer token (constant-time check,
UNAUTHENTICATED otherwise), TLS with a self-signed certificate made here, the limits (K, batch,
tokens per sequence, vocabulary, message size) refused whole with INVALID_ARGUMENT before any
state changes, per-caller namespaces and LRU, and the draft seed derived from the request's."""
import re

import grpc
import pytest
import torch

from cluster.api import stubs
from cluster.common.request import SamplingParams
from cluster.kvsync.client import RemoteProposer
from cluster.kvsync.limits import KVSyncLimits
from cluster.kvsync.server import CALLER_METADATA, DraftServerCore, draft_seed, start_server
from cluster.kvsync.tls import KVSyncTLS
from cluster.speculative.ngram import NgramProposer
from cluster.speculative.types import DraftUnavailableError, DraftProposal, ProposeInput
from tests.kvsync.certs import self_signed

pb2 = stubs.kvsync_pb2()
TOKEN = "kvsync-secret-42"
GREEDY = SamplingParams(max_tokens=8)


def inp(seq_id, tokens, k=3, params=GREEDY):
    return ProposeInput(seq_id=seq_id, token_ids=list(tokens), num_draft_tokens=k, params=params)


@pytest.fixture()
def server():
    started = []

    def start(core=None, **kw):
        core = core or DraftServerCore(NgramProposer(), vocab_size=100, drafter="ngram",
                                       limits=KVSyncLimits(max_draft_tokens=4, max_batch=2, max_seq_tokens=32,
                                                           max_sequences=2, max_callers=2))
        srv, port = start_server(core, **kw)
        started.append(srv)
        return core, port
    yield start
    for srv in started:
        srv.stop(0)


def raw_stub(port):
    return stubs.kvsync_grpc().KVSyncStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def seq(seq_id, tokens, k=2):
    return pb2.ProposeSeq(seq_id=seq_id, base_len=0, new_tokens=tokens, num_draft_tokens=k,
                          params=pb2.DraftSamplingParams(temperature=0.0, top_p=1.0))


def test_calls_without_the_token_are_refused(server):
    core, port = server(token=TOKEN)
    stub = raw_stub(port)
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
        for call, req in ((stub.Info, pb2.InfoRequest()),
                          (stub.Propose, pb2.ProposeRequest(epoch=core.epoch, seqs=[seq("a", [1, 2, 1])])),
                          (stub.Release, pb2.ReleaseRequest(epoch=core.epoch, seq_ids=["a"]))):
            with pytest.raises(grpc.RpcError) as err:
                call(req, timeout=5, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert core.num_sequences == 0  # no handler ran
    with pytest.raises(DraftUnavailableError, match="UNAUTHENTICATED"):
        RemoteProposer(f"127.0.0.1:{port}").propose([inp("a", [1, 2, 1])])
    remote = RemoteProposer(f"127.0.0.1:{port}", token=TOKEN)
    assert remote.propose([inp("a", [1, 2, 1])]).draft_token_ids == [[2, 1]]
    assert core.held("a", caller=remote.caller) == [1, 2, 1]


def test_tls_with_a_self_signed_certificate(server, tmp_path):
    cert, key = self_signed(tmp_path)
    core, port = server(token=TOKEN, tls=KVSyncTLS(cert_file=cert, key_file=key))
    tls = KVSyncTLS(cert_file=cert, key_file=key, server_name="draft.specserve.test")
    remote = RemoteProposer(f"127.0.0.1:{port}", token=TOKEN, tls=tls, timeout_s=5)
    assert remote.propose([inp("a", [1, 2, 1])]).draft_token_ids == [[2, 1]]
    # plaintext to a TLS server, or TLS expecting another name: no connection
    with pytest.raises(DraftUnavailableError):
        RemoteProposer(f"127.0.0.1:{port}", token=TOKEN, timeout_s=2).propose([inp("b", [1, 2, 1])])
    wrong = KVSyncTLS(cert_file=cert, key_file=key, server_name="someone.else")
    with pytest.raises(DraftUnavailableError):
        RemoteProposer(f"127.0.0.1:{port}", token=TOKEN, tls=wrong, timeout_s=2).propose([inp("b", [1, 2, 1])])
    assert core.held("b") is None
    with pytest.raises(ValueError, match="both cert_file and key_file"):
        KVSyncTLS(cert_file=cert)


def test_mutual_tls_admits_only_a_trusted_client_certificate(server, tmp_path):
    cert, key = self_signed(tmp_path)
    (tmp_path / "other").mkdir()
    other_cert, other_key = self_signed(tmp_path / "other")  # same name, another key: not trusted
    mutual = KVSyncTLS(cert_file=cert, key_file=key, server_name="draft.specserve.test", mutual=True)
    core, port = server(token=TOKEN, tls=mutual)
    remote = RemoteProposer(f"127.0.0.1:{port}", token=TOKEN, tls=mutual, timeout_s=5)
    assert remote.propose([inp("a", [1, 2, 1])]).draft_token_ids == [[2, 1]]
    one_way = KVSyncTLS(cert_file=cert, key_file=key, server_name="draft.specserve.test")
    stranger = KVSyncTLS(cert_file=cert, key_file=key, server_name="draft.specserve.test", mutual=True,
                         client_cert_file=other_cert, client_key_file=other_key)
    for tls in (one_way, stranger):  # no client certificate / an untrusted one: no connection
        with pytest.raises(DraftUnavailableError):
            RemoteProposer(f"127.0.0.1:{port}", token=TOKEN, tls=tls, timeout_s=2).propose([inp("b", [1, 2, 1])])
    assert core.held("b") is None
    with pytest.raises(ValueError, match="mutual TLS needs cert_file and key_file"):
        KVSyncTLS(mutual=True)
    with pytest.raises(ValueError, match="mutual is off"):
        KVSyncTLS(cert_file=cert, key_file=key, client_ca_file=cert)
    with pytest.raises(ValueError, match="both client_cert_file and client_key_file"):
        KVSyncTLS(cert_file=cert, key_file=key, mutual=True, client_cert_file=other_cert)


@pytest.mark.parametrize("seqs,match", [
    ([seq("a", [1, 2], k=5)], "num_draft_tokens 5 .* limit of 4"),
    ([seq("a", [1]), seq("b", [1]), seq("c", [1])], "at most 2 sequences"),
    ([seq("a", list(range(33)))], "would hold 33 tokens; the limit is 32"),
    ([seq("a", [1, 100])], r"outside \[0, 100\)"),
    ([seq("a", [1]), seq("a", [2])], "appears twice"),
    ([seq("x" * 200, [1])], "seq_id must be"),
])
def test_requests_past_the_limits_are_refused_whole(server, seqs, match):
    core, port = server()
    stub = raw_stub(port)
    stub.Propose(pb2.ProposeRequest(epoch=core.epoch, seqs=[seq("kept", [7, 8])]), timeout=5)
    with pytest.raises(grpc.RpcError) as err:
        stub.Propose(pb2.ProposeRequest(epoch=core.epoch, seqs=seqs), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(match, err.value.details()), err.value.details()
    assert core.held("kept") == [7, 8] and core.num_sequences == 1  # nothing changed


def test_message_size_is_bounded_by_the_limits(server):
    core, port = server()
    assert core.limits.request_bytes < (4 << 20) and core.limits.response_bytes < (4 << 20)
    huge = pb2.ProposeRequest(epoch=core.epoch, release_seq_ids=["r" * 100] * (core.limits.request_bytes // 100))
    with pytest.raises(grpc.RpcError) as err:
        raw_stub(port).Propose(huge, timeout=5)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_default_limits_derive_a_small_message_size_from_k_and_batch():
    from deployments.app_config import AppConfig

    lim = AppConfig(placement="separate", drafter="default").kvsync_limits(vocab_size=49152)
    assert lim.max_draft_tokens == 6 and lim.max_batch == 8 and lim.max_seq_tokens == 4096 + 1024
    assert lim.response_bytes < (12 << 20) and lim.request_bytes < (1 << 20)
    with pytest.raises(ValueError, match="max_draft_tokens"):
        KVSyncLimits(max_draft_tokens=17)


def test_callers_have_their_own_bounded_namespaces(server):
    core, port = server()
    a, b = RemoteProposer(f"127.0.0.1:{port}"), RemoteProposer(f"127.0.0.1:{port}")
    a.propose([inp("s", [1, 2, 1])])
    b.propose([inp("s", [5, 6, 5])])  # same id, another caller: no collision
    assert core.held("s", a.caller) == [1, 2, 1] and core.held("s", b.caller) == [5, 6, 5]
    for name in ("t", "u", "v"):  # a floods: max_sequences=2 per caller evicts only a's own
        a.propose([inp(name, [1, 2])])
    assert core.held("s", a.caller) is None and core.held("s", b.caller) == [5, 6, 5]
    c = RemoteProposer(f"127.0.0.1:{port}")
    c.propose([inp("s", [9, 9])])  # max_callers=2: the least recently seen caller (b) is forgotten
    assert core.held("s", b.caller) is None and core.num_sequences == 2 + 1
    with pytest.raises(grpc.RpcError) as err:  # a caller name past the id limit is refused
        raw_stub(port).Propose(pb2.ProposeRequest(epoch=core.epoch, seqs=[seq("a", [1])]), timeout=5,
                               metadata=((CALLER_METADATA, "c" * 500),))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


class SeedProbe:
    """Records the initial seed of the generator each sampled draft gets."""

    kind = NgramProposer.kind

    def __init__(self):
        self.seeds = []

    def propose(self, inputs):
        self.seeds += [i.generator.initial_seed() for i in inputs]
        return DraftProposal([[1] * i.num_draft_tokens for i in inputs],
                             [torch.full((i.num_draft_tokens, 4), 0.25) for i in inputs])

    def release(self, seq_id):
        pass


def test_draft_seed_is_not_the_requests_seed(server):
    assert draft_seed(1234) == draft_seed(1234) and draft_seed(1234) != draft_seed(1235)
    assert all(draft_seed(s) != s and 0 <= draft_seed(s) < 1 << 63 for s in (0, 1, 1234, 2**63 - 1))
    probe = SeedProbe()
    core, port = server(DraftServerCore(probe, vocab_size=4))
    remote = RemoteProposer(f"127.0.0.1:{port}", expected_vocab_size=4)
    seeded = SamplingParams(max_tokens=8, temperature=0.8, seed=1234)
    remote.propose([inp("a", [1, 2], k=2, params=seeded)])
    assert probe.seeds == [draft_seed(1234)]
    # the engine's acceptance stream is seeded with the request's seed: the draft's differs
    engine_gen, draft_gen = torch.Generator().manual_seed(1234), torch.Generator().manual_seed(probe.seeds[0])
    assert not torch.equal(torch.rand(8, generator=engine_gen), torch.rand(8, generator=draft_gen))
