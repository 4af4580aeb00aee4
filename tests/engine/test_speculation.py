"""Speculative decoding through the engine on the real default model: every drafter (the shipped
EAGLE head, the shipped suffix corpus, and the portfolio holding both among them) is lossless
against Hugging Face generate of the target alone (concurrent batch of workload prompts, mixed
K including K=0 in the same step), draft == target gives α = 1, frequent rejections stay exact,
seeded sampling is reproducible, and a vocabulary mismatch is refused."""
from __future__ import annotations

import pytest

from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.request import GenerationRequest, SamplingParams, SpecMode
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.speculation import build_spec_controller
from cluster.models.load import LoadedModel
from cluster.models.runner import ModelRunner
from tests.engine.helpers import greedy_requests, prompt_ids, run_to_completion
from tests.reference import check_greedy_match, workload_rows

MAX_TOKENS = 32  # same as the engine tests, so the HF reference is computed once


def spec_engine(model: LoadedModel, spec: SpecConfig, proposer=None) -> LLMEngine:
    config = EngineConfig(spec=spec)
    m = model.with_fresh_kv(config)
    return LLMEngine(config, m, build_spec_controller(config, m, proposer))


@pytest.fixture(scope="module")
def rows():
    return workload_rows(per_segment=4)


@pytest.fixture(scope="module")
def matrix_rows(profile):
    """The drafter matrix's concurrent batch: the first prompt of every segment in the short
    profile (the HF references are the concurrent-batch test's), the first four in the long one."""
    return workload_rows(per_segment=profile.pick(short=1, long=4))


@pytest.fixture(scope="module")
def draft_proposer(default_model):
    """The default model as its own draft (own runner and KV pool, shared weights)."""
    from cluster.speculative.draft_model import DraftModelProposer

    return DraftModelProposer(ModelRunner(default_model.runner.model, None, 16, 256))


@pytest.mark.parametrize("drafter,k", [("ngram", 4), ("self:12", 3), ("draft-model", 4), ("ngram", "auto"),
                                       ("suffix", 4), ("suffix:cold", 4), ("portfolio", "auto"),
                                       ("eagle:exported", 3), ("eagle", "auto")])
