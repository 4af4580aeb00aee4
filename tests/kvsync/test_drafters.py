"""Model drafters in a DraftServer (placement ``separate``): a draft model and layer skip (the
target's first L layers with their own KV), served by a real KVSync gRPC server on 127.0.0.1 and
driven by the engine through ``RemoteProposer`` on the real default model. Greedy output equals
plain decoding of the same engine, acceptance is measured, and the draft side frees its KV."""
from __future__ import annotations

import time

import pytest

from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.request import GenerationRequest, SamplingParams, SpecMode
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.speculation import build_spec_controller
from cluster.kvsync.budget import DraftBudget
from cluster.kvsync.client import RemoteProposer
from cluster.kvsync.drafters import build_remote_proposer, first_layers
from cluster.kvsync.server import DraftServerCore, start_server
from cluster.models.load import LoadedModel
from cluster.models.runner import ModelRunner
from cluster.speculative.proposer import DrafterKind, parse_drafter_choice
from tests.engine.helpers import prompt_ids, run_to_completion
from tests.reference import workload_rows

MAX_TOKENS = 20
K = 4


def _engine(model: LoadedModel, drafter: str, proposer) -> LLMEngine:
    """An engine on the shared default weights with its own target KV pool."""
    config = EngineConfig(spec=SpecConfig(drafter=drafter, num_draft_tokens=K), kv_cache_memory_mb=128)
    runner = ModelRunner(model.runner.model, None, config.block_size, config.kv_cache_memory_mb)
    m = LoadedModel(model.name, model.path, runner, model.tokenizer, model.eos_token_ids,
                    model.hf_config, model.dtype)
    return LLMEngine(config, m, build_spec_controller(config, m, proposer))


@pytest.fixture(scope="module")
def rows():
    return [r for r in workload_rows(per_segment=2) if r["segment"] in ("code", "chat")]


@pytest.mark.parametrize("drafter,min_alpha", [("default", 0.9), ("self:16", 0.05)])
def test_remote_model_drafter_is_lossless_and_frees_draft_kv(default_model, rows, drafter, min_alpha):
    spec = parse_drafter_choice(drafter)
    draft, vocab = build_remote_proposer(spec, "default", "float32", kv_cache_memory_mb=64,
                                         target=default_model)
    assert vocab == default_model.runner.vocab_size
    core = DraftServerCore(draft, vocab_size=vocab, drafter=drafter)
    server, port = start_server(core, host="127.0.0.1")
    # the draft is as big as the target here (K draft rounds cost K target steps): a budget that
    # waits for it, so this test measures drafting, not the deadline (tests/kvsync/test_budget.py)
    remote = RemoteProposer(f"127.0.0.1:{port}", timeout_s=30.0, expected_vocab_size=vocab,
                            budget=DraftBudget(factor=100.0, cap_s=30.0))
    try:
        eng = _engine(default_model, drafter, remote)
        tok = default_model.tokenizer
        reqs = [GenerationRequest(r["id"], prompt_ids(tok, r), SamplingParams(max_tokens=MAX_TOKENS),
                                  segment=r["segment"]) for r in rows]
        plain = run_to_completion(eng, [GenerationRequest(r.request_id + "-plain", r.prompt_token_ids,
                                                          r.params, mode=SpecMode.PLAIN) for r in reqs])
        res = run_to_completion(eng, reqs)
        for r in reqs:
            assert res[r.request_id]["ids"] == plain[r.request_id + "-plain"]["ids"], r.request_id
        drafted = sum(res[r.request_id]["spec"].draft_tokens for r in reqs)
        accepted = sum(res[r.request_id]["spec"].accepted_tokens for r in reqs)
        assert drafted > 0 and accepted > 0
        print(f"{drafter}: α = {accepted}/{drafted} = {accepted / drafted:.3f}")
        assert accepted / drafted >= min_alpha, f"{drafter}: α = {accepted}/{drafted}"
        assert eng.stats().draft_fallbacks == 0 and remote.num_failures == 0
        # finished sequences were released on both sides: target pool, KVSync state, draft pool
        assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks
        assert remote.tracked() == {}
        deadline = time.monotonic() + 10  # the last retirements: no propose follows, the
        while core.num_sequences and time.monotonic() < deadline:  # background flush sends them
            time.sleep(0.05)
        assert core.num_sequences == 0
        assert draft.runner.kv.num_free_blocks == draft.runner.kv.num_blocks
    finally:
        remote.close()
        server.stop(0)


