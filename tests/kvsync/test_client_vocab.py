"""The remote size guard: the engine tells its ``RemoteProposer`` the target's vocabulary
(``expected_vocab_size``), and a draft whose vocabulary or q width differs is refused — at connect
(Info) or when its probabilities arrive — as a ``DraftUnavailableError``: the step runs plain,
nothing crashes, every request finishes."""
from __future__ import annotations

import torch

from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.errors import VocabularyMismatchError
from cluster.common.request import FinishReason, GenerationRequest, SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.speculation import build_spec_controller
from cluster.kvsync.budget import DraftBudget
from cluster.kvsync.client import RemoteProposer, RemoteVocabularyMismatchError
from cluster.kvsync.server import DraftServerCore, start_server
from cluster.models.load import load_model
from cluster.speculative.ngram import NgramProposer
from cluster.speculative.types import DraftProposal, DraftUnavailableError
from tests.engine.helpers import run_to_completion


class NarrowQ(NgramProposer):
    """Drafts token 1 K times with a q only 4 tokens wide (a padded or foreign head)."""

    def propose(self, inputs):
        return DraftProposal([[1] * i.num_draft_tokens for i in inputs],
                             [torch.full((i.num_draft_tokens, 4), 0.25) for i in inputs])


def _run(model_dir, core):
    server, port = start_server(core)
    try:
        remote = RemoteProposer(f"127.0.0.1:{port}", budget=DraftBudget(floor_s=0.5))  # not late on a busy CPU
        config = EngineConfig(model=str(model_dir), spec=SpecConfig(drafter="ngram", num_draft_tokens=3),
                              kv_cache_memory_mb=16)
        model = load_model(str(model_dir), config)
        engine = LLMEngine(config, model, build_spec_controller(config, model, remote))
        assert remote.expected_vocab_size == model.runner.vocab_size  # set by the controller
        reqs = [GenerationRequest(f"r{i}", [10, 11, 12, 13] * 4,
                                  SamplingParams(max_tokens=12, temperature=0.8)) for i in range(3)]
        res = run_to_completion(engine, reqs)
        assert all(len(r["ids"]) == 12 and r["finish"] == FinishReason.LENGTH for r in res.values())
        assert engine.stats().draft_fallbacks >= 1
        assert sum(r["spec"].accepted_tokens for r in res.values()) == 0
        return remote
    finally:
        server.stop(0)


def test_q_width_other_than_the_target_vocabulary_makes_the_step_plain(tiny_llama_dir, caplog):
    remote = _run(tiny_llama_dir, DraftServerCore(NarrowQ(), vocab_size=0))  # says nothing at connect
    assert remote.num_failures >= 1
    assert "draft probabilities are 4 wide, target has 49152" in caplog.text


def test_draft_vocabulary_other_than_the_target_is_refused_at_connect(tiny_llama_dir, caplog):
    remote = _run(tiny_llama_dir, DraftServerCore(NgramProposer(), vocab_size=49153))
    assert remote.num_failures >= 1
    assert "draft server vocabulary has 49153 tokens, target has 49152" in caplog.text


def test_refusal_is_both_a_vocabulary_error_and_a_fallback():
    assert issubclass(RemoteVocabularyMismatchError, VocabularyMismatchError)
    assert issubclass(RemoteVocabularyMismatchError, DraftUnavailableError)
