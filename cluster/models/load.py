"""Load a model source into a runnable ``LoadedModel``: our native runner for the Llama family, the
Hugging Face fallback runner for everything else (MoE included).

Owns: ``LoadedModel`` (what engines and drafters share about one loaded model), the choice of
runner, dtype, KV pool sizing inputs, tokenizer and EOS ids. Ignores: the model-source grammar
(``cluster.models.loader``) and the forward passes themselves.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.common.config import DType, EngineConfig
from cluster.common.errors import ModelLoadError
from cluster.models.hf_runner import HFRunner
from cluster.models.llama import SUPPORTED_MODEL_TYPES, LlamaModel
from cluster.models.loader import resolve_model
from cluster.models.runner import ModelRunner
from cluster.models.tokenizer import eos_token_ids, load_tokenizer


@dataclass(slots=True)
class LoadedModel:
    """What engines and drafters share about one loaded target model."""

    name: str
    path: object  # pathlib.Path of the HF directory
    runner: object  # ModelRunner or HFRunner
    tokenizer: object
    eos_token_ids: frozenset[int]
    hf_config: dict
    dtype: str

    def with_fresh_kv(self, config: EngineConfig, num_blocks: int | None = None) -> "LoadedModel":
        """The same weights behind a new native runner with its own KV pool (several engines,
        e.g. plain and speculative side by side, on one loaded model)."""
        runner = ModelRunner(self.runner.model, num_blocks, config.block_size, config.kv_cache_memory_mb)
        return LoadedModel(self.name, self.path, runner, self.tokenizer, self.eos_token_ids,
                           self.hf_config, self.dtype)


def load_model(source: str, config: EngineConfig, *, num_blocks: int | None = None,
               device: str = "cpu") -> LoadedModel:
    """``device`` (a torch device name, e.g. ``cuda:0``) holds a Llama-family model's weights and KV
    storage; the engines run on ``cpu`` (their sampling, drafters and kernels are CPU ones), and
    ``specserve train-draft`` asks for a GPU where there is one."""
    md = resolve_model(source)
    hf_config = md.config()
    dtype: DType = config.dtype  # type: ignore[assignment]
    blocks = num_blocks if num_blocks is not None else config.num_kv_blocks
    native = hf_config.get("model_type") in SUPPORTED_MODEL_TYPES
    if not native and torch.device(device).type != "cpu":
        raise ModelLoadError(f"model {source!r} runs on the Hugging Face fallback, which runs on the CPU only "
                             f"(asked for {device})")
    try:
        if native:
            runner = ModelRunner(LlamaModel.load(md.path, dtype.torch, device), blocks, config.block_size,
                                 config.kv_cache_memory_mb)
        else:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(str(md.path), dtype=dtype.torch)
            runner = HFRunner(hf, blocks, config.block_size, config.kv_cache_memory_mb)
        tokenizer = load_tokenizer(md.path)
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 (whatever fails, the caller gets one ModelLoadError naming it)
        raise ModelLoadError(f"cannot load model {source!r} from {md.path}: {type(exc).__name__}: {exc}") from None
    return LoadedModel(
        name=md.name,
        path=md.path,
        runner=runner,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(tokenizer, md.path),
        hf_config=hf_config,
        dtype=dtype.value,
    )