def test_self_draft_is_the_first_layers_with_its_own_kv(default_model):
    target = default_model.runner.model
    total = target.arch.num_layers
    draft, vocab = build_remote_proposer(parse_drafter_choice("self:3"), "default", "float32",
                                         kv_cache_memory_mb=8, target=default_model)
    assert draft.kind is DrafterKind.SELF and vocab == target.arch.vocab_size
    m = draft.runner.model
    assert m.arch.num_layers == 3 and len(m.layers) == 3 and len(draft.runner.k_cache) == 3
    assert m.layers[0]["wqkv"].data_ptr() == target.layers[0]["wqkv"].data_ptr()  # weights shared
    assert target.arch.num_layers == total and len(target.layers) == total  # target untouched
    assert draft.runner.k_cache[0].data_ptr() != default_model.runner.k_cache[0].data_ptr()
    with pytest.raises(ValueError, match="self:L"):
        first_layers(target, total)
    with pytest.raises(ValueError, match="model drafters"):
        build_remote_proposer(parse_drafter_choice("ngram"), "default", "float32")


def test_remote_draft_model_vocabulary_is_checked(tmp_path, default_model):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from cluster.common.errors import VocabularyMismatchError
    from tests.conftest import make_tiny_model_dir

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20,
                            trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"]))
    other = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    d = make_tiny_model_dir(tmp_path / "draft", "llama", vocab_size=len(other))
    other.save_pretrained(str(d))
    spec = parse_drafter_choice(str(d))
    with pytest.raises(VocabularyMismatchError, match="not compatible"):
        build_remote_proposer(spec, "default", "float32", kv_cache_memory_mb=4, target=default_model)
    forced, vocab = build_remote_proposer(spec, "default", "float32", kv_cache_memory_mb=4,
                                          force_vocab_mismatch=True)  # target tokenizer from its spec
    assert vocab == len(other) and forced.kind is DrafterKind.DRAFT_MODEL


def test_remote_self_drafts_what_shared_layer_skip_drafts(default_model, rows):
    """Same L layers, same committed tokens: the DraftServer's own-KV layer skip proposes the
    tokens the shared-placement layer skip (reading the target's KV) proposes."""
    from cluster.speculative.layer_skip import LayerSkipProposer
    from cluster.speculative.types import ProposeInput

    tok = default_model.tokenizer
    inputs = [ProposeInput(r["id"], prompt_ids(tok, r), K, SamplingParams(max_tokens=1)) for r in rows]
    shared = LayerSkipProposer(ModelRunner(default_model.runner.model, None, 16, 16), 8)
    remote, _ = build_remote_proposer(parse_drafter_choice("self:8"), "default", "float32",
                                      kv_cache_memory_mb=16, target=default_model)
    assert remote.propose(inputs).draft_token_ids == shared.propose(inputs).draft_token_ids
    # the engine committed something other than the drafts: the remote draft rolls back exactly
    again = [ProposeInput(i.seq_id, i.token_ids + [tok.eos_token_id], K, i.params) for i in inputs]
    fresh, _ = build_remote_proposer(parse_drafter_choice("self:8"), "default", "float32",
                                     kv_cache_memory_mb=16, target=default_model)
    assert remote.propose(again).draft_token_ids == fresh.propose(again).draft_token_ids
