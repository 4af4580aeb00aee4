"""KVSync server core: committed-prefix bookkeeping, RESYNC, epoch, LRU, probabilities — over a
real gRPC server on 127.0.0.1."""
import grpc
import pytest
import torch

from cluster.api import stubs
from cluster.kvsync.server import PROTOCOL_VERSION, DraftServerCore, start_server
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


def test_stop_confidence_reaches_the_drafter_and_a_bad_one_is_refused(served):
    core, rec, stub = served
    asked = []
    inner = rec.propose
    rec.propose = lambda inputs: asked.extend(i.stop_confidence for i in inputs) or inner(inputs)
    both = [seq("a", 0, [1, 2]), seq("b", 0, [3, 4])]
    both[0].stop_confidence = 0.25
    stub.Propose(pb2.ProposeRequest(epoch=core.epoch, seqs=both), timeout=5)
    assert asked == [0.25, 0.0]  # 0 (unset, an older client): draft K
    for bad in (1.0, -0.1, float("nan")):
        s = seq("c", 0, [1])
        s.stop_confidence = bad
        with pytest.raises(grpc.RpcError) as err:
            stub.Propose(pb2.ProposeRequest(epoch=core.epoch, seqs=[s]), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop_confidence" in err.value.details()
    assert core.held("c") is None  # refused before anything was held


def test_min_p_reaches_the_drafter_and_a_bad_one_is_refused(served):
    core, rec, stub = served
    asked = []
    inner = rec.propose
    rec.propose = lambda inputs: asked.extend(i.params.min_p for i in inputs) or inner(inputs)
    both = [seq("a", 0, [1, 2], temperature=0.8), seq("b", 0, [3, 4], temperature=0.8)]
    both[0].params.min_p = 0.25
    stub.Propose(pb2.ProposeRequest(epoch=core.epoch, seqs=both), timeout=5)
    assert asked == [0.25, 0.0]  # 0 (unset, an older client): no cut
    for bad in (1.5, -0.1, float("nan")):
        s = seq("c", 0, [1], temperature=0.8)
        s.params.min_p = bad
        with pytest.raises(grpc.RpcError) as err:
            stub.Propose(pb2.ProposeRequest(epoch=core.epoch, seqs=[s]), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_p" in err.value.details()
    assert core.held("c") is None  # refused before anything was held


class FeatureReader(Recorder):
    """Reads 2 target layers of a hidden size of 2 (4 values per position), like an EAGLE head;
    keeps the rows it was handed by position."""

    feature_layers = (0, 1)
    feature_width = 4
    target_fingerprint = "target-a"

    def __init__(self):
        super().__init__()
        self.rows: dict[str, dict[int, list[float]]] = {}

    def record(self, chunks, features):  # features [T, 4]
        row = 0
        for c in chunks:
            for i in range(len(c.token_ids)):
                self.rows.setdefault(c.seq_id, {})[c.start_pos + i] = features[row].tolist()
                row += 1

    def release(self, seq_id):
        super().release(seq_id)
        self.rows.pop(seq_id, None)


@pytest.fixture()
def feature_served():
    reader = FeatureReader()
    core = DraftServerCore(reader, vocab_size=10, drafter="eagle:test")
    server, port = start_server(core)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield core, reader, stubs.kvsync_grpc().KVSyncStub(channel)
    channel.close()
    server.stop(0)


def feats(start, n, dtype="float32"):
    """Rows whose values name their position: position p is [p, p + 0.5, -p, 1]."""
    from cluster.kvsync.features import encode_features

    rows = torch.tensor([[p, p + 0.5, -p, 1.0] for p in range(start, start + n)])
    return encode_features(rows, start, dtype)


def v2(epoch, *seqs, releases=()):
    return pb2.ProposeRequest(epoch=epoch, seqs=list(seqs), release_seq_ids=list(releases), protocol_version=2)


def test_feature_reader_announces_its_layers_and_refuses_version_1_callers(feature_served):
    core, reader, stub = feature_served
    info = stub.Info(pb2.InfoRequest(protocol_version=2), timeout=5)
    assert (info.protocol_version, list(info.feature_layers), info.feature_width, info.feature_target) == \
        (PROTOCOL_VERSION, [0, 1], 4, "target-a")
    assert core.limits.feature_width == 4
    with pytest.raises(grpc.RpcError) as err:  # a version-1 client: no protocol_version, no features
        stub.Propose(pb2.ProposeRequest(epoch=core.epoch, seqs=[seq("a", 0, [1, 2, 3])]), timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "reads the target's features" in err.value.details() and "version 1" in err.value.details()
    assert core.held("a") is None and reader.seen == []


def test_features_follow_the_committed_tokens_through_rollback_and_resync(feature_served):
    core, reader, stub = feature_served
    e, key = core.epoch, NS + "a"
    r = stub.Propose(v2(e, pb2.ProposeSeq(seq_id="a", base_len=0, new_tokens=[1, 2, 3], num_draft_tokens=3,
                                          params=pb2.DraftSamplingParams(), features=feats(0, 2))), timeout=5)
    assert r.seqs[0].status == pb2.SEQ_STATUS_OK and list(r.seqs[0].draft_tokens) == [4, 5, 6]
    assert sorted(reader.rows[key]) == [0, 1] and reader.rows[key][1] == [1, 1.5, -1, 1]
    # accepted 1 + bonus: tokens [4, 9] and the features of positions 2, 3 (bfloat16 on the wire)
    stub.Propose(v2(e, pb2.ProposeSeq(seq_id="a", base_len=3, new_tokens=[4, 9], num_draft_tokens=3,
                                      features=feats(2, 2, "bfloat16"))), timeout=5)
    assert sorted(reader.rows[key]) == [0, 1, 2, 3] and reader.rows[key][3] == [3, 3.5, -3, 1]
    assert core._features[key] == 4
    # a rollback to 4 tokens keeps the rows of positions < 4; the next sends from position 3 on
    stub.Propose(v2(e, pb2.ProposeSeq(seq_id="a", base_len=4, new_tokens=[7, 8], num_draft_tokens=3,
                                      features=feats(3, 2))), timeout=5)
    assert core.held("a") == [1, 2, 3, 4, 7, 8] and core._features[key] == 5
    # a gap (rows from position 6 while [0, 5) are held) or drafts without the rows they need:
    # refused whole, nothing changes
    for bad in (pb2.ProposeSeq(seq_id="a", base_len=6, new_tokens=[1, 2], num_draft_tokens=3, features=feats(6, 1)),
                pb2.ProposeSeq(seq_id="a", base_len=6, new_tokens=[1, 2], num_draft_tokens=3)):
        with pytest.raises(grpc.RpcError) as err:
            stub.Propose(v2(e, bad), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert core.held("a") == [1, 2, 3, 4, 7, 8] and core._features[key] == 5
    assert "needs [0, 7)" in err.value.details()
    # K = 0 syncs tokens without the rows; a resync (base_len 0) resends every row from position 0
    stub.Propose(v2(e, pb2.ProposeSeq(seq_id="a", base_len=6, new_tokens=[1], num_draft_tokens=0)), timeout=5)
    assert core._features[key] == 5
    r = stub.Propose(v2(e, pb2.ProposeSeq(seq_id="a", base_len=0, new_tokens=[5, 5, 5], num_draft_tokens=2,
                                          features=feats(0, 2))), timeout=5)
    assert r.seqs[0].status == pb2.SEQ_STATUS_OK and core._features[key] == 2
    # malformed rows: another width, a byte count that does not match
    wide = feats(0, 2)
    wide.width = 8
    short = feats(0, 2)
    short.data = short.data[:-1]
    for f in (wide, short):
        with pytest.raises(grpc.RpcError) as err:
            stub.Propose(v2(e, pb2.ProposeSeq(seq_id="b", base_len=0, new_tokens=[1, 2, 3], features=f)), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # a release frees the rows on both levels
    stub.Propose(v2(e, releases=["a"]), timeout=5)
    assert core._features == {} and reader.rows == {} and core.num_sequences == 0


def test_a_drafter_without_features_refuses_feature_rows(served):
    core, _, stub = served
    assert stub.Info(pb2.InfoRequest(), timeout=5).feature_width == 0
    with pytest.raises(grpc.RpcError) as err:
        stub.Propose(v2(core.epoch, pb2.ProposeSeq(seq_id="a", base_len=0, new_tokens=[1, 2, 3],
                                                   features=feats(0, 2))), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "reads none" in err.value.details()


def test_draft_scope_reaches_the_drafter_and_a_control_character_is_refused(served):
    core, rec, stub = served
    asked = []
    inner = rec.propose
    rec.propose = lambda inputs: asked.extend((i.segment, i.draft_scope) for i in inputs) or inner(inputs)
    both = [seq("a", 0, [1, 2]), seq("b", 0, [3, 4])]
    both[0].segment, both[0].draft_scope = "chat", "tenant-7"
    stub.Propose(pb2.ProposeRequest(epoch=core.epoch, seqs=both), timeout=5)
    assert asked == [("chat", "tenant-7"), ("", "")]  # "" (unset, an older client): the shared scope
    for field, bad in (("draft_scope", "t\x1f1"), ("segment", "chat\x1f"), ("draft_scope", "x" * 300)):
        s = seq("c", 0, [1])
        setattr(s, field, bad)
        with pytest.raises(grpc.RpcError) as err:
            stub.Propose(pb2.ProposeRequest(epoch=core.epoch, seqs=[s]), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    assert core.held("c") is None  # refused before anything was held
