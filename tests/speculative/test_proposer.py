"""The Proposer protocol and its optional capabilities: each drafter offers exactly the ones the
engine may ask it for, and the engine reads them only through those protocols."""
from __future__ import annotations

from cluster.engine.process_engine import DraftStandIn
from cluster.engine.drafters import draft_cost_ratio
from cluster.kvsync.client import RemoteProposer
from cluster.speculative.ngram import NgramProposer
from cluster.speculative.proposer import (
    ContextualProposer, DrafterKind, DraftStatus, LocalModelProposer, Proposer, RemoteDraft,
)


def test_ngram_labels_its_drafts_and_is_neither_remote_nor_a_model():
    ngram = NgramProposer()
    assert isinstance(ngram, Proposer) and isinstance(ngram, ContextualProposer)
    assert not isinstance(ngram, (RemoteDraft, DraftStatus, LocalModelProposer))
    assert draft_cost_ratio(ngram, None) == 0.0


def test_a_remote_proposer_offers_the_remote_hooks_and_its_status():
    remote = RemoteProposer(None, expected_vocab_size=None)
    assert isinstance(remote, Proposer) and remote.kind is DrafterKind.REMOTE
    assert isinstance(remote, RemoteDraft) and isinstance(remote, DraftStatus)
    assert not isinstance(remote, (ContextualProposer, LocalModelProposer))
    assert draft_cost_ratio(remote, None) is None  # cannot be sized before it is timed


def test_the_process_engines_stand_in_shows_the_status_but_drafts_nothing():
    stand_in = DraftStandIn(engine=None, address="127.0.0.1:1")
    assert isinstance(stand_in, DraftStatus)
    assert not isinstance(stand_in, (Proposer, RemoteDraft))


def test_a_drafter_without_the_optional_methods_is_only_a_proposer():
    class Plain:
        kind = DrafterKind.DRAFT_MODEL

        def propose(self, inputs):
            raise AssertionError("not called")

        def release(self, seq_id):
            pass

    plain = Plain()
    assert isinstance(plain, Proposer)
    assert not isinstance(plain, (ContextualProposer, RemoteDraft, DraftStatus, LocalModelProposer))
    assert draft_cost_ratio(plain, None) is None  # a draft model without a runner: no prior
