"""Structured output on the real default model: every output of the ``json`` workload (its own
schema per row) and of our schemas (nested objects, arrays with min/max items, enums, patterns,
numbers, unicode strings) and regexes parses and validates / fully matches, on the plain path and
the speculative path (n-gram), batched (all at once) and at concurrency 1; greedy constrained
speculation equals greedy constrained plain decoding token for token."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.request import Constraint, ConstraintKind, FinishReason, GenerationRequest, SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.speculation import build_spec_controller
from tests.engine.helpers import prompt_ids, run_to_completion


OWN = [
    ("Describe a person named Ana who lives in Porto (zip 40001) as JSON.",
     {"type": "object", "properties": {"person": {"type": "object", "properties": {
         "name": {"type": "string", "maxLength": 30},
         "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                     "required": ["city", "zip"], "additionalProperties": False}},
         "required": ["name", "address"], "additionalProperties": False}},
      "required": ["person"], "additionalProperties": False}, None),
    ("List two or three colors of the French flag as JSON.",
     {"type": "object", "properties": {"colors": {"type": "array", "minItems": 2, "maxItems": 3,
                                                  "items": {"enum": ["red", "white", "blue", "green"]}}},
      "required": ["colors"], "additionalProperties": False}, None),
    ("Give today's temperature in Celsius in Paris and a count of clouds, as JSON.",
     {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                                       "count": {"type": "integer", "minimum": 1, "maximum": 10},
                                       "sunny": {"type": "boolean"}},
      "required": ["temperature", "count", "sunny"], "additionalProperties": False}, None),
    ("Say hello in Japanese and in French as JSON with keys ja and fr.",
     {"type": "object", "properties": {"ja": {"type": "string", "maxLength": 20},
                                       "fr": {"type": "string", "maxLength": 20}},
      "required": ["ja", "fr"], "additionalProperties": False}, None),
    ("Is the sky blue? Answer yes or no.", None, r"(yes|no)"),
    ("Give a US phone number.", None, r"[0-9]{3}-[0-9]{3}-[0-9]{4}"),
    ("Name a country and its capital.", None, r"[A-Z][a-z]+, [A-Z][a-z]+"),
]
MAX_TOKENS = 96


def json_workload() -> Path:
    """shared/workloads/json.jsonl beside the checkout (a worktree sits one level deeper)."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "shared" / "workloads" / "json.jsonl").exists():
            return parent / "shared" / "workloads" / "json.jsonl"
    pytest.skip("shared/workloads/json.jsonl not found")


def rows() -> list[dict]:
    out = [json.loads(line) for line in open(json_workload()) if line.strip()]
    for i, (prompt, schema, regex) in enumerate(OWN):
        row = {"id": f"own-{i}", "chat": True, "prompt": prompt}
        row.update({"json_schema": schema} if schema is not None else {"regex": regex})
        out.append(row)
    return out


def constraint(row: dict) -> Constraint:
    if row.get("json_schema") is not None:
        return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(row["json_schema"]))
    return Constraint(ConstraintKind.REGEX, row["regex"])


def requests(tokenizer, rs: list[dict]) -> list[GenerationRequest]:
    return [GenerationRequest(r["id"], prompt_ids(tokenizer, r), SamplingParams(max_tokens=MAX_TOKENS),
                              segment="json", constraint=constraint(r)) for r in rs]


def check_valid(tokenizer, row: dict, got: dict) -> None:
    assert got["finish"] in (FinishReason.STOP, FinishReason.EOS), (row["id"], got["finish"], got["text"])
    text = got["text"]
    if row.get("json_schema") is not None:
        jsonschema.validate(json.loads(text), row["json_schema"])
    else:
        assert re.fullmatch(row["regex"], text), (row["id"], text)


def engine(model, spec: SpecConfig | None) -> LLMEngine:
    config = EngineConfig(spec=spec)
    m = model.with_fresh_kv(config)
    return LLMEngine(config, m, build_spec_controller(config, m, None) if spec is not None else None)


@pytest.fixture(scope="module")
def plain_batched(default_model):
    return run_to_completion(engine(default_model, None), requests(default_model.tokenizer, rows()))


def test_every_output_validates_on_the_plain_path(default_model, plain_batched):
    for r in rows():
        check_valid(default_model.tokenizer, r, plain_batched[r["id"]])


def test_speculative_path_validates_and_equals_plain_token_for_token(default_model, plain_batched):
    eng = engine(default_model, SpecConfig(drafter="ngram", num_draft_tokens=4))
    spec = run_to_completion(eng, requests(default_model.tokenizer, rows()))
    for r in rows():
        check_valid(default_model.tokenizer, r, spec[r["id"]])
        assert spec[r["id"]]["ids"] == plain_batched[r["id"]]["ids"], r["id"]
    assert sum(spec[r["id"]]["spec"].accepted_tokens for r in rows()) > 0
    assert eng.runner.kv.num_free_blocks == eng.runner.kv.num_blocks


def test_concurrency_one_equals_batched(default_model, plain_batched):
    some = [rows()[0], rows()[-3], rows()[-1]]
    eng = engine(default_model, SpecConfig(drafter="ngram", num_draft_tokens=4))
    for r in some:
        got = run_to_completion(eng, requests(default_model.tokenizer, [r]))[r["id"]]
        check_valid(default_model.tokenizer, r, got)
        assert got["ids"] == plain_batched[r["id"]]["ids"]


class LLGuidanceProcessor:
    """An independent constrained reference: a transformers logits processor that drives
    llguidance's LLMatcher directly (not through cluster.engine.grammar)."""

    def __init__(self, tokenizer, vocab: int, eos: list[int], grammar: str, prompt_len: int) -> None:
        import llguidance.hf
        from llguidance import LLMatcher

        self.matcher = LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos), grammar)
        self.prompt_len = prompt_len
        self.vocab = vocab

    def __call__(self, input_ids, scores):
        import numpy as np
        import torch

        out = input_ids[0, self.prompt_len:].tolist()
        if out:
            assert self.matcher.consume_token(out[-1])
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: scores.shape[-1]].astype(bool))
        return scores.masked_fill(~allowed[None, :], float("-inf"))


def test_equals_hf_generate_with_a_grammar_logits_processor(default_model, hf_reference):
    import torch
    from llguidance import LLMatcher
    from transformers import LogitsProcessorList

    tok = default_model.tokenizer
    eos = sorted(default_model.eos_token_ids)
    some = [rows()[0], rows()[-6], rows()[-2]]
    plain_batched = run_to_completion(engine(default_model, None), requests(tok, some))
    for r in some:
        ids = prompt_ids(tok, r)
        grammar = (LLMatcher.grammar_from_json_schema(r["json_schema"], defaults={"whitespace_flexible": False})
                   if r.get("json_schema") is not None else LLMatcher.grammar_from_regex(r["regex"]))
        proc = LLGuidanceProcessor(tok, default_model.runner.vocab_size, eos, grammar, len(ids))
        with torch.inference_mode():
            out = hf_reference.model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                logits_processor=LogitsProcessorList([proc]))
        ref = out[0, len(ids):].tolist()
        ours = plain_batched[r["id"]]["ids"]
        if plain_batched[r["id"]]["finish"] is FinishReason.STOP:  # grammar complete: HF goes on to EOS
            assert ref[len(ours):] in ([], [eos[0]]) or ref[len(ours)] in eos, (r["id"], ref, ours)
            ref = ref[: len(ours)]
        assert ours == ref, r["id"]
