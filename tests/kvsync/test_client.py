"""RemoteProposer against a real KVSync server on 127.0.0.1: incremental sync, resync after state
loss and after a restart (new epoch), DraftUnavailableError on failure, reconnect."""
import socket
import time

import pytest
import torch

from cluster.common.errors import VocabularyMismatchError
from cluster.common.request import SamplingParams
from cluster.kvsync.client import RemoteProposer
from cluster.kvsync.limits import KVSyncLimits
from cluster.kvsync.server import DraftServerCore, start_server
from cluster.speculative.ngram import NgramProposer
from cluster.speculative.types import DraftUnavailableError, ProposeInput

GREEDY = SamplingParams(max_tokens=8)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(port=0, vocab=100, max_sequences=64):
    core = DraftServerCore(NgramProposer(), vocab_size=vocab, drafter="ngram", max_sequences=max_sequences)
    server, port = start_server(core, port=port)
    return core, server, port


def inp(seq_id, tokens, k=3, params=GREEDY):
    return ProposeInput(seq_id=seq_id, token_ids=list(tokens), num_draft_tokens=k, params=params)


def test_propose_sends_only_new_tokens_and_matches_local_ngram():
    core, server, port = serve()
    try:
        remote = RemoteProposer(f"127.0.0.1:{port}", expected_vocab_size=100, release_idle_s=60)
        local = NgramProposer()
        history = [5, 6, 7, 8, 5, 6]
        for step in range(4):
            got = remote.propose([inp("a", history), inp("b", [1, 2, 1])])
            want = local.propose([inp("a", history), inp("b", [1, 2, 1])])
            assert got.draft_token_ids == want.draft_token_ids and got.draft_probs == [None, None]
            assert core.held("a") == history and remote.tracked()["a"] == len(history)
            history = history + [7 + step % 2]
        assert remote.num_resyncs == 0
        remote.release("a")  # queued, not an RPC of its own: the server still holds it
        assert core.held("a") == history[:-1] and "a" not in remote.tracked()
        assert remote.pending_releases() == ["a"]
        remote.propose([inp("b", [1, 2, 1, 2])])  # piggybacked on the next Propose
        assert core.held("a") is None and remote.pending_releases() == []
        remote.release("b")
        assert remote.flush_releases() == 1 and core.num_sequences == 0
    finally:
        server.stop(0)


def test_releases_no_propose_carries_are_sent_in_the_background():
    core, server, port = serve()
    try:
        remote = RemoteProposer(f"127.0.0.1:{port}", release_idle_s=0.1, limits=KVSyncLimits(max_batch=2))
        names = [f"s{i}" for i in range(7)]
        for i in range(0, 7, 2):
            remote.propose([inp(n, [1, 2, 1]) for n in names[i:i + 2]])
        assert core.num_sequences == 7
        for n in names:  # the engine goes idle: no propose follows; 7 ids, 2 per Release
            remote.release(n)
        deadline = time.monotonic() + 10
        while core.num_sequences and time.monotonic() < deadline:
            time.sleep(0.05)
        assert core.num_sequences == 0 and remote.pending_releases() == []
        remote.close()
    finally:
        server.stop(0)


def test_lost_sequence_resyncs_with_full_prefix():
    core, server, port = serve(max_sequences=1)
    try:
        remote = RemoteProposer(f"127.0.0.1:{port}")
        remote.propose([inp("a", [1, 2, 3, 1, 2])])
        remote.propose([inp("b", [4, 4])])  # evicts "a" on the server (LRU of 1)
        out = remote.propose([inp("a", [1, 2, 3, 1, 2, 3])])
        assert remote.num_resyncs == 1 and core.held("a") == [1, 2, 3, 1, 2, 3]
        assert out.draft_token_ids == [[1, 2, 3]]
    finally:
        server.stop(0)


def test_restart_down_then_new_epoch_resyncs():
    port = free_port()
    core, server, _ = serve(port=port)
    remote = RemoteProposer(f"127.0.0.1:{port}", timeout_s=1.0, retry_after_s=0.0)
    remote.propose([inp("a", [1, 2, 1])])
    server.stop(0)
    with pytest.raises(DraftUnavailableError):
        remote.propose([inp("a", [1, 2, 1, 2])])
    core2, server2, _ = serve(port=port)  # restarted draft: new epoch, empty state
    try:
        out = remote.propose([inp("a", [1, 2, 1, 2])])
        assert core2.epoch != core.epoch and remote.num_epoch_changes == 1
        assert core2.held("a") == [1, 2, 1, 2] and out.draft_token_ids == [[1, 2]]
        assert remote.num_resyncs == 1 and remote.last_resynced == {"a"}  # the lost prefix was resent
    finally:
        server2.stop(0)