def test_every_drafter_is_lossless_vs_hf(default_model, hf_reference, matrix_rows, draft_proposer, drafter, k, tmp_path):
    proposer = draft_proposer if drafter == "draft-model" else None
    if drafter == "eagle:exported":  # the shipped head exported to the speculators format and read back
        from cluster.speculative.eagle_head import load_head
        from cluster.speculative.head_formats.speculators import write_speculators_head
        from cluster.speculative.proposer import SHIPPED_EAGLE_HEAD

        target = default_model.runner.model
        write_speculators_head(load_head(SHIPPED_EAGLE_HEAD, target), target, tmp_path / "exported")
        drafter = f"eagle:{tmp_path / 'exported'}"
    eng = spec_engine(default_model, SpecConfig(drafter=drafter if proposer is None else "default",
                                                num_draft_tokens=k), proposer)
    reqs = greedy_requests(default_model.tokenizer, matrix_rows, MAX_TOKENS)
    for r in reqs[::5]:  # some requests decode plainly in the same steps (K = 0 rows)
        r.mode = SpecMode.PLAIN
    res = run_to_completion(eng, reqs)
    verdicts = {r.request_id: check_greedy_match(res[r.request_id]["ids"], hf_reference.greedy(r.prompt_token_ids, MAX_TOKENS))
                for r in reqs}
    assert sum(v == "equal" for v in verdicts.values()) >= len(reqs) - max(1, len(reqs) // 12), verdicts
    drafted = sum(res[r.request_id]["spec"].draft_tokens for r in reqs if r.mode is not SpecMode.PLAIN)
    assert drafted > 0, "nothing was speculated"
    assert all(res[r.request_id]["spec"] is None for r in reqs if r.mode is SpecMode.PLAIN)
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks
    if proposer is not None:
        assert proposer.runner.kv.num_free_blocks == proposer.runner.kv.num_blocks
    break_even = eng.stats().break_even_alpha  # the router's default gate: from measured costs (auto K only)
    # 1.0 = no α pays at the measured costs: a model drafter's rounds over a 24-sequence batch can cost that much
    assert (0.0 < break_even <= 1.0) if k == "auto" else break_even is None
    if k == "auto" and drafter in ("ngram", "suffix"):  # free drafts: some α always pays
        assert break_even < 1.0
    if drafter.startswith("suffix"):  # `suffix` drafts from the corpus shipped for this model too
        assert (eng.spec.proposer.corpus_drafts > 0) == (drafter == "suffix")
    if k == "auto" and drafter == "ngram":  # acceptance learnt per match length, all state freed
        keys = set(eng.spec.adaptive.estimator.to_dict())
        assert keys and all("|n" in key for key in keys), keys
        assert not eng.spec._derived and not eng.spec.adaptive.estimator._seqs
    if drafter == "portfolio":  # every step's drafts named by the member that made them, the shipped head among them
        members = eng.stats().drafter_steps
        assert set(members) == {"ngram", "suffix", "eagle"} and sum(m["draft_tokens"] for m in members.values()) == drafted
        suffix = next(m.proposer for m in eng.spec.proposer.members if m.name == "suffix")
        assert suffix.corpus is not None and suffix.corpus_drafts > 0
        assert not eng.spec.proposer._pending
    if drafter.startswith("eagle") and k == 3:  # the shipped head was trained for this target: an untrained one
        # is accepted ~never; this one ~0.2-0.5 at position 1 by segment (docs/measurements.md)
        spec = [res[r.request_id]["spec"] for r in reqs if r.mode is not SpecMode.PLAIN]
        first = sum(s.accepted_per_position[0] for s in spec if s.drafted_per_position)
        assert first / sum(s.drafted_per_position[0] for s in spec if s.drafted_per_position) > 0.1


def test_draft_equal_to_target_accepts_everything(default_model, rows, draft_proposer):
    k = 4
    eng = spec_engine(default_model, SpecConfig(drafter="default", num_draft_tokens=k), draft_proposer)
    tok = default_model.tokenizer
    # 1 token from the prefill, then 4 verification steps of K+1 = 5 tokens each
    reqs = [GenerationRequest(r["id"], prompt_ids(tok, r), SamplingParams(max_tokens=1 + 4 * (k + 1), ignore_eos=True))
            for r in rows[:3]]
    res = run_to_completion(eng, reqs)
    for r in reqs:
        s = res[r.request_id]["spec"]
        assert s.acceptance_rate == 1.0 and s.drafts == 4
        assert s.mean_acceptance_length == k + 1
        assert s.accepted_per_position == s.drafted_per_position == [4] * k


# portfolio at auto K: long profile only — its step counts follow adaptive K's measured costs, and on
# a busy 2-core machine the shared scope's steps fell under the bound in some runs (2026-12-08:
# 4 of 9 runs between 0c4de40 and main); the scope claim itself is checked at a fixed K by suffix:cold
@pytest.mark.parametrize("drafter,k", [("suffix:cold", 4), pytest.param("portfolio", "auto", marks=pytest.mark.long)])
def test_a_drafter_learning_from_traffic_drafts_from_the_requests_draft_scope_only(default_model, rows, drafter, k):
    """One engine, one chat prompt answered in scope t1; then the same prompt in t2, in the shared
    scope and in t1 again: only t1's repeat drafts from the first answer (α near 1), and all four
    outputs are the same greedy tokens."""
    eng = spec_engine(default_model, SpecConfig(drafter=drafter, num_draft_tokens=k))
    row = next(r for r in rows if r["segment"] == "chat")
    ids = prompt_ids(default_model.tokenizer, row)

    def answer(rid, scope):
        req = GenerationRequest(rid, list(ids), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                                segment="chat", draft_scope=scope)
        return run_to_completion(eng, [req])[rid]

    first = answer("first", "t1")
    others = {scope: answer(f"again-{scope or 'shared'}", scope) for scope in ("t2", "", "t1")}
    assert all(o["ids"] == first["ids"] for o in others.values())
    spec = {scope: o["spec"] for scope, o in others.items()}
    seen = {scope: (s.accepted_tokens, s.draft_tokens, s.drafts) for scope, s in spec.items()}
    # t1's repeat: every draft accepted, ~K + 1 tokens a step (measured 24 of 24-25 in 6 steps);
    # t2 and the shared scope draft from their own history only (12-16 steps, measured)
    assert spec["t1"].acceptance_rate >= 0.9 and spec["t1"].accepted_tokens >= 0.7 * (MAX_TOKENS - 1), seen
    assert all(spec["t1"].drafts <= 0.6 * spec[o].drafts for o in ("t2", "")), seen
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks


def _predicted(reqs, predictions):
    for r, p in zip(reqs, predictions):
        r.prediction_token_ids = tuple(p)
    return reqs


def test_a_prediction_drafts_where_the_output_keeps_to_it_and_changes_nothing(default_model, hf_reference, rows):
    """Predicted outputs: the target's own answer as the prediction is drafted from and accepted
    nearly whole; one with every fifth token wrong, or another prompt's answer, still gives the
    target's greedy output (HF ``generate``), as does a seeded sampled request the same tokens
    with and without one."""
    tok = default_model.tokenizer
    picked = [r for r in rows if r["segment"] in ("chat", "code", "json")][::2]
    eng = spec_engine(default_model, SpecConfig(drafter="portfolio", num_draft_tokens="auto"))
    hf = {r["id"]: hf_reference.greedy(prompt_ids(tok, r), MAX_TOKENS) for r in picked}
    answers = [hf[r["id"]].tokens for r in picked]
    wrong = [[t if i % 5 != 4 else (t + 1) % tok.vocab_size for i, t in enumerate(a)] for a in answers]
    for name, predictions in (("exact", answers), ("every fifth wrong", wrong), ("another's", answers[1:] + answers[:1])):
        reqs = _predicted(greedy_requests(tok, picked, MAX_TOKENS), predictions)
        res = run_to_completion(eng, reqs)
        verdicts = [check_greedy_match(res[r.request_id]["ids"], hf[r.request_id]) for r in reqs]
        assert verdicts.count("equal") >= len(reqs) - 1, (name, verdicts)
        spec = [res[r.request_id]["spec"] for r in reqs]
        accepted, drafted = sum(s.accepted_tokens for s in spec), sum(s.draft_tokens for s in spec)
        if name == "exact":  # K + 1 tokens a verification step, nearly every draft kept
            steps, tokens = sum(s.drafts for s in spec), sum(len(res[r.request_id]["ids"]) for r in reqs)
            assert accepted >= 0.9 * drafted and steps <= tokens / 3, (accepted, drafted, steps, tokens)
    assert len(eng.spec.predictions) == 0 and eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks
    assert eng.stats().drafter_steps["prediction"]["accepted_tokens"] > 0  # named beside the portfolio's members
    # seeded sampling: the coupled target tokens whatever is drafted (here: its own earlier answer)
    sampled = [GenerationRequest(f"{r['id']}-s", prompt_ids(tok, r),
                                 SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7 + i))
               for i, r in enumerate(picked)]
    alone = run_to_completion(eng, sampled)
    again = _predicted([GenerationRequest(r.request_id, r.prompt_token_ids, r.params) for r in sampled],
                       [alone[r.request_id]["ids"] for r in sampled])
    res = run_to_completion(eng, again)
    assert all(res[r.request_id]["ids"] == alone[r.request_id]["ids"] for r in again)
    assert sum(res[r.request_id]["spec"].accepted_tokens for r in again) > sum(
        alone[r.request_id]["spec"].accepted_tokens for r in sampled)


