"""Start-up step-cost calibration: real timings of the target, KV left untouched."""
import torch

from cluster.models.llama import LlamaModel
from cluster.models.runner import ModelRunner
from cluster.speculative.calibration import measure_step_costs
from tests.conftest import make_tiny_model_dir


def test_measures_decode_and_slope_and_frees_kv(tmp_path):
    runner = ModelRunner(LlamaModel.load(make_tiny_model_dir(tmp_path, "llama"), torch.float32), 32, 4)
    costs = measure_step_costs(runner, max_draft_tokens=5, context=40)
    assert 0 < costs.decode_s < 1.0 and costs.slope_ratio >= 0.0
    assert runner.kv.num_free_blocks == runner.kv.num_blocks and not runner.kv.has("__specserve_calibration__")


def test_adaptive_controller_is_seeded_with_measured_costs(tmp_path):
    from cluster.common.config import EngineConfig, SpecConfig
    from cluster.engine.speculation import build_spec_controller
    from cluster.models.load import LoadedModel

    path = make_tiny_model_dir(tmp_path, "llama")
    runner = ModelRunner(LlamaModel.load(path, torch.float32), 32, 4)
    model = LoadedModel("tiny", path, runner, None, frozenset(), {"model_type": "llama"}, "float32")
    ctl = build_spec_controller(EngineConfig(spec=SpecConfig(drafter="ngram", num_draft_tokens="auto")), model)
    a, b = ctl.adaptive.costs.coefficients
    assert a > 0 and b >= 0 and ctl.adaptive.costs.target_a_prior < 1.0
    fixed = build_spec_controller(EngineConfig(spec=SpecConfig(drafter="ngram", num_draft_tokens=3)), model)
    assert fixed.adaptive is None