def test_unreachable_waits_before_retrying_and_follows_new_address():
    dead = free_port()
    remote = RemoteProposer(f"127.0.0.1:{dead}", timeout_s=0.5, retry_after_s=60.0)
    with pytest.raises(DraftUnavailableError):
        remote.propose([inp("a", [1, 2])])
    with pytest.raises(DraftUnavailableError, match="retrying later"):
        remote.propose([inp("a", [1, 2])])  # no new connection attempt within retry_after_s
    core, server, port = serve()
    try:
        remote.set_address(f"127.0.0.1:{port}")  # the DraftServer replica moved
        assert remote.propose([inp("a", [1, 2, 1])]).draft_token_ids == [[2, 1]]
    finally:
        server.stop(0)


def test_vocab_mismatch_is_refused():
    core, server, port = serve(vocab=100)
    try:
        with pytest.raises(VocabularyMismatchError):
            RemoteProposer(f"127.0.0.1:{port}", expected_vocab_size=101).propose([inp("a", [1, 2])])
    finally:
        server.stop(0)


def test_sampling_probabilities_round_trip():
    class Uniform(NgramProposer):
        def propose(self, inputs):
            out = super().propose(inputs)
            out.draft_probs = [torch.full((len(t), 4), 0.25) if t else None for t in out.draft_token_ids]
            return out

    core = DraftServerCore(Uniform(), vocab_size=4)
    server, port = start_server(core)
    try:
        remote = RemoteProposer(f"127.0.0.1:{port}")
        out = remote.propose([inp("s", [1, 2, 1], k=2, params=SamplingParams(max_tokens=4, temperature=0.7))])
        assert out.draft_token_ids == [[2, 1]]
        assert out.draft_probs[0].shape == (2, 4) and torch.allclose(out.draft_probs[0], torch.full((2, 4), 0.25))
    finally:
        server.stop(0)


class Asked(NgramProposer):
    """An n-gram drafter recording, per sequence asked, (its id without the caller's namespace,
    ``fields`` of its ProposeInput...)."""

    def __init__(self, *fields):
        super().__init__()
        self.fields, self.asked = fields, []

    def propose(self, inputs):
        self.asked += [(i.seq_id.rsplit("/", 1)[-1], *(getattr(i, f) for f in self.fields)) for i in inputs]
        return super().propose(inputs)


def test_stop_confidence_travels_to_the_server_drafter():
    drafter = Asked("stop_confidence")
    core = DraftServerCore(drafter, vocab_size=100, drafter="ngram", max_sequences=8)
    server, port = start_server(core)
    try:
        remote = RemoteProposer(f"127.0.0.1:{port}", expected_vocab_size=100, release_idle_s=60)
        a = inp("a", [1, 2, 1])
        a.stop_confidence = 0.25
        remote.propose([a, inp("b", [3, 4, 3])])
        assert sorted(drafter.asked) == [("a", 0.25), ("b", 0.0)]
    finally:
        server.stop(0)


def test_draft_scope_travels_and_an_older_server_is_not_asked_to_draft_scoped_sequences(monkeypatch):
    """A server of KVSync 3 drafts a scoped sequence from that scope only; one older would draft it
    from every scope's traffic, so the client only syncs such sequences there (K = 0)."""
    import cluster.kvsync.server as server_mod

    for version, expect in ((server_mod.PROTOCOL_VERSION, [("a", "t1", 3), ("b", "", 3)]), (2, [("b", "", 3)])):
        monkeypatch.setattr(server_mod, "PROTOCOL_VERSION", version)  # what the server's Info says
        drafter = Asked("draft_scope", "num_draft_tokens")
        core = DraftServerCore(drafter, vocab_size=100, drafter="ngram", max_sequences=8)
        server, port = start_server(core)
        try:
            remote = RemoteProposer(f"127.0.0.1:{port}", expected_vocab_size=100, release_idle_s=60)
            a = inp("a", [1, 2, 1])
            a.draft_scope = "t1"
            got = remote.propose([a, inp("b", [3, 4, 3])])
            assert sorted(drafter.asked) == expect, version
            assert got.draft_token_ids[1] == [4, 3]  # the unscoped one drafts either way
            if version == 2:
                assert got.draft_token_ids[0] == [] and core.held("a") == [1, 2, 1]  # synced all the same
        finally:
            server.stop(0)

