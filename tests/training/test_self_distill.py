"""Self-distillation data: continuous batching gives every prompt the continuation it gets alone
(greedy and seeded sampling alike), greedy continuations equal Hugging Face generate, and the
JSONL file resumes where a stopped run left off without repeating a prompt."""
from __future__ import annotations

import math

import pytest
import torch

from cluster.models.llama import LlamaModel
from cluster.common.errors import InvalidRequestError
from cluster.training.self_distill import extend_samples, generate, read_samples
from tests.conftest import make_tiny_model_dir

GEN = dict(max_new_tokens=12, eos_ids=frozenset({0}), temperature=0.9, sample_odd=True, seed=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-distill"), "llama", num_hidden_layers=2)
    return path, LlamaModel.load(path, torch.float32)


def prompts(n: int = 7) -> list[tuple[int, list[int]]]:
    g = torch.Generator().manual_seed(1)
    return [(i, torch.randint(1, 500, (3 + 5 * (i % 3),), generator=g).tolist()) for i in range(n)]


def test_continuous_batching_gives_each_prompt_its_own_continuation(tiny):
    _, model = tiny
    alone = {s.index: s for p in prompts() for s in generate(model, [p], batch_size=1, **GEN)}
    seen = []
    batched = generate(model, prompts(), batch_size=3, on_sample=seen.append, **GEN)
    assert sorted(s.index for s in batched) == list(range(7)) and seen == batched
    for s in batched:
        assert s.output_ids == alone[s.index].output_ids, s.index  # slots refilled mid-flight change nothing
        assert s.greedy == (s.index % 2 == 0) and 1 <= len(s.output_ids) <= GEN["max_new_tokens"]
    assert any(s.output_ids != generate(model, [(s.index, s.prompt_ids)], **{**GEN, "seed": 4})[0].output_ids
               for s in batched if not s.greedy)  # the seed matters for sampled prompts


def test_temperature_zero_makes_every_sample_greedy(tiny):
    _, model = tiny
    samples = generate(model, prompts(4), batch_size=4, **{**GEN, "temperature": 0.0})
    assert [s.greedy for s in samples] == [True] * 4
    mixed = {s.index: s for s in generate(model, prompts(4), batch_size=4, **GEN)}
    for s in samples:  # the even prompts were greedy before too: the same continuation
        assert mixed[s.index].greedy == (s.index % 2 == 0)
        if s.index % 2 == 0:
            assert s.output_ids == mixed[s.index].output_ids


def test_greedy_continuations_equal_hf_generate(tiny):
    from tests.reference import HFReference, check_greedy_match

    path, model = tiny
    ref = HFReference(path, frozenset({0}))
    for s in generate(model, prompts(4), batch_size=4, **GEN):
        if s.greedy:
            check_greedy_match(s.output_ids, ref.greedy(s.prompt_ids, GEN["max_new_tokens"]))


def test_extend_samples_stops_at_the_budget_or_deadline_and_resumes(tiny, tmp_path):
    _, model = tiny
    path = tmp_path / "data" / "samples.jsonl"
    lines = []
    got, complete = extend_samples(path, model, prompts(), token_budget=10**6, deadline=0.0,
                                   progress=lines.append, batch_size=2, **GEN)
    assert (got, complete) == ([], False)  # the deadline had passed: nothing generated, not complete
    got, complete = extend_samples(path, model, prompts(), token_budget=30, deadline=math.inf,
                                   progress=lines.append, batch_size=2, **GEN)
    assert complete and 30 <= sum(len(s.token_ids) for s in got) and len(got) < 7
    assert [s.index for s in read_samples(path)] == [s.index for s in got]
    more, complete = extend_samples(path, model, prompts(), token_budget=10**6, deadline=math.inf,
                                    progress=lines.append, batch_size=2, **GEN)
    assert complete and sorted(s.index for s in more) == list(range(7))  # each prompt once
    assert len(read_samples(path)) == 7 and any("generated tok/s" in line for line in lines)
    # other prompts at the same indices (another prompt file, another corpus): refused, not mixed in
    changed = [(i, ids[:-1] + [ids[-1] + 1]) if i == 3 else (i, ids) for i, ids in prompts()]
    with pytest.raises(InvalidRequestError, match=r"1 of its samples answer other prompts .*\(first: prompt 3\)"):
        extend_samples(path, model, changed, token_budget=10**6, deadline=math.inf, progress=lines.append, **GEN)
    with pytest.raises(InvalidRequestError, match="answer other prompts"):  # fewer prompts than samples
        extend_samples(path, model, prompts()[:5], token_budget=10**6, deadline=math.inf, progress=lines.append, **GEN)
