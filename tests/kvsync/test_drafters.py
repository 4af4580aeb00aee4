"""Model drafters in a DraftServer (placement ``separate``): a draft model and layer skip (the
target's first L layers with their own KV), served by a real KVSync gRPC server on 127.0.0.1 and
driven by the engine through ``RemoteProposer`` on the real default model. Greedy output equals
plain decoding of the same engine, acceptance is measured, and the draft side frees its KV."""
from __future__ import annotations

import pickle
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


def test_predictions_beside_a_remote_drafter_stay_lossless_and_in_step(default_model, rows):
    """Placement ``separate`` with predicted outputs: the SpecEngine drafts from a request's
    prediction itself and asks the DraftServer only where the output has left it (here every
    fourth predicted token is wrong), so the draft side skips steps and catches up on the next
    ask — output equal to plain decoding, both drafters used, every state freed on both sides."""
    draft, vocab = build_remote_proposer(parse_drafter_choice("default"), "default", "float32",
                                         kv_cache_memory_mb=64, target=default_model)
    core = DraftServerCore(draft, vocab_size=vocab, drafter="default")
    server, port = start_server(core, host="127.0.0.1")
    remote = RemoteProposer(f"127.0.0.1:{port}", timeout_s=30.0, expected_vocab_size=vocab,
                            budget=DraftBudget(factor=100.0, cap_s=30.0))
    try:
        eng = _engine(default_model, "default", remote)
        tok = default_model.tokenizer
        reqs = [GenerationRequest(r["id"], prompt_ids(tok, r), SamplingParams(max_tokens=MAX_TOKENS),
                                  segment=r["segment"]) for r in rows]
        plain = run_to_completion(eng, [GenerationRequest(r.request_id + "-plain", r.prompt_token_ids,
                                                          r.params, mode=SpecMode.PLAIN) for r in reqs])
        for r in reqs:
            answer = plain[r.request_id + "-plain"]["ids"]
            r.prediction_token_ids = tuple(t if i % 4 != 3 else (t + 1) % vocab for i, t in enumerate(answer))
        asked = eng.spec.timing.proposals  # steps that asked the DraftServer, before these requests
        res = run_to_completion(eng, reqs)
        for r in reqs:
            assert res[r.request_id]["ids"] == plain[r.request_id + "-plain"]["ids"], r.request_id
        assert eng.stats().draft_fallbacks == 0 and remote.num_failures == 0
        assert sum(res[r.request_id]["spec"].accepted_tokens for r in reqs) > 0
        assert eng.spec.timing.proposals > asked  # the DraftServer drafted where the prediction was wrong
        predicted = eng.stats().drafter_steps["prediction"]  # ... and the prediction where it was right
        assert predicted["steps"] > 0 and 0 < predicted["accepted_tokens"] < predicted["draft_tokens"], predicted
        assert len(eng.spec.predictions) == 0 and remote.tracked() == {}
        assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks
        deadline = time.monotonic() + 10
        while core.num_sequences and time.monotonic() < deadline:
            time.sleep(0.05)
        assert core.num_sequences == 0 and draft.runner.kv.num_free_blocks == draft.runner.kv.num_blocks
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


# -- eagle:DIR in a DraftServer: the target's features travel over KVSync -------------------------
from tests.speculative.test_eagle import engine, head_dir, requests, tiny  # noqa: E402,F401 (fixtures)


@pytest.fixture()
def eagle_served(tiny, head_dir):
    """A KVSync server hosting the tiny model's random head; yields (core, head proposer, address)."""
    path, model = tiny
    draft, vocab = build_remote_proposer(parse_drafter_choice(f"eagle:{head_dir}"), str(path), "float32",
                                         target=model)
    assert draft.kind is DrafterKind.EAGLE and vocab == model.runner.vocab_size
    assert model.runner.feature_tap is None  # the loaded target is not tapped by the server's head
    core = DraftServerCore(draft, vocab_size=vocab, drafter=f"eagle:{head_dir}")
    server, port = start_server(core, host="127.0.0.1")
    try:
        yield core, draft, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def _remote(address: str, vocab: int, **kw) -> RemoteProposer:
    return RemoteProposer(address, timeout_s=30.0, expected_vocab_size=vocab,
                          budget=DraftBudget(factor=100.0, cap_s=30.0), **kw)


