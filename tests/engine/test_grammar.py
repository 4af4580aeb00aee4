"""Structured output on a tiny random Llama (the default tokenizer): the grammar's mask decides
every token on the plain and the speculative path, EOS only where the grammar can end, drafts are
cut where the grammar rejects them, and speculation under the grammar is lossless (greedy and
seeded outputs equal the plain path token for token; sampling keeps the masked distribution)."""
from __future__ import annotations

import json
import re

import pytest
import torch

from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.errors import InvalidRequestError
from cluster.common.request import Constraint, ConstraintKind, FinishReason, GenerationRequest, SamplingParams
from cluster.engine.grammar import GrammarCompiler, GrammarError, apply_masks, check_grammar
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.speculation import build_spec_controller
from cluster.sampling.sampler import sample
from cluster.speculative.proposer import DrafterKind
from cluster.speculative.rejection_sampler import rejection_sample
from cluster.speculative.types import DraftProposal, SpecBatchMetadata
from tests.engine.helpers import run_to_completion

REGEX = r"[a-z]{2,6}-[0-9]{2,3}"
SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"},
    "c": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3}},
    "required": ["n", "ok", "c", "tags"], "additionalProperties": False}
# a Lark grammar (llguidance's dialect): a bracketed list of 1-3 words or numbers without leading
# zeros (a lexeme by intersection and negation); GRAMMAR_RE is the same language for Python's re
LARK = """start: "[" item ("," item)? ("," item)? "]"
item: WORD | NUM
WORD: /[a-z]{1,8}/
NUM: /[0-9]{1,3}/ & ~/0[0-9]+/
"""
_ITEM = r"(?:[a-z]{1,8}|(?!0[0-9])[0-9]{1,3})"
GRAMMAR_RE = rf"\[{_ITEM}(?:,{_ITEM}){{0,2}}\]"
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [50, 60, 70, 50, 60, 70, 50], [900, 901, 902, 903], [11, 12, 11, 12, 11]]


def regex_c(rx: str = REGEX) -> Constraint:
    return Constraint(ConstraintKind.REGEX, rx)


def schema_c(schema: dict = SCHEMA) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from cluster.models.load import load_model

    return load_model(str(tiny_llama_dir), EngineConfig(model=str(tiny_llama_dir)))


@pytest.fixture(scope="module")
def compiler(tiny):
    return GrammarCompiler(tiny.tokenizer, tiny.runner.vocab_size, tiny.eos_token_ids)


def engine(tiny, drafter: str | None = None, k: int = 3, proposer=None) -> LLMEngine:
    spec = None if drafter is None else SpecConfig(drafter=drafter, num_draft_tokens=k)
    config = EngineConfig(model="tiny", spec=spec)
    m = tiny.with_fresh_kv(config, 64)
    eng = LLMEngine(config, m, build_spec_controller(config, m, proposer) if spec is not None else None)
    return eng


def lark_c(grammar: str = LARK) -> Constraint:
    return Constraint(ConstraintKind.GRAMMAR, grammar)


def text_of(tiny, ids: list[int]) -> str:
    eos = tiny.eos_token_ids
    return tiny.tokenizer.decode([t for t in ids if t not in eos])


def valid(tiny, constraint: Constraint, ids: list[int]) -> bool:
    text = text_of(tiny, ids)
    if constraint.kind is ConstraintKind.REGEX:
        return re.fullmatch(constraint.text, text) is not None
    if constraint.kind is ConstraintKind.GRAMMAR:
        assert constraint.text == LARK
        return re.fullmatch(GRAMMAR_RE, text) is not None
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), json.loads(constraint.text))
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# ---------------------------------------------------------------- the matcher
def test_mask_allows_exactly_the_grammar_and_eos_only_at_the_end(tiny, compiler):
    m = compiler.matcher(regex_c("ab|abc"))
    eos = next(iter(tiny.eos_token_ids))
    a = tiny.tokenizer.encode("a")[0]
    allowed = m.allowed()
    assert allowed.shape == (tiny.runner.vocab_size,) and allowed[a] and not allowed[eos]
    assert int(allowed.sum()) < 10  # "a", "ab", "abc" spellings only
    m.accept(a)
    b = tiny.tokenizer.encode("b")[0]
    m.accept(b)  # "ab": may end (EOS) or go on with "c"
    allowed = m.allowed()
    assert allowed[eos] and allowed[tiny.tokenizer.encode("c")[0]] and not m.complete
    m.accept(tiny.tokenizer.encode("c")[0])  # "abc": nothing but EOS follows
    assert m.complete and m.allowed()[eos] and int(m.allowed().sum()) == 1
    with pytest.raises(GrammarError):
        m.accept(a)