def test_frequent_rejections_still_equal_plain(default_model, rows):
    tok = default_model.tokenizer
    reqs = [GenerationRequest(r["id"], prompt_ids(tok, r), SamplingParams(max_tokens=24)) for r in rows[::4]]
    plain = run_to_completion(spec_engine(default_model, SpecConfig(drafter="self:4", num_draft_tokens=4)),
                              [GenerationRequest(r.request_id, r.prompt_token_ids, r.params, mode=SpecMode.PLAIN) for r in reqs])
    eng = spec_engine(default_model, SpecConfig(drafter="self:4", num_draft_tokens=4))
    res = run_to_completion(eng, reqs)
    rejected = 0
    for r in reqs:
        assert res[r.request_id]["ids"] == plain[r.request_id]["ids"], r.request_id
        s = res[r.request_id]["spec"]
        rejected += s.draft_tokens - s.accepted_tokens
    total = sum(res[r.request_id]["spec"].draft_tokens for r in reqs)
    assert rejected > total / 2, f"self:4 should reject often ({rejected}/{total})"


def test_adaptive_k_drafts_until_the_head_is_unsure_and_a_fixed_k_drafts_k(default_model, rows):
    """draft_stop_confidence reaches the drafter for adaptive K's sequences only (the output stays
    the target's own, the rounds priced are the rounds that ran); a fixed K drafts exactly K
    whatever the setting."""
    tok = default_model.tokenizer
    reqs = [GenerationRequest(r["id"], prompt_ids(tok, r), SamplingParams(max_tokens=24)) for r in rows[::3]]
    plain = run_to_completion(spec_engine(default_model, SpecConfig(drafter="eagle", num_draft_tokens=3)),
                              [GenerationRequest(r.request_id, r.prompt_token_ids, r.params, mode=SpecMode.PLAIN)
                               for r in reqs])
    for k in (3, "auto"):
        eng = spec_engine(default_model, SpecConfig(drafter="eagle", num_draft_tokens=k, draft_stop_confidence=0.6))
        asked, longest, inner = [], [], eng.spec.proposer.propose

        def propose(inputs, inner=inner, asked=asked, longest=longest):
            out = inner(inputs)
            asked.extend((i.num_draft_tokens, i.stop_confidence, len(d)) for i, d in zip(inputs, out.draft_token_ids))
            longest.append(max(len(d) for d in out.draft_token_ids))
            return out

        eng.spec.proposer.propose = propose
        res = run_to_completion(eng, [GenerationRequest(r.request_id, r.prompt_token_ids, r.params) for r in reqs])
        assert all(res[r.request_id]["ids"] == plain[r.request_id]["ids"] for r in reqs)
        assert eng.spec.timing.draft_rounds == sum(longest)  # the rounds that ran, priced as such
        drafted = [(want, stop, got) for want, stop, got in asked if got]
        assert drafted
        if k == 3:
            assert all(stop == 0.0 and got == want for want, stop, got in drafted), drafted
        else:
            # the floor reaches the head (where it stops short: tests/speculative/test_drafting.py;
            # adaptive K may plan K = 1 throughout on a busy machine, leaving nothing to cut)
            assert all(stop == 0.6 and got <= want for want, stop, got in drafted)


