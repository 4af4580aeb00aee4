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