def test_illegal_token_raises_and_leaves_state_usable(tiny, compiler):
    m = compiler.matcher(regex_c("[0-9]+"))
    with pytest.raises(GrammarError):
        m.accept(tiny.tokenizer.encode("x")[0])
    m.accept(tiny.tokenizer.encode("7")[0])  # not poisoned: the illegal token was never consumed
    assert m.allowed()[next(iter(tiny.eos_token_ids))]


def test_walk_cuts_at_the_first_illegal_token_and_restores_state(tiny, compiler):
    tok = tiny.tokenizer
    m = compiler.matcher(regex_c("[a-z]+-[0-9]+"))
    legal = [tok.encode("ab")[0], tok.encode("-")[0], tok.encode("1")[0]]
    bad = tok.encode("Z")[0]
    before = m.allowed()
    k, rows = m.walk(legal[:2] + [bad, legal[2]], keep_illegal=False)
    assert k == 2 and rows.shape == (3, tiny.runner.vocab_size)
    assert not rows[2][bad] and rows[2][legal[2]]  # row j: the mask after the first j drafts
    assert torch.equal(rows[0], before) and torch.equal(m.allowed(), before)  # rolled back
    k, rows = m.walk(legal[:2] + [bad, legal[2]], keep_illegal=True)
    assert k == 3 and rows.shape[0] == 4 and not rows[2][bad]  # kept: verification rejects it
    eos = next(iter(tiny.eos_token_ids))
    k, _ = m.walk(legal + [eos, legal[0]], keep_illegal=False)
    assert k == 4  # cut after EOS: nothing follows an end


def test_unsupported_features_are_refused_by_name(tiny, compiler):
    for schema, word in (({"type": "object", "not": {"type": "string"}}, "not"),
                         ({"type": "string", "format": "no-such-format"}, "no-such-format")):
        with pytest.raises(InvalidRequestError, match=word):
            check_grammar(schema_c(schema))
    with pytest.raises(InvalidRequestError, match="regex"):
        check_grammar(regex_c("(a"))
    with pytest.raises(InvalidRequestError, match="json_schema"):
        compiler.compile(Constraint(ConstraintKind.JSON_SCHEMA, "{not json"))


def test_compile_cache_is_bounded_lru(tiny):
    c = GrammarCompiler(tiny.tokenizer, tiny.runner.vocab_size, tiny.eos_token_ids, max_cached=2)
    for rx in ("a+", "b+", "a+", "c+", "b+"):
        c.compile(regex_c(rx))
    assert (c.hits, c.misses) == (1, 4)  # "a+" hit once; "b+" fell out when "c+" came
    assert len(c._cache) == 2


def test_compile_time_limit_is_invalid_argument(tiny):
    c = GrammarCompiler(tiny.tokenizer, tiny.runner.vocab_size, tiny.eos_token_ids, time_limit_s=1e-9)
    with pytest.raises(InvalidRequestError, match="too complex"):
        c.compile(regex_c("[a-z]{1,50}"))


# ---------------------------------------------------------------- sampling under a mask
def test_masked_sampling_keeps_the_masked_distribution():
    """sample() on masked logits draws from softmax restricted to the mask (chi-square)."""
    torch.manual_seed(0)
    vocab, n = 8, 20000
    logits = torch.randn(vocab)
    allowed = torch.tensor([True, False, True, True, False, False, True, False])
    masked = apply_masks(logits.expand(n, vocab), allowed.expand(n, vocab))
    params = [SamplingParams(temperature=1.0)] * n
    counts = torch.bincount(sample(masked, params, [0] * n), minlength=vocab).double()
    assert counts[~allowed].sum() == 0
    expected = torch.softmax(logits.masked_fill(~allowed, float("-inf")), 0).double() * n
    chi2 = float(((counts[allowed] - expected[allowed]) ** 2 / expected[allowed]).sum())
    assert chi2 < 16.27  # 3 degrees of freedom, p = 0.001