def test_remote_eagle_drafts_what_the_shared_head_drafts(tiny, head_dir, eagle_served):
    """Float32 features on the wire: the DraftServer's head proposes the shared head's tokens after
    a prefill, after a verification step (rows sent incrementally) and after a resync (all resent)."""
    from cluster.models.runner import SeqChunk
    from cluster.speculative.eagle import EagleProposer
    from cluster.speculative.types import ProposeInput
    from tests.speculative.test_eagle import prompts

    _, model = tiny
    core, draft, address = eagle_served
    shared_target = model.with_fresh_kv(EngineConfig(model="tiny"))
    shared = EagleProposer.from_dir(head_dir, shared_target.runner)
    remote_target = model.with_fresh_kv(EngineConfig(model="tiny"))
    remote = _remote(address, model.runner.vocab_size, feature_dtype="float32")
    remote.attach_target(remote_target.runner)  # asks Info: the tap records the head's layers from now on
    assert remote_target.runner.feature_tap.feature_layers == draft.feature_layers
    assert pickle.loads(pickle.dumps(remote))._features is None  # a ProcessEngine core attaches its own
    greedy = SamplingParams(max_tokens=8)
    ids = prompts()[3]
    try:
        for runner in (shared_target.runner, remote_target.runner):
            runner.forward([SeqChunk("s", ids[:-1], 0, 1)])  # the prefill
        want = shared.propose([ProposeInput("s", ids, K, greedy)]).draft_token_ids
        assert remote.propose([ProposeInput("s", ids, K, greedy)]).draft_token_ids == want and want[0]
        # verification of the drafts; the first is accepted, then a recovered token
        committed = ids + [want[0][0], 17]
        for runner in (shared_target.runner, remote_target.runner):
            runner.forward([SeqChunk("s", [ids[-1], *want[0]], len(ids) - 1, K + 1)])
            runner.truncate("s", len(committed) - 1)
        want = shared.propose([ProposeInput("s", committed, K, greedy)]).draft_token_ids
        assert remote.propose([ProposeInput("s", committed, K, greedy)]).draft_token_ids == want
        assert core._features[f"{remote.caller}/s"] == len(committed) - 1
        # the server lost the sequence: RESYNC, tokens and features resent from position 0
        with core._lock:
            core._forget(remote.caller, "s")
        assert remote.propose([ProposeInput("s", committed, K, greedy)]).draft_token_ids == want
        assert remote.num_resyncs == 1 and core._features[f"{remote.caller}/s"] == len(committed) - 1
    finally:
        remote.close()


def test_a_sequence_prefilled_before_the_server_named_its_layers_is_not_drafted(tiny, eagle_served):
    """No address when the tap was installed: the first prefill records nothing, so that sequence
    gets no drafts (never drafts from missing features); one prefilled after Info does."""
    from cluster.models.runner import SeqChunk
    from cluster.speculative.types import ProposeInput
    from tests.speculative.test_eagle import prompts

    _, model = tiny
    core, _, address = eagle_served
    target = model.with_fresh_kv(EngineConfig(model="tiny"))
    remote = _remote(None, model.runner.vocab_size)
    remote.attach_target(target.runner)
    early, late = prompts()[3], prompts()[1]
    greedy = SamplingParams(max_tokens=8)
    try:
        target.runner.forward([SeqChunk("early", early[:-1], 0, 1)])
        remote.set_address(address)  # asks Info in the background
        with remote._lock:  # wait for it (or ask now): the tap records the head's layers from here on
            remote._connect(time.monotonic() + 30)
        target.runner.forward([SeqChunk("late", late[:-1], 0, 1)])
        got = remote.propose([ProposeInput("early", early, K, greedy), ProposeInput("late", late, K, greedy)])
        assert got.draft_token_ids[0] == [] and len(got.draft_token_ids[1]) == K
        assert core.held("early") is None and core.held("late") == late
    finally:
        remote.close()


