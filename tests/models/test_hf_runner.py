"""The Hugging Face fallback runner (architectures outside our Llama family, MoE included):
same interface, same tokens as HF generate, rollback, and the MoE gate keeps speculation off."""
from __future__ import annotations

import torch

from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.request import GenerationRequest, SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.speculation import build_spec_controller
from cluster.models.hf_runner import HFRunner
from cluster.models.load import load_model
from tests.engine.helpers import run_to_completion


def _tiny_mixtral(path, tokenizer_dir):
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).eval().save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tokenizer_dir / name).read_bytes())
    return path


def test_moe_target_runs_on_fallback_and_matches_hf(tmp_path, default_model_dir):
    from transformers import AutoModelForCausalLM

    path = _tiny_mixtral(tmp_path / "moe", default_model_dir)
    config = EngineConfig(model=str(path), spec=SpecConfig(drafter="ngram", num_draft_tokens=3))
    model = load_model(str(path), config)
    assert isinstance(model.runner, HFRunner)
    engine = LLMEngine(config, model, build_spec_controller(config, model))
    assert engine.stats().moe and not engine.stats().moe_gate_open
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [100, 200, 300], [42] * 11]
    reqs = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=10, ignore_eos=True)) for i, p in enumerate(prompts)]
    res = run_to_completion(engine, reqs)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for r, p in zip(reqs, prompts):
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.int64),
                          max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert res[r.request_id]["ids"] == ref
        assert res[r.request_id]["spec"].draft_tokens == 0  # MoE gate closed: no speculation
    assert model.runner.kv.num_free_blocks == model.runner.kv.num_blocks
    # once validated, the MoE target speculates on the fallback runner, still losslessly
    validated = EngineConfig(model=str(path), spec=SpecConfig(drafter="ngram", num_draft_tokens=3, moe_validated=True))
    engine = LLMEngine(validated, model, build_spec_controller(validated, model))
    reqs = [GenerationRequest(f"v{i}", p, SamplingParams(max_tokens=10, ignore_eos=True)) for i, p in enumerate(prompts)]
    spec_res = run_to_completion(engine, reqs)
    assert sum(spec_res[r.request_id]["spec"].draft_tokens for r in reqs) > 0
    for i, r in enumerate(reqs):
        assert spec_res[r.request_id]["ids"] == res[f"r{i}"]["ids"]


def test_fallback_rollback_recomputes_exactly(tmp_path, default_model_dir):
    from cluster.models.runner import SeqChunk

    path = _tiny_mixtral(tmp_path / "moe", default_model_dir)
    runner = load_model(str(path), EngineConfig(model=str(path))).runner
    toks = list(range(10, 30))
    runner.forward([SeqChunk("s", toks, 0, 1)])
    runner.forward([SeqChunk("s", [1, 2, 3], 20, 3)])  # draft positions, then roll back
    runner.truncate("s", 20)
    a = runner.forward([SeqChunk("s", [7], 20, 1)])
    runner.free("s")
    b = runner.forward([SeqChunk("s", toks + [7], 0, 1)])
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