def test_rejection_sampling_of_unmasked_drafts_keeps_the_masked_target():
    """A sampled draft from an unmasked q (illegal tokens included) verified against the masked
    p' commits tokens distributed as p' exactly (chi-square over the first committed token)."""
    torch.manual_seed(1)
    vocab, n = 6, 30000
    allowed = torch.tensor([True, True, False, True, False, True])
    p_logits = torch.randn(vocab)
    q = torch.softmax(torch.randn(vocab) * 2, 0)  # puts mass on illegal tokens
    drafts = torch.multinomial(q, n, replacement=True)  # [n] one draft token each
    target = apply_masks(p_logits.expand(2 * n, vocab), allowed.expand(2 * n, vocab))  # K+1 = 2 rows
    result = rejection_sample(target, drafts, [q[None, :].clone() for _ in range(n)],
                              SpecBatchMetadata.from_num_draft_tokens([1] * n), [SamplingParams(temperature=1.0)] * n,
                              [0] * n)
    first = result.output_token_ids[:, 0]
    counts = torch.bincount(first, minlength=vocab).double()
    assert counts[~allowed].sum() == 0
    expected = torch.softmax(p_logits.masked_fill(~allowed, float("-inf")), 0).double() * n
    chi2 = float(((counts[allowed] - expected[allowed]) ** 2 / expected[allowed]).sum())
    assert chi2 < 16.27  # 3 degrees of freedom, p = 0.001


# ---------------------------------------------------------------- the engine
def constrained(i: int, constraint: Constraint | None, params: SamplingParams) -> GenerationRequest:
    return GenerationRequest(f"r{i}", list(PROMPTS[i % len(PROMPTS)]), params, constraint=constraint)


def batch(params: SamplingParams) -> list[GenerationRequest]:
    """Ragged: constrained (regex, schema, Lark grammar) next to unconstrained requests."""
    return [constrained(0, regex_c(), params), constrained(1, None, params),
            constrained(2, schema_c(), params), constrained(3, None, params),
            constrained(4, regex_c(r"(yes|no|maybe)( [0-9]{1,2})?"), params), constrained(5, lark_c(), params)]


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, None), (0.8, 5)])
def test_every_constrained_output_matches_on_the_plain_path(tiny, temperature, seed):
    params = SamplingParams(max_tokens=60, temperature=temperature, seed=seed)
    res = run_to_completion(engine(tiny), batch(params))
    for r in batch(params):
        got = res[r.request_id]
        if r.constraint is not None:
            assert got["finish"] in (FinishReason.STOP, FinishReason.EOS), (r.request_id, got)
            assert valid(tiny, r.constraint, got["ids"]), (r.request_id, text_of(tiny, got["ids"]))


class OracleWithBadTokens:
    """Drafts the reference output of each sequence (accepted under the grammar) with an illegal
    token spliced in at draft position 2: the grammar must cut it before verification."""

    kind = DrafterKind.DRAFT_MODEL

    def __init__(self, reference: dict[str, list[int]], prompts: dict[str, int], bad: int) -> None:
        self.reference, self.prompts, self.bad = reference, prompts, bad
        self.seen = {}

    def propose(self, inputs):
        ids = []
        for inp in inputs:
            done = len(inp.token_ids) - self.prompts[inp.seq_id]
            ref = self.reference[inp.seq_id][done:]
            d = ref[: inp.num_draft_tokens]
            if len(d) > 2:
                d = d[:2] + [self.bad] + d[3:]
            ids.append(d)
        return DraftProposal(ids, [None] * len(inputs))

    def release(self, seq_id):
        pass