def test_seeded_sampling_is_reproducible(default_model, rows):
    tok = default_model.tokenizer

    def run():
        eng = spec_engine(default_model, SpecConfig(drafter="ngram", num_draft_tokens=3))
        reqs = [GenerationRequest(r["id"], prompt_ids(tok, r),
                                  SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=1234 + i))
                for i, r in enumerate(rows[:6])]
        return {k: v["ids"] for k, v in run_to_completion(eng, reqs).items()}

    a, b = run(), run()
    assert a == b
    assert len({tuple(v) for v in a.values()}) == len(a)


def test_each_acceptance_class_is_judged_by_rates_of_its_own(default_model, rows):
    """Adaptive K learns a sampled request's acceptance and a shaped one's (a repetition penalty)
    apart from greedy unshaped ones' of the same segment (their draft contexts tagged "+sampled",
    "+shaped"), for a drafter with draft contexts and for one without, and reports each class's
    live α; every request finishes, the seeded and the shaped one as they do alone."""
    from cluster.common.acceptance_class import SAMPLED, SHAPED
    from cluster.speculative.acceptance import CONTEXT_SEP

    tok = default_model.tokenizer
    odd = {"hot": SamplingParams(max_tokens=24, temperature=1.0, seed=7),
           "penalized": SamplingParams(max_tokens=24, repetition_penalty=1.1)}
    # under the penalty the code prompts end in 2 tokens; this edit prompt drafts at n1 to n3
    prompt_of = {"hot": rows[0], "penalized": [r for r in rows if r["segment"] == "edit"][3]}
    for drafter in ("ngram", "self:12"):
        eng = spec_engine(default_model, SpecConfig(drafter=drafter, num_draft_tokens="auto"))
        reqs = [GenerationRequest(f"g{i}", prompt_ids(tok, r), SamplingParams(max_tokens=24), segment="edit")
                for i, r in enumerate(rows[:3])]
        reqs += [GenerationRequest(name, prompt_ids(tok, prompt_of[name]), params, segment="edit")
                 for name, params in odd.items()]
        got = run_to_completion(eng, reqs)
        assert set(got) == {"g0", "g1", "g2", *odd}
        learnt = set(eng.spec.adaptive.estimator.to_dict())
        sampled, shaped = {k for k in learnt if k.endswith(SAMPLED)}, {k for k in learnt if k.endswith(SHAPED)}
        assert sampled and shaped and learnt - sampled - shaped, (drafter, learnt)  # each class measured, apart
        assert all(k.startswith("edit") for k in learnt)
        if drafter == "ngram":
            assert all(CONTEXT_SEP in k for k in learnt)  # "edit|n2+sampled": per match length too
        edit = eng.stats().spec_by_segment["edit"]  # the Router gates each class on its own live α
        by_class = edit["live_alpha_by_class"]
        assert set(by_class) == {"base", "sampled", "shaped"}, by_class
        assert all(c["live_draft_tokens"] > 0 for c in by_class.values()), by_class
        # the classes split the segment's decayed draft count (each truncated to a whole token)
        assert abs(sum(c["live_draft_tokens"] for c in by_class.values()) - edit["live_draft_tokens"]) < len(by_class)
        for name, params in odd.items():
            alone = spec_engine(default_model, SpecConfig(drafter=drafter, num_draft_tokens="auto"))
            solo = run_to_completion(alone, [GenerationRequest(name, prompt_ids(tok, prompt_of[name]), params,
                                                               segment="edit")])
            assert solo[name]["ids"] == got[name]["ids"], name


