"""The live MoE gate through the engine: a tiny random Llama flagged MoE, the target itself as
its draft model (greedy α = 1) or that draft with every token shifted (α = 0). While a segment's
gate is closed only probes (mode SPECULATIVE, what the Router forwards) draft; a window of
enough probe draft tokens at α >= threshold opens the segment, one below keeps it closed.
Output stays the plain greedy output throughout (lossless)."""
from __future__ import annotations

import pytest

from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.request import GenerationRequest, SamplingParams, SpecMode
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.speculation import build_spec_controller
from cluster.models.runner import ModelRunner
from cluster.speculative.draft_model import DraftModelProposer
from cluster.speculative.moe import MoeGate
from cluster.speculative.proposer import DrafterKind
from cluster.speculative.types import DraftProposal
from tests.engine.helpers import run_to_completion

WINDOW = 24  # probe draft tokens per measurement window
MAX_TOKENS = 12
PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 200, 300, 400], [42] * 9, [7, 300, 12, 99, 4]]


class ShiftedDraft:
    """The target's own greedy draft with every token moved by one: the target never accepts."""

    kind = DrafterKind.DRAFT_MODEL

    def __init__(self, inner: DraftModelProposer, vocab_size: int) -> None:
        self.inner, self.vocab_size = inner, vocab_size

    def propose(self, inputs):
        p = self.inner.propose(inputs)
        return DraftProposal([[(t + 1) % self.vocab_size for t in ids] for ids in p.draft_token_ids],
                             [None] * len(p.draft_token_ids))

    def release(self, seq_id: str) -> None:
        self.inner.release(seq_id)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from cluster.models.load import load_model

    return load_model(str(tiny_llama_dir), EngineConfig(model=str(tiny_llama_dir)))


def _engine(tiny, good: bool, threshold: float | str = 0.5, k: int | str = 3) -> LLMEngine:
    spec = SpecConfig(drafter="default", num_draft_tokens=k, moe_min_draft_tokens=WINDOW,
                      moe_alpha_threshold=threshold)
    config = EngineConfig(spec=spec)
    model = tiny.with_fresh_kv(config)
    draft = DraftModelProposer(ModelRunner(model.runner.model, None, 16, 256))
    proposer = draft if good else ShiftedDraft(draft, model.runner.model.arch.vocab_size)
    controller = build_spec_controller(config, model, proposer)
    assert not controller.moe_gate.moe  # a dense Llama ...
    controller.moe_gate = MoeGate(moe=True, min_draft_tokens=spec.moe_min_draft_tokens)  # ... flagged MoE
    return LLMEngine(config, model, controller)


def _requests(tag: str, segment: str, mode: SpecMode = SpecMode.AUTO) -> list[GenerationRequest]:
    return [GenerationRequest(f"{tag}{i}", p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                              segment=segment, mode=mode) for i, p in enumerate(PROMPTS)]


def _run(engine, reqs) -> tuple[dict[str, list[int]], int]:
    res = run_to_completion(engine, reqs)
    drafted = sum(res[r.request_id]["spec"].draft_tokens for r in reqs if res[r.request_id]["spec"])
    return {r.request_id[1:]: res[r.request_id]["ids"] for r in reqs}, drafted


@pytest.fixture(scope="module")
def plain_ids(tiny):
    config = EngineConfig()
    engine = LLMEngine(config, tiny.with_fresh_kv(config))
    ids, _ = _run(engine, _requests("p", "chat", SpecMode.PLAIN))
    return ids


@pytest.mark.parametrize("good", [True, False], ids=["alpha-1", "alpha-0"])
def test_probes_open_the_gate_only_with_good_alpha(tiny, plain_ids, good):
    engine = _engine(tiny, good)
    gate = engine.spec.moe_gate
    # closed: requests of the segment decode plainly, nothing measured
    ids, drafted = _run(engine, _requests("a", "chat"))
    assert ids == plain_ids and drafted == 0 and gate.segments == {}
    st = engine.stats()
    assert st.moe and not st.moe_gate_open
    assert all(not d.get("moe_gate_open", False) for d in st.spec_by_segment.values())
    # probes draft and are measured, and stay lossless whatever the drafter
    ids, drafted = _run(engine, _requests("b", "chat", SpecMode.SPECULATIVE))
    assert ids == plain_ids and drafted >= WINDOW
    chat = engine.stats().spec_by_segment["chat"]
    assert chat["moe_gate_open"] is good
    assert chat["moe_gate"].startswith(f"MoE target: segment 'chat' {'open' if good else 'closed'}, probe alpha")
    assert gate.segments["chat"].last_alpha == (1.0 if good else 0.0)
    assert gate.segments["chat"].windows >= 1
    # after the probes: plain requests of the segment speculate iff the gate opened
    ids, drafted = _run(engine, _requests("c", "chat"))
    assert ids == plain_ids and (drafted > 0) is good
    # another segment is gated on its own measurement
    ids, drafted = _run(engine, _requests("d", "code"))
    assert ids == plain_ids and drafted == 0 and not gate.allows("code")
    assert not engine.stats().moe_gate_open  # the target as a whole stays gated
    assert engine.runner.kv.num_free_blocks == engine.runner.kv.num_blocks


def test_auto_threshold_is_the_cost_models_break_even(tiny):
    engine = _engine(tiny, good=True, threshold="auto", k="auto")
    break_even = engine.spec.adaptive.break_even_alpha(engine.spec.config.max_draft_tokens)
    assert engine.spec.moe_threshold() == break_even
    assert engine.stats().break_even_alpha == round(break_even, 4)
    assert _engine(tiny, good=True, threshold=0.7).spec.moe_threshold() == 0.7