@pytest.mark.parametrize("drafter", ["ngram", "ngram/auto", "oracle", "self:1"])
def test_greedy_constrained_speculation_equals_plain_token_for_token(tiny, drafter, monkeypatch):
    from cluster.engine.grammar import GrammarMatcher

    opened = []
    draft_cursor = GrammarMatcher.draft_cursor
    monkeypatch.setattr(GrammarMatcher, "draft_cursor", lambda self, prefix: opened.append(prefix) or draft_cursor(self, prefix))
    params = SamplingParams(max_tokens=60)
    plain = run_to_completion(engine(tiny), batch(params))
    proposer = None
    if drafter == "oracle":
        bad = tiny.tokenizer.encode("~")[0]
        proposer = OracleWithBadTokens({r.request_id: plain[r.request_id]["ids"] for r in batch(params)},
                                       {r.request_id: len(r.prompt_token_ids) for r in batch(params)}, bad)
    name = {"oracle": "default", "ngram/auto": "ngram"}.get(drafter, drafter)
    eng = engine(tiny, name, "auto" if drafter == "ngram/auto" else 4, proposer)
    spec = run_to_completion(eng, batch(params))
    for r in batch(params):
        assert spec[r.request_id]["ids"] == plain[r.request_id]["ids"], r.request_id
        assert spec[r.request_id]["finish"] is plain[r.request_id]["finish"]
    # jump-forward: the schema's forced text ('{"n":' ...) was drafted without a drafter, all kept
    forced = spec["r2"]["spec"].forced_tokens
    assert forced > 0 and eng.spec.segment_stats["default"].forced_tokens >= forced
    if drafter == "oracle":  # the legal prefix of each draft was accepted, the bad token cut
        assert eng.spec.grammar_cut_tokens > 0
        assert sum(spec[r.request_id]["spec"].accepted_tokens for r in batch(params)) > 0
    # a model drafter in this process drafts under the mask (after forced tokens, when there are
    # some); the model-free drafters do not open a cursor
    assert bool(opened) == drafter.startswith("self") and any(opened) == drafter.startswith("self")
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks and not eng.seqs


class RecordingOracle:
    """Drafts each sequence's reference output after whatever context it is given (forced
    tokens included) and records, per call, whether that context ran past the committed tokens."""

    kind = DrafterKind.DRAFT_MODEL

    def __init__(self, reference: dict[str, list[int]], prompts: dict[str, int]) -> None:
        self.reference, self.prompts = reference, prompts
        self.engine = None
        self.calls: list[tuple[str, int]] = []  # (seq_id, context tokens past the committed ones)

    def propose(self, inputs):
        ids = []
        for inp in inputs:
            committed = self.engine.seqs[inp.seq_id].token_ids
            assert inp.token_ids[: len(committed)] == committed  # the committed prefix, then forced tokens
            self.calls.append((inp.seq_id, len(inp.token_ids) - len(committed)))
            done = len(inp.token_ids) - self.prompts[inp.seq_id]
            ids.append(self.reference[inp.seq_id][done: done + inp.num_draft_tokens])
        return DraftProposal(ids, [None] * len(inputs))

    def release(self, seq_id):
        pass


def oracle_run(tiny, k, params: SamplingParams):
    plain = run_to_completion(engine(tiny), batch(params))
    oracle = RecordingOracle({r.request_id: plain[r.request_id]["ids"] for r in batch(params)},
                             {r.request_id: len(r.prompt_token_ids) for r in batch(params)})
    eng = engine(tiny, "default", k, oracle)
    oracle.engine = eng
    return plain, run_to_completion(eng, batch(params)), oracle, eng


def test_forced_tokens_and_the_drafters_draft_after_them_verify_in_one_step(tiny):
    params = SamplingParams(max_tokens=60)
    plain, spec, oracle, eng = oracle_run(tiny, 1, params)
    for r in batch(params):
        assert spec[r.request_id]["ids"] == plain[r.request_id]["ids"], r.request_id
    # the drafter was asked after the forced tokens (its context ran past the committed tokens)
    assert any(past > 0 for sid, past in oracle.calls if sid == "r2")
    stats = spec["r2"]["spec"]
    # forced tokens come on top of the drafter's K = 1: some steps verified more than 1 draft token
    assert stats.forced_tokens > 0 and len(stats.steps_by_num_draft_tokens) > 2 and sum(stats.steps_by_num_draft_tokens[2:]) > 0
    assert stats.accepted_tokens > stats.forced_tokens  # the oracle's drafts after them were accepted too
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks and not eng.seqs


def test_jump_forward_alone_asks_no_drafter_and_equals_plain(tiny):
    params = SamplingParams(max_tokens=60)
    plain, spec, oracle, eng = oracle_run(tiny, 0, params)  # fixed K = 0: forced tokens only
    for r in batch(params):
        assert spec[r.request_id]["ids"] == plain[r.request_id]["ids"], r.request_id
    assert not oracle.calls
    assert spec["r2"]["spec"].forced_tokens > 0 and spec["r1"]["spec"].draft_tokens == 0