def test_vocabulary_mismatch_is_refused(tmp_path, default_model):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from cluster.common.errors import VocabularyMismatchError
    from cluster.engine.drafters import build_draft_model_proposer
    from tests.conftest import make_tiny_model_dir

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50 + ["def f(x): return x"] * 50,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    other = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    d = make_tiny_model_dir(tmp_path / "draft", "llama", vocab_size=len(other))
    other.save_pretrained(str(d))
    spec = SpecConfig(drafter=str(d), num_draft_tokens=3)
    with pytest.raises(VocabularyMismatchError) as info:
        build_draft_model_proposer(str(d), spec, EngineConfig(), default_model.tokenizer)
    assert "vocab" in str(info.value).lower()
    forced = SpecConfig(drafter=str(d), num_draft_tokens=3, force_vocab_mismatch=True)
    assert build_draft_model_proposer(str(d), forced, EngineConfig(), default_model.tokenizer) is not None


def test_vocab_trimmed_draft_head_is_lossless(default_model, rows):
    """A draft LM head restricted to the 8000 most frequent (lowest BPE rank) ids plus specials:
    drafts can only use those ids, the target still decides every token."""
    from cluster.speculative.draft_model import DraftModelProposer, TrimmedHead, frequent_ids

    runner = ModelRunner(_clone_model(default_model.runner.model), None, 16, 128)
    keep = frequent_ids(default_model.tokenizer, 8000)
    trimmed = TrimmedHead(runner, keep)
    assert runner.model.lm_head.shape[1] == trimmed.keep.numel() < default_model.runner.vocab_size
    assert default_model.runner.model.lm_head.shape[1] == default_model.runner.vocab_size  # target untouched
    proposer = DraftModelProposer(runner, trimmed)
    tok = default_model.tokenizer
    reqs = [GenerationRequest(r["id"], prompt_ids(tok, r), SamplingParams(max_tokens=20)) for r in rows[:6]]
    plain = run_to_completion(spec_engine(default_model, SpecConfig(drafter="ngram", num_draft_tokens=3)),
                              [GenerationRequest(r.request_id, r.prompt_token_ids, r.params, mode=SpecMode.PLAIN) for r in reqs])
    res = run_to_completion(spec_engine(default_model, SpecConfig(drafter="default", num_draft_tokens=3), proposer), reqs)
    allowed = set(trimmed.keep.tolist())
    for r in reqs:
        assert res[r.request_id]["ids"] == plain[r.request_id]["ids"]
        s = res[r.request_id]["spec"]
        assert s.draft_tokens > 0 and s.accepted_tokens > 0
    assert all(t in allowed for t in proposer_drafted(proposer))


