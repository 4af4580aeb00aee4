"""The speculation controller with per-segment drafters and K policies (tiny random Llama): each
sequence drafts with its segment's drafter at its segment's K (fixed, 0, or adaptive), segments
without settings with the global ones, in one shared step; greedy output equals plain greedy."""
from __future__ import annotations

import pytest

from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.request import GenerationRequest, SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.speculation import build_spec_controller
from cluster.speculative.portfolio import PortfolioProposer
from tests.engine.helpers import run_to_completion

MAX_TOKENS = 16
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [50, 60, 70, 50, 60, 70, 50], [900, 901, 902, 903, 900, 901],
           [11, 12, 11, 12, 11]]
# segment -> (its drafter, its K policy); "other" has no settings: the global ngram at K 2
SEGMENTS = {"code": {"drafter": "self:1", "num_draft_tokens": 3}, "chat": {"num_draft_tokens": "auto"},
            "json": {"num_draft_tokens": 0}}


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from cluster.models.load import load_model

    return load_model(str(tiny_llama_dir), EngineConfig(model=str(tiny_llama_dir)))


def engine(tiny, spec: SpecConfig | None) -> LLMEngine:
    config = EngineConfig(model="tiny", spec=spec)
    m = tiny.with_fresh_kv(config, 64)
    return LLMEngine(config, m, build_spec_controller(config, m) if spec is not None else None)


def requests() -> list[GenerationRequest]:
    out = []
    for i, seg in enumerate(["code", "chat", "json", "other"] * 2):
        out.append(GenerationRequest(f"{seg}{i}", list(PROMPTS[i % len(PROMPTS)]),
                                     SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), segment=seg))
    return out


def test_each_segment_drafts_with_its_drafter_and_k_and_output_equals_plain_greedy(tiny):
    reqs = requests()
    plain = run_to_completion(engine(tiny, None), reqs)
    eng = engine(tiny, SpecConfig(drafter="ngram", num_draft_tokens=2, segments=SEGMENTS))
    got = run_to_completion(eng, reqs)
    for r in reqs:  # lossless: the drafters change how many tokens a step commits, never which
        assert got[r.request_id]["ids"] == plain[r.request_id]["ids"], r.request_id

    spec = eng.spec
    assert isinstance(spec.proposer, PortfolioProposer)  # the union: ngram (global) and self:1 (code)
    assert [m.name for m in spec.proposer.members] == ["ngram", "self:1"]
    stats = spec.segment_stats
    members = spec.proposer.drafter_stats()
    # code: the layer-skip drafter, always K = 3 (it drafts whatever the context) except where
    # the remaining budget caps it; it drafts for code alone
    code = stats["code"]
    assert code.steps_by_num_draft_tokens[3] > 0 and len(code.steps_by_num_draft_tokens) == 4
    assert members["self:1"]["steps"] == code.drafts and members["self:1"]["draft_tokens"] == code.draft_tokens
    # json: K = 0, never drafts; other: the global K 2; the n-gram drafter serves other and chat
    assert "json" not in stats
    assert len(stats["other"].steps_by_num_draft_tokens) <= 3 and stats["other"].drafts > 0
    assert members["ngram"]["steps"] == stats["other"].drafts + (stats["chat"].drafts if "chat" in stats else 0)
    # chat plans adaptively (its keys carry the drafter: adaptive K learns α per drafter)
    assert spec.adaptive is not None
    # each member's draft rounds are timed apart: the layer-skip rounds (code) are measured, the
    # n-gram member (never timed: no model) keeps its prior of 0 instead of the mix of both
    by_drafter = spec.adaptive.costs.to_dict()["draft_cost_s_by_drafter"]
    assert by_drafter["self:1"] > 0.0 and by_drafter["ngram"] == 0.0
    assert spec.proposer.costs is spec.adaptive.costs  # the union chooses with the same costs
    for r in reqs:
        if r.segment == "json":
            assert got[r.request_id]["spec"] is None or got[r.request_id]["spec"].draft_tokens == 0


def test_fixed_k_segments_without_auto_build_no_adaptive_k_and_one_drafter_needs_no_union(tiny):
    eng = engine(tiny, SpecConfig(drafter="ngram", num_draft_tokens=2, segments={"code": {"num_draft_tokens": 4}}))
    assert eng.spec.adaptive is None and not isinstance(eng.spec.proposer, PortfolioProposer)
    assert eng.spec.config.max_draft_tokens == 6
    got = run_to_completion(eng, requests()[:1])  # code: K 4 (the n-gram drafter matches the prompt's repeat)
    assert max(i for i, n in enumerate(eng.spec.segment_stats["code"].steps_by_num_draft_tokens) if n) <= 4
    assert got["code0"]["ids"] == run_to_completion(engine(tiny, None), requests()[:1])["code0"]["ids"]


