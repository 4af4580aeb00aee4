"""The device a model runs on: the names an operator may give (``auto`` picks a GPU where torch
sees one; a device the machine lacks is refused with what it has), and a Llama-family model whose
weights, rotary tables and KV storage live off the CPU — its runner builds each batch on the CPU
and hands every tensor to the model's device. Off-CPU placement is checked on the ``meta`` device
(shapes, no values; like CUDA, it refuses a CPU index or mask beside its tensors, which the
control below shows), and against the CPU's numbers on CUDA where a GPU is present."""
from __future__ import annotations

import pytest
import torch

from cluster.common.errors import InvalidRequestError
from cluster.models import llama
from cluster.models.device import resolve_device
from cluster.models.llama import LlamaModel
from cluster.models.runner import ModelRunner, SeqChunk
from tests.conftest import make_tiny_model_dir

CUDA = torch.cuda.is_available()


def test_auto_takes_a_gpu_only_where_torch_sees_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(InvalidRequestError, match="has 2 CUDA device"):
        resolve_device("cuda:2")


def test_a_device_the_machine_lacks_or_no_device_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InvalidRequestError, match="sees no CUDA device"):
        resolve_device("cuda")
    for name in ("meta", "tpu", "gpu!", ""):
        with pytest.raises(InvalidRequestError, match="auto, cpu, cuda or cuda:N"):
            resolve_device(name)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-device"), "llama")


class _Tap:
    feature_layers = (0, 1)

    def __init__(self) -> None:
        self.features: list[torch.Tensor] = []

    def record(self, chunks, features) -> None:
        self.features.append(features)

    def forget(self, seq_id) -> None:
        pass


# a long prefill (its own attention group), a short prefill and a decode / a verification beside
# them: every kind of group the runner builds
_STEPS = [
    [SeqChunk("a", list(range(1, 30)), 0, 1), SeqChunk("b", [3, 4, 5], 0, 3)],
    [SeqChunk("a", [7, 8, 9], 29, 3), SeqChunk("b", [6], 3, 1), SeqChunk("c", [11, 12], 0, 1)],
]


def _run(model: LlamaModel) -> tuple[list[torch.Tensor], list[torch.Tensor], ModelRunner]:
    runner = ModelRunner(model, num_blocks=32, block_size=4)
    runner.feature_tap = tap = _Tap()
    logits = [runner.forward([SeqChunk(c.seq_id, list(c.token_ids), c.start_pos, c.num_logits) for c in step])
              for step in _STEPS]
    return logits, tap.features, runner


def test_a_model_off_the_cpu_runs_every_batch_kind_where_its_weights_are(tiny_dir):
    model = LlamaModel.load(tiny_dir, torch.float32, "meta")
    assert model.device.type == "meta" and model.embed.device.type == "meta" and model.cos.device.type == "meta"
    logits, features, runner = _run(model)
    assert [tuple(t.shape) for t in logits] == [(4, 512), (5, 512)]
    assert [tuple(t.shape) for t in features] == [(32, 128), (6, 128)]
    assert all(t.device.type == "meta" for t in logits + features + runner.k_cache + runner.v_cache)
    assert runner.kv.num_tokens("a") == 32 and runner.kv.num_tokens("c") == 2


def test_control_a_batch_left_on_the_cpu_is_refused_by_the_meta_device(tiny_dir, monkeypatch):
    """What the test above relies on: were the runner to leave its batch on the CPU, the meta
    device would refuse it (as CUDA does), so the test above could fail."""
    monkeypatch.setattr(llama.ForwardBatch, "to", lambda self, device: self)
    with pytest.raises(RuntimeError, match="device"):
        _run(LlamaModel.load(tiny_dir, torch.float32, "meta"))


@pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
def test_on_cuda_the_runner_gives_the_cpu_s_logits_and_features(tiny_dir):
    cpu_logits, cpu_features, _ = _run(LlamaModel.load(tiny_dir, torch.float32))
    gpu_logits, gpu_features, runner = _run(LlamaModel.load(tiny_dir, torch.float32, "cuda"))
    assert all(t.is_cuda for t in gpu_logits + gpu_features + runner.k_cache)
    for a, b in zip(cpu_logits + cpu_features, gpu_logits + gpu_features):
        torch.testing.assert_close(b.cpu(), a, atol=1e-3, rtol=1e-3)  # TF32 / kernel order differ
