"""`specserve bench decode`'s verification cost: one forward of n new tokens over a 1-token one, for
each n asked, at the prompt's context, leaving no KV behind (the model itself is measured by the
benchmark, not here)."""
from __future__ import annotations

import math

import pytest
import torch

from cluster.bench.decode import verify_cost_ratios
from cluster.models.llama import LlamaModel
from cluster.models.runner import ModelRunner
from tests.conftest import make_tiny_model_dir


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-decode"), "llama", num_hidden_layers=2)
    return ModelRunner(LlamaModel.load(path, torch.float32), 32, 4)


def test_verify_cost_ratios_by_token_count_and_no_kv_left(runner):
    free = runner.kv.num_free_blocks
    prompt = list(range(3, 3 + 12))
    ratios = verify_cost_ratios(runner, prompt, reps=1, counts=(2, 6))
    assert sorted(ratios) == [2, 6] and all(math.isfinite(r) and r > 0 for r in ratios.values())
    assert runner.kv.num_free_blocks == free and not runner.kv.has("verify-bench")