def test_a_segment_drafter_that_cannot_run_is_refused_naming_the_segment(tiny):
    from cluster.common.errors import ModelLoadError

    # a typo is read as a draft model spec, which does not load
    spec = SpecConfig(drafter="ngram", segments={"code": {"drafter": "ngarm"}, "chat": {"drafter": "ngarm"}})
    with pytest.raises(ModelLoadError, match="router.segments.code.drafter, router.segments.chat.drafter 'ngarm' "
                                             "cannot run in this SpecEngine: ModelLoadError: unknown model"):
        engine(tiny, spec)
    with pytest.raises(ValueError, match="per-segment drafters need the drafters built here"):
        config = EngineConfig(model="tiny", spec=SpecConfig(segments={"code": {"drafter": "suffix"}}))
        build_spec_controller(config, tiny.with_fresh_kv(config, 16), proposer=object())


def test_a_portfolio_segment_chooses_among_its_members_next_to_a_single_drafter_segment(tiny):
    """Global ``portfolio`` (n-gram and suffix on a target without a shipped head), code with the
    layer-skip drafter of its own: code drafts with self:1 only, the others choose among the
    portfolio's members; greedy output equals plain."""
    reqs = requests()
    plain = run_to_completion(engine(tiny, None), reqs)
    eng = engine(tiny, SpecConfig(drafter="portfolio", num_draft_tokens="auto",
                                  segments={"code": {"drafter": "self:1", "num_draft_tokens": 3}}))
    got = run_to_completion(eng, reqs)
    for r in reqs:
        assert got[r.request_id]["ids"] == plain[r.request_id]["ids"], r.request_id
    union = eng.spec.proposer
    assert [m.name for m in union.members] == ["ngram", "suffix", "self:1"]
    assert union.routes.candidates("code") == ("self:1",) and union.routes.candidates("chat") == ("ngram", "suffix")
    members = union.drafter_stats()
    assert members["self:1"]["steps"] == eng.spec.segment_stats["code"].drafts > 0
    others = sum(eng.spec.segment_stats[s].drafts for s in ("chat", "json", "other") if s in eng.spec.segment_stats)
    assert members["ngram"]["steps"] + members["suffix"]["steps"] == others > 0


def test_the_shipped_head_is_built_once_for_a_portfolio_and_an_eagle_segment(default_model):
    """A target runner feeds one EAGLE head: a union of ``portfolio`` (global) and ``eagle`` (chat)
    shares the portfolio's head member instead of installing a second one."""
    config = EngineConfig(spec=SpecConfig(drafter="portfolio", num_draft_tokens="auto",
                                          segments={"chat": {"drafter": "eagle"}}), kv_cache_memory_mb=64)
    m = default_model.with_fresh_kv(config)
    spec = build_spec_controller(config, m)
    union = spec.proposer
    assert [mm.name for mm in union.members] == ["ngram", "suffix", "eagle"]
    assert union.routes.candidates("chat") == ("eagle",)
    assert union.routes.candidates("code") == ("ngram", "suffix", "eagle")
    assert m.runner.feature_tap is union.members[2].proposer
    assert 0.0 < union.members[2].cost < 0.5  # its share of a decode step, before any round is timed


def test_suffix_corpus_names_the_corpus_of_suffix_and_of_the_portfolios_suffix_member(default_model):
    """On the default model ``suffix`` and the portfolio's suffix member hold the shipped corpus
    unless ``suffix_corpus`` says otherwise: ``cold`` none, a file its corpus; ``suffix:FILE``
    keeps its own beside it (a segment naming it)."""
    from cluster.speculative.suffix_corpus import SHIPPED_SUFFIX_CORPUS

    def suffix_members(**spec):
        config = EngineConfig(spec=SpecConfig(num_draft_tokens="auto", **spec), kv_cache_memory_mb=64)
        proposer = build_spec_controller(config, default_model.with_fresh_kv(config)).proposer
        members = getattr(proposer, "members", None)
        return {m.name: m.proposer.corpus for m in members if m.name.startswith("suffix")} if members \
            else {"suffix": proposer.corpus}

    shipped = suffix_members(drafter="suffix")["suffix"]
    assert shipped is not None and shipped.documents == 5074
    assert suffix_members(drafter="portfolio")["suffix"] is shipped  # one per process: shared
    assert suffix_members(drafter="suffix", suffix_corpus="cold") == {"suffix": None}
    assert suffix_members(drafter="portfolio", suffix_corpus="cold")["suffix"] is None
    assert suffix_members(drafter="portfolio", suffix_corpus=str(SHIPPED_SUFFIX_CORPUS))["suffix"] is shipped
    union = suffix_members(drafter="portfolio", suffix_corpus="cold", segments={"code": {"drafter": "suffix:"
                                                                                 f"{SHIPPED_SUFFIX_CORPUS}"}})
    assert union["suffix"] is None and union[f"suffix:{SHIPPED_SUFFIX_CORPUS}"] is shipped
