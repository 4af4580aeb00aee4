"""A grammar that breaks at run time ends its own request, never the step or a neighbour
(``cluster.engine.faults``): a matcher that refuses a token its mask allowed (injected), and a
real forced run past llguidance's lexer fuel (``[bc]a{300000}``: compile passes, the run fails),
each beside a constrained and a plain request that finish exactly as they do alone, on the plain
and the speculative path; a forced run already past the limits at compile is refused at
admission (issue 64's ``a{1000000}``). Tiny random Llama with the default tokenizer."""
from __future__ import annotations

import pytest

from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.errors import InvalidRequestError
from cluster.common.request import Constraint, ConstraintKind, FinishReason, GenerationRequest, SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.speculation import build_spec_controller
from tests.engine.helpers import run_to_completion

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
NEIGHBOURS = {"regex": Constraint(ConstraintKind.REGEX, r"[a-z]{2,6}-[0-9]{2,3}"), "plain": None}


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from cluster.models.load import load_model

    return load_model(str(tiny_llama_dir), EngineConfig(model=str(tiny_llama_dir)))


def engine(tiny, drafter: str | None) -> LLMEngine:
    spec = None if drafter is None else SpecConfig(drafter=drafter, num_draft_tokens=3)
    config = EngineConfig(model="tiny", spec=spec)
    m = tiny.with_fresh_kv(config, 64)
    return LLMEngine(config, m, build_spec_controller(config, m) if spec is not None else None)


def requests(broken: Constraint | None) -> list[GenerationRequest]:
    params = SamplingParams(max_tokens=24)
    out = [GenerationRequest(name, PROMPT[i:] + PROMPT[:i], params, constraint=c)
           for i, (name, c) in enumerate(NEIGHBOURS.items(), start=1)]
    return ([GenerationRequest("broken", PROMPT, params, constraint=broken)] if broken is not None else []) + out


class RefusingMatcher:
    """llguidance's matcher, except that it refuses every token it is asked to consume (and is
    then in its error state), while its mask and ``validate_tokens`` still allow them: the
    disagreement issue 64 found, injected."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self._failed = False

    def consume_token(self, token: int) -> bool:
        self._failed = True
        return False

    def is_error(self) -> bool:
        return self._failed

    def get_error(self) -> str:
        return "lexer error: injected refusal\n<state>…</state>" if self._failed else ""

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


_ALONE: dict[str | None, dict] = {}  # drafter -> the neighbours' results without the broken request


def assert_neighbours_as_alone(tiny, drafter, res) -> None:
    if drafter not in _ALONE:
        _ALONE[drafter] = run_to_completion(engine(tiny, drafter), requests(None))
    alone = _ALONE[drafter]
    for name in NEIGHBOURS:
        assert res[name]["finish"] is alone[name]["finish"] and res[name]["error"] is None, (name, res[name])
        assert res[name]["ids"] == alone[name]["ids"] and len(res[name]["ids"]) > 0, name


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_a_matcher_that_refuses_a_masked_token_fails_only_its_request(tiny, drafter):
    eng = engine(tiny, drafter)
    reqs = requests(Constraint(ConstraintKind.REGEX, "[a-z]+( [a-z]+)*"))
    for r in reqs:
        eng.add_request(r)
    matcher = eng.seqs["broken"].grammar
    matcher._m = RefusingMatcher(matcher._m)
    res = run_to_completion(eng, [])
    assert res["broken"]["finish"] is FinishReason.ERROR and res["broken"]["ids"] == []
    assert "the grammar engine hit its limits: lexer error: injected refusal" in res["broken"]["error"]
    assert "<state>" not in res["broken"]["error"]  # one line for the client, not llguidance's dump
    assert_neighbours_as_alone(tiny, drafter, res)
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks and not eng.seqs


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_a_forced_run_past_the_lexer_fuel_fails_only_its_request(tiny, drafter):
    eng = engine(tiny, drafter)
    for r in requests(Constraint(ConstraintKind.REGEX, "[bc]a{300000}")):
        eng.add_request(r)  # compiles: the first mask offers "b" or "c", nothing forced yet
    res = run_to_completion(eng, [])
    broken = res["broken"]
    assert broken["finish"] is FinishReason.ERROR
    assert "the grammar engine hit its limits: lexer error: too many expressions constructed" in broken["error"]
    assert tiny.tokenizer.decode(broken["ids"]) in ("b", "c")  # its first token, then the forced run
    assert_neighbours_as_alone(tiny, drafter, res)
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks


def test_a_forced_run_past_the_lexer_fuel_at_compile_is_refused_at_admission(tiny):
    eng = engine(tiny, None)
    with pytest.raises(InvalidRequestError, match="^regex cannot be enforced: the grammar engine hit its "
                                                  "limits: lexer error: too many expressions constructed$"):
        eng.add_request(GenerationRequest("r", PROMPT, SamplingParams(), constraint=Constraint(
            ConstraintKind.REGEX, "a{1000000}")))
    assert not eng.seqs
