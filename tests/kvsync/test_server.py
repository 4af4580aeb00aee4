"""KVSync server core: committed-prefix bookkeeping, RESYNC, epoch, LRU, probabilities — over a
real gRPC server on 127.0.0.1."""
import grpc
import pytest
import torch

from cluster.api import stubs
from cluster.kvsync.server import DraftServerCore, start_server
from cluster.speculative.proposer import DrafterKind
from cluster.speculative.types import DraftProposal

pb2 = stubs.kvsync_pb2()


class Recorder:
    """Drafts last_token+1, +2, ...; with sampling it returns a uniform q over a 10-token vocab."""

    kind = DrafterKind.DRAFT_MODEL

    def __init__(self):
        self.seen, self.released = [], []

    def propose(self, inputs):
        self.seen.append([(i.seq_id, list(i.token_ids), i.num_draft_tokens) for i in inputs])
        toks = [[(i.token_ids[-1] + j + 1) % 10 for j in range(i.num_draft_tokens)] for i in inputs]
        probs = [None if i.params.greedy else torch.full((i.num_draft_tokens, 10), 0.1) for i in inputs]
        return DraftProposal(toks, probs)

    def release(self, seq_id):
        self.released.append(seq_id)


@pytest.fixture()
def served():
    rec = Recorder()
    core = DraftServerCore(rec, vocab_size=10, drafter="recorder", max_sequences=2)
    server, port = start_server(core)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield core, rec, stubs.kvsync_grpc().KVSyncStub(channel)
    channel.close()
    server.stop(0)


# the drafter sees ids in the caller's namespace; a stub without kvsync-caller metadata is named by
# its peer host
NS = "ipv4:127.0.0.1/"


def seq(seq_id, base, new, k=3, temperature=0.0):
    return pb2.ProposeSeq(seq_id=seq_id, base_len=base, new_tokens=new, num_draft_tokens=k,
                          params=pb2.DraftSamplingParams(temperature=temperature, top_p=1.0))


def test_incremental_sync_rollback_and_resync(served):
    core, rec, stub = served
    epoch = stub.Info(pb2.InfoRequest(), timeout=5).epoch
    assert epoch == core.epoch and epoch != 0
    r = stub.Propose(pb2.ProposeRequest(epoch=epoch, seqs=[seq("a", 0, [1, 2, 3])]), timeout=5)
    assert r.status == pb2.BATCH_STATUS_OK and list(r.seqs[0].draft_tokens) == [4, 5, 6]
    assert r.seqs[0].committed_len == 3 and r.seqs[0].draft_probs == b""
    # engine accepted 1 draft token + bonus: committed [1,2,3,4,9]; it sends only [4, 9]
    r = stub.Propose(pb2.ProposeRequest(epoch=epoch, seqs=[seq("a", 3, [4, 9])]), timeout=5)
    assert r.seqs[0].committed_len == 5 and rec.seen[-1] == [(NS + "a", [1, 2, 3, 4, 9], 3)]
    # the engine believes in a shorter prefix (rollback): the server truncates, then appends
    r = stub.Propose(pb2.ProposeRequest(epoch=epoch, seqs=[seq("a", 4, [7])]), timeout=5)
    assert core.held("a") == [1, 2, 3, 4, 7]
    # a prefix the server never had -> RESYNC, state untouched; unknown sequence -> RESYNC
    r = stub.Propose(pb2.ProposeRequest(epoch=epoch, seqs=[seq("a", 9, [1]), seq("zz", 2, [1])]), timeout=5)
    assert [s.status for s in r.seqs] == [pb2.SEQ_STATUS_RESYNC] * 2
    assert core.held("a") == [1, 2, 3, 4, 7] and core.held("zz") is None


def test_epoch_mismatch_rejects_whole_batch(served):
    core, _, stub = served
    r = stub.Propose(pb2.ProposeRequest(epoch=core.epoch + 1, seqs=[seq("a", 0, [1])]), timeout=5)
    assert r.status == pb2.BATCH_STATUS_EPOCH_MISMATCH and r.epoch == core.epoch and not r.seqs
    assert core.held("a") is None


def test_release_and_lru_eviction(served):
    core, rec, stub = served
    e = core.epoch
    for name in ("a", "b", "c"):  # max_sequences=2: "a" is evicted when "c" arrives
        stub.Propose(pb2.ProposeRequest(epoch=e, seqs=[seq(name, 0, [1, 2])]), timeout=5)
    assert core.held("a") is None and rec.released == [NS + "a"] and core.num_sequences == 2
    assert stub.Release(pb2.ReleaseRequest(epoch=e, seq_ids=["b", "nope"]), timeout=5).released == 1
    assert core.held("b") is None and NS + "b" in rec.released


def test_sampling_returns_probabilities(served):
    core, _, stub = served
    r = stub.Propose(pb2.ProposeRequest(epoch=core.epoch, seqs=[seq("s", 0, [5], k=2, temperature=0.8)]),
                     timeout=5)
    q = torch.frombuffer(bytearray(r.seqs[0].draft_probs), dtype=torch.float32).view(2, 10)
    assert torch.allclose(q, torch.full((2, 10), 0.1))


def test_k_zero_only_syncs(served):
    core, rec, stub = served
    r = stub.Propose(pb2.ProposeRequest(epoch=core.epoch, seqs=[seq("a", 0, [1, 2], k=0)]), timeout=5)
    assert list(r.seqs[0].draft_tokens) == [] and core.held("a") == [1, 2] and rec.seen == []