def test_engine_with_remote_eagle_is_lossless_and_frees_features(tiny, head_dir, eagle_served):
    """Placement separate, eagle:DIR: greedy output equals plain decoding (ragged batch, some rows
    K = 0); every feature row is freed on both sides when the requests finish; a version-1 client is
    refused clearly."""
    import grpc

    from cluster.api import stubs

    _, model = tiny
    core, draft, address = eagle_served
    params = lambda i: SamplingParams(max_tokens=16)  # noqa: E731
    plain = run_to_completion(engine(model, None), requests(params))
    remote = _remote(address, model.runner.vocab_size)  # bfloat16 features
    try:
        eng = engine(model, f"eagle:{head_dir}", 3, proposer=remote)
        got = run_to_completion(eng, requests(params))
        for rid in plain:
            assert got[rid]["ids"] == plain[rid]["ids"], rid
        assert sum(got[r]["spec"].draft_tokens for r in got if got[r]["spec"] is not None) > 0
        assert eng.stats().draft_fallbacks == 0 and remote.num_failures == 0
        assert remote.tracked() == {} and remote._features.num_sequences == 0
        remote.flush_releases()
        assert core.num_sequences == 0 and core._features == {} and draft._seqs == {}
        pb2 = stubs.kvsync_pb2()
        old = stubs.kvsync_grpc().KVSyncStub(grpc.insecure_channel(address))
        with pytest.raises(grpc.RpcError) as err:  # a version-1 client sends tokens only
            old.Propose(pb2.ProposeRequest(epoch=core.epoch, seqs=[pb2.ProposeSeq(
                seq_id="x", base_len=0, new_tokens=[1, 2, 3], num_draft_tokens=3)]), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "upgrade" in err.value.details()
    finally:
        remote.close()


def test_requests_sharing_a_prefix_with_a_remote_eagle_get_its_features_from_the_engine(tiny, head_dir, eagle_served):
    """Placement separate under prefix caching: requests sharing a prefix (in the step that writes
    it, and a later one from the kept blocks) skip its prefill on the target, the engine's feature
    buffer gives them the prefix's rows, so the DraftServer's head drafts for them; outputs equal
    plain decoding, and every feature row is freed on both sides."""
    from tests.speculative.test_eagle import prompts

    _, model = tiny
    core, draft, address = eagle_served
    prefix = prompts()[3] + prompts()[1]  # 47 tokens: two full blocks
    together = [GenerationRequest(f"t{i}", prefix + prompts()[j], SamplingParams(max_tokens=16))
                for i, j in enumerate((0, 2, 5))]
    later = [GenerationRequest("later", prefix + prompts()[1], SamplingParams(max_tokens=16))]
    plain = run_to_completion(engine(model, None), together + later)
    remote = _remote(address, model.runner.vocab_size)  # bfloat16 features
    try:
        eng = engine(model, f"eagle:{head_dir}", 3, proposer=remote)
        got = run_to_completion(eng, together)
        got.update(run_to_completion(eng, later))
        bs = eng.runner.kv.block_size
        for r in together + later:
            assert got[r.request_id]["ids"] == plain[r.request_id]["ids"], r.request_id
        assert got["t0"]["cached"] == 0
        for rid in ("t1", "t2", "later"):
            assert got[rid]["cached"] == 2 * bs and got[rid]["spec"].draft_tokens > 0, rid
        assert eng.stats().draft_fallbacks == 0 and remote.num_failures == 0
        assert remote._features.num_sequences == 0
        remote.flush_releases()
        assert core.num_sequences == 0 and core._features == {} and draft._seqs == {}
    finally:
        remote.close()


@pytest.mark.parametrize("seed", [1, 2])
def test_random_arrivals_aborts_and_preemption_with_a_remote_eagle_change_no_token(tiny, head_dir, eagle_served, seed):
    """Placement separate under the same seeded random schedule as the shared head's test
    (``random_schedule``: preemption, chunked prefills, shared prefixes, aborts): every finished
    request equals HF generate, no draft call failed or fell back, and every feature row is freed
    on both sides."""
    from tests.speculative.test_eagle import random_schedule

    _, model = tiny
    core, draft, address = eagle_served
    remote = _remote(address, model.runner.vocab_size)  # bfloat16 features
    try:
        eng = random_schedule(tiny, head_dir, seed, proposer=remote)
        assert eng.stats().draft_fallbacks == 0 and remote.num_failures == 0
        assert remote.tracked() == {} and remote._features.num_sequences == 0 and not remote._features._prefix._borrow
        remote.flush_releases()
        assert core.num_sequences == 0 and core._features == {} and draft._seqs == {}
    finally:
        remote.close()


def test_client_refuses_a_head_for_another_target(tiny):
    """The DraftServer's head was trained for another target than the engine's: refused at connect,
    the engine decodes plainly."""
    from cluster.speculative.types import DraftUnavailableError, ProposeInput
    from tests.kvsync.test_server import FeatureReader

    _, model = tiny
    core = DraftServerCore(FeatureReader(), vocab_size=model.runner.vocab_size, drafter="eagle:other")
    server, port = start_server(core, host="127.0.0.1")
    remote = _remote(f"127.0.0.1:{port}", model.runner.vocab_size)
    try:
        remote.attach_target(model.with_fresh_kv(EngineConfig(model="tiny")).runner)
        with pytest.raises(DraftUnavailableError, match="trained for target target-a"):
            remote.propose([ProposeInput("s", [1, 2, 3], K, SamplingParams(max_tokens=4))])
    finally:
        remote.close()
        server.stop(0)