def _clone_model(model):
    """A LlamaModel sharing every weight tensor with ``model`` (so trimming its head is local)."""
    import copy

    clone = copy.copy(model)
    clone.layers = list(model.layers)
    return clone


def proposer_drafted(proposer) -> list[int]:
    """The draft tokens the proposer produces for a fresh probe sequence (then released)."""
    from cluster.common.request import SamplingParams as SP
    from cluster.speculative.types import ProposeInput

    out = proposer.propose([ProposeInput("probe", list(range(300, 340)), 5, SP())])
    proposer.release("probe")
    return out.draft_token_ids[0]


class _Oracle:
    """A costly portfolio member that drafts the target's own greedy continuation (known from a
    plain run): every draft token is right."""

    from cluster.speculative.proposer import DrafterKind
    kind = DrafterKind.EAGLE

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.full = prompt + output

    def draft_context(self, seq_id, token_ids, segment="", draft_scope=""):
        return "h"

    def propose(self, inputs):
        from cluster.speculative.types import DraftProposal

        drafts = [self.full[len(i.token_ids): len(i.token_ids) + i.num_draft_tokens] for i in inputs]
        return DraftProposal(drafts, [None] * len(inputs))

    def release(self, seq_id):
        pass


@pytest.mark.parametrize("hand_rates", [True, False])
def test_a_portfolio_plans_k_with_its_own_rates_not_adaptive_ks_pool(default_model, rows, hand_rates):
    """Adaptive K pools a draft context over segments; a head hopeless on one segment made it plan
    K = 0 on every other, overruling a portfolio that had chosen (or was probing) the head there.
    The portfolio hands adaptive K the rates it chose the member by: a member right every time
    drafts from the first step though the pool says α ≈ 0 (without that hand-over it does not)."""
    from cluster.speculative.portfolio import Member, PortfolioProposer

    class NoRates(PortfolioProposer):
        __slots__ = ()

        def planning_alpha(self, seq_id):
            return None

    tok = default_model.tokenizer
    prompt = prompt_ids(tok, rows[0])
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = run_to_completion(spec_engine(default_model, SpecConfig(drafter="ngram", num_draft_tokens="auto")),
                              [GenerationRequest("p", prompt, params, mode=SpecMode.PLAIN)])["p"]["ids"]
    portfolio = (PortfolioProposer if hand_rates else NoRates)([Member("head", _Oracle(prompt, plain), cost=0.05)])
    eng = spec_engine(default_model, SpecConfig(drafter="portfolio", num_draft_tokens="auto"), portfolio)
    for _ in range(300):  # another segment taught adaptive K that this context is never accepted
        eng.spec.adaptive.estimator.update("elsewhere", "other|head:h", 4, 0)
    eng.spec.adaptive.explore_min_trials = 0  # its exploration of a new segment would draft without rates
    assert eng.spec.adaptive.estimator.segment_estimate("chat|head:h") < 0.05
    res = run_to_completion(eng, [GenerationRequest("r", prompt, params, segment="chat")])["r"]
    assert res["ids"] == plain
    spec = res["spec"]
    if hand_rates:
        assert spec.accepted_tokens == spec.draft_tokens >= 16 and spec.drafts <= 8
    else:  # adaptive K's own probes only (one after 16 plain steps, then what it taught: how many
        # drafts the last 8 tokens take depends on the K planned from this machine's step costs)
        assert spec.drafts <= 3 and spec.draft_tokens <= 6
