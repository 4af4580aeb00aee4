"""Shared fixtures: the real default model (loaded once per session), the HF reference, and
tiny random Llama-family models for fast unit tests."""
from __future__ import annotations

import json
import os

import pytest
import torch

# One torch thread per test process: ``make test TEST_WORKERS=2`` runs two pytest workers on two
# cores (xdist), and two OpenMP pools of two threads each on two cores spin at each other's barriers
# (the single-process suite already ran on one: two test modules set it at import).
torch.set_num_threads(int(os.environ.get("SPECSERVE_TEST_THREADS", "1")))

pytest_plugins = ["tests.time_budget", "tests.worker_groups", "tests.profiles"]


def pytest_addoption(parser):
    """The chaos suite's options (tests/chaos), registered here so that they are known however
    pytest is started (an option of a nested conftest only exists when that folder is named)."""
    group = parser.getgroup("chaos")
    group.addoption("--fuzz-examples", type=int, default=None,
                    help="hypothesis examples against the FakeEngine app (default: the CI profile, "
                         "tests/chaos/conftest.py); the real-model fuzz runs a seventh of it, at least 30")
    group.addoption("--chaos-report", default=None, help="write the chaos suite's figures as JSON here")
    parser.getgroup("specserve").addoption(
        "--profile", choices=("short", "long"), default="short",
        help="short (make test, CI): each claim checked once on a set sized to run in minutes; long "
             "(make test-long): the long profiles too — tests marked `long` and the bigger prompt sets "
             "and matrices tests size with the `profile` fixture (tests/profiles.py)")
    group.addoption("--grammar-examples", type=int, default=None,
                    help="constraints the mask-matcher agreement property generates (default: the CI "
                         "profile in tests/engine/test_grammar_agreement.py; tests/chaos runs at least 500)")


@pytest.fixture(scope="session")
def serve_shared():
    """One Ray + Serve session shared by the ``ray`` modules that only deploy apps and send requests
    (``tests.deployments.harness.SharedServe``); ``tests.worker_groups`` runs them one after another."""
    from tests.deployments.harness import SHARED

    yield SHARED
    SHARED.close()


@pytest.hookimpl(trylast=True)  # after the module's own fixtures (its apps) are torn down
def pytest_runtest_teardown(item, nextitem):
    """Close the shared Serve session as soon as the next test does not use it: a module that starts
    Ray its own way must not find it running."""
    if "serve_shared" in item.fixturenames and (nextitem is None or "serve_shared" not in nextitem.fixturenames):
        from tests.deployments.harness import SHARED

        SHARED.close()


@pytest.fixture(scope="session")
def default_model_dir():
    from cluster.models.loader import resolve_model

    return resolve_model("default").path


@pytest.fixture(scope="session")
def default_model(default_model_dir):
    """The default model loaded once; engines built on it share the weights."""
    from cluster.common.config import EngineConfig
    from cluster.models.load import load_model

    return load_model("default", EngineConfig())


@pytest.fixture(scope="session")
def hf_reference(default_model_dir, default_model, tmp_path_factory, worker_id):
    """HF ``generate`` on the default model; under xdist the run's workers share what they computed
    (the folder above each worker's own temporary folder is the run's)."""
    from tests.reference import HFReference

    run_dir = tmp_path_factory.getbasetemp()
    share = (run_dir.parent if worker_id != "master" else run_dir) / "hf-reference"
    return HFReference(default_model_dir, default_model.eos_token_ids, share_dir=share)


@pytest.fixture(scope="session")
def tokenizer_files(default_model_dir):
    return default_model_dir


def make_tiny_model_dir(path, model_type: str = "llama", tokenizer_dir=None, **overrides):
    """A tiny random model of the given family saved as an HF directory (config + safetensors
    [+ the default tokenizer so engines can detokenize])."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    cfg_cls, model_cls = classes[model_type]
    kw = dict(vocab_size=49152 if tokenizer_dir else 512, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-5)
    kw.update(overrides)
    if model_type == "mistral":
        kw["sliding_window"] = None
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kw)).eval()
    model.save_pretrained(str(path))
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            src = tokenizer_dir / name
            if src.exists():
                (path / name).write_bytes(src.read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == model_type
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_model_dir):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama", tokenizer_dir=default_model_dir)