def test_seeded_model_drafts_after_forced_tokens_equal_plain(tiny):
    from cluster.models.runner import ModelRunner
    from cluster.speculative.draft_model import DraftModelProposer

    params = SamplingParams(max_tokens=60, temperature=0.9, seed=11)
    plain = run_to_completion(engine(tiny), batch(params))
    eng = engine(tiny, "default", 2, DraftModelProposer(ModelRunner(tiny.runner.model, 64, 16, 64)))
    res = run_to_completion(eng, batch(params))
    for r in batch(params):
        assert res[r.request_id]["ids"] == plain[r.request_id]["ids"], r.request_id
    assert res["r2"]["spec"].forced_tokens > 0


def test_seeded_constrained_speculation_equals_plain(tiny):
    params = SamplingParams(max_tokens=60, temperature=0.9, seed=3)
    plain = run_to_completion(engine(tiny), batch(params))
    spec = run_to_completion(engine(tiny, "ngram", 4), batch(params))
    for r in batch(params):
        assert spec[r.request_id]["ids"] == plain[r.request_id]["ids"], r.request_id
    assert spec["r2"]["spec"].forced_tokens > 0


def test_sampled_model_drafts_under_the_grammar_stay_valid(tiny):
    """A model drafter's q is not grammar-aware: its illegal draft tokens are verified (and
    rejected) under the mask; every output still matches."""
    from cluster.models.runner import ModelRunner
    from cluster.speculative.draft_model import DraftModelProposer

    params = SamplingParams(max_tokens=60, temperature=1.0)
    eng = engine(tiny, "default", 3, DraftModelProposer(ModelRunner(tiny.runner.model, 64, 16, 64)))
    res = run_to_completion(eng, batch(params))
    for r in batch(params):
        if r.constraint is not None:
            assert valid(tiny, r.constraint, res[r.request_id]["ids"]), text_of(tiny, res[r.request_id]["ids"])
    assert sum(res[r.request_id]["spec"].draft_tokens for r in batch(params)) > 0


def test_a_grammar_fault_fails_only_its_sequence(tiny):
    eng = engine(tiny, "ngram", 3)
    reqs = batch(SamplingParams(max_tokens=30))
    for r in reqs:
        eng.add_request(r)

    def broken():
        raise GrammarError("matcher exploded")

    eng.seqs["r0"].grammar.allowed = broken
    res = run_to_completion(eng, [])
    assert res["r0"]["finish"] is FinishReason.ERROR
    solo = run_to_completion(engine(tiny), batch(SamplingParams(max_tokens=30))[1:])
    for r in reqs[1:]:
        assert res[r.request_id]["ids"] == solo[r.request_id]["ids"], r.request_id
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks


def test_bad_constraint_is_refused_at_admission(tiny):
    eng = engine(tiny)
    with pytest.raises(InvalidRequestError, match="not"):
        eng.add_request(constrained(0, schema_c({"type": "object", "not": {}}), SamplingParams()))
    assert not eng.seqs


@pytest.mark.parametrize("k", [4, "auto"])
def test_a_prediction_under_a_grammar_is_cut_by_it_and_equals_plain(tiny, k):
    """Predicted outputs on constrained requests: the prediction is the plain answer with an
    illegal token spliced in every fifth place (and, for the unconstrained rows, a wrong one): the
    grammar walk cuts each draft at the illegal token, forced tokens stand in front, and the output
    is plain decoding's, token for token."""
    params = SamplingParams(max_tokens=60)
    plain = run_to_completion(engine(tiny), batch(params))
    bad = tiny.tokenizer.encode("~")[0]
    eng = engine(tiny, "ngram", k)
    reqs = batch(params)
    for r in reqs:
        answer = plain[r.request_id]["ids"]
        r.prediction_token_ids = tuple(t if i % 5 != 4 else bad for i, t in enumerate(answer))
    res = run_to_completion(eng, reqs)
    for r in reqs:
        assert res[r.request_id]["ids"] == plain[r.request_id]["ids"], r.request_id
        if r.constraint is not None:
            assert valid(tiny, r.constraint, res[r.request_id]["ids"])
    assert eng.stats().drafter_steps["prediction"]["accepted_tokens"] > 0
    assert eng.spec.grammar_cut_tokens > 0 and len(eng.spec.predictions) == 0
