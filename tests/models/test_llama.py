"""Our Llama-family forward over the block KV cache equals Hugging Face's forward, for every
family we claim (tiny random weights), across ragged chunked prefill and decode — on the native
CPU kernels (RMSNorm, rotary + cache write, paged attention) and on torch's operators alike."""
from __future__ import annotations

import pytest
import torch

from cluster.models.llama import LlamaArch, LlamaModel
from cluster.models.runner import ModelRunner, SeqChunk
from tests.conftest import make_tiny_model_dir


@pytest.mark.parametrize("family,extra", [
    ("llama", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("mistral", {}),
])
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_forward_matches_hf(tmp_path, monkeypatch, family, extra, kernels):
    from transformers import AutoModelForCausalLM

    from cluster.kernels import native, paged_attention, rms_norm, rope_cache

    calls = {"paged_attention": 0, "rms_norm": 0, "rope_qk_cache": 0}
    if kernels == "torch":  # the path of a machine without a compiler (or SPECSERVE_KERNELS=torch)
        for mod in (paged_attention, rms_norm, rope_cache):
            monkeypatch.setattr(mod, "applies", lambda *a: False)
    elif not native.available():
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    else:  # count the calls: the native variant must not pass on torch's path
        for mod, name in ((paged_attention, "paged_attention"), (rms_norm, "rms_norm"), (rope_cache, "rope_qk_cache")):
            def counted(*a, _f=getattr(mod, name), _n=name):
                calls[_n] += 1
                return _f(*a)
            monkeypatch.setattr(mod, name, counted)

    path = make_tiny_model_dir(tmp_path, family, **extra)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ours = LlamaModel.load(path, torch.float32)
    runner = ModelRunner(ours, num_blocks=64, block_size=4)
    g = torch.Generator().manual_seed(1)
    seqs = {f"s{i}": torch.randint(0, 512, (n,), generator=g).tolist() for i, n in enumerate([23, 7, 40])}
    with torch.inference_mode():
        ref = {k: hf(torch.tensor([v])).logits[0] for k, v in seqs.items()}  # [L, V]
    # ragged: s0 prefill in two chunks while s1 prefills whole; then s2 joins; then decode steps
    pos = {k: 0 for k in seqs}
    got: dict[str, list[torch.Tensor]] = {k: [] for k in seqs}

    def run(plan):
        chunks = []
        for k, n in plan:
            toks = seqs[k][pos[k]: pos[k] + n]
            chunks.append(SeqChunk(k, toks, pos[k], len(toks)))
        out = runner.forward(chunks)
        row = 0
        for (k, _), c in zip(plan, chunks):
            got[k].append(out[row: row + len(c.token_ids)])
            row += len(c.token_ids)
            pos[k] += len(c.token_ids)

    run([("s0", 10), ("s1", 7)])
    run([("s0", 13), ("s2", 20)])
    run([("s2", 17)])
    run([("s2", 3)])
    for k in seqs:
        ours_logits = torch.cat(got[k])
        assert ours_logits.shape == ref[k].shape
        torch.testing.assert_close(ours_logits, ref[k], atol=2e-4, rtol=1e-4)
    if kernels == "native":
        assert calls["paged_attention"] and calls["rms_norm"]
        assert bool(calls["rope_qk_cache"]) == (family != "qwen3")  # per-head q/k norms: torch's rotary
    else:
        assert not any(calls.values())


def test_rollback_then_recompute_is_exact(tmp_path):
    path = make_tiny_model_dir(tmp_path, "llama")
    runner = ModelRunner(LlamaModel.load(path, torch.float32), num_blocks=16, block_size=4)
    toks = list(range(1, 30))
    a = runner.forward([SeqChunk("x", toks, 0, 1)])
    runner.forward([SeqChunk("x", [5, 6, 7], 29, 3)])  # speculative tokens, then roll back
    runner.truncate("x", 29)
    assert runner.kv.num_tokens("x") == 29
    b = runner.forward([SeqChunk("x", [9], 29, 1)])
    runner.free("x")
    c = runner.forward([SeqChunk("x", toks + [9], 0, 1)])
    torch.testing.assert_close(b, c, atol=1e-5, rtol=1e-5)
    assert a.shape == (1, 512)


def test_unsupported_family_is_refused():
    from cluster.common.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="not in our Llama family"):
        LlamaArch.from_hf_config({"model_type": "gpt2"})


def test_out_of_vocab_token_raises(tmp_path):
    path = make_tiny_model_dir(tmp_path, "llama")
    runner = ModelRunner(LlamaModel.load(path, torch.float32), num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runner.forward([SeqChunk("x", [1, 512], 0, 1)])


def test_forward_features_are_hf_hidden_states_from_the_same_pass(tmp_path):
    """The runner's feature tap gets HF ``hidden_states[i]`` (the input of layer i) of every fed
    token, across a ragged batch, and the logits are those of the plain forward."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model_dir(tmp_path, "llama", num_hidden_layers=4)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ours = LlamaModel.load(path, torch.float32)
    runner = ModelRunner(ours, num_blocks=32, block_size=4)
    plain = ModelRunner(ours, num_blocks=32, block_size=4)
    layers = (2, 0, 3)

    class Tap:
        feature_layers = layers
        got: list = []

        def record(self, chunks, features):
            self.got.append(([(c.seq_id, c.start_pos, len(c.token_ids)) for c in chunks], features))

    runner.feature_tap = Tap()
    seqs = {"a": list(range(5, 25)), "b": list(range(100, 107))}
    chunks = [SeqChunk("a", seqs["a"][:12], 0, 1), SeqChunk("b", seqs["b"], 0, 3)]
    torch.testing.assert_close(runner.forward(chunks), plain.forward(chunks))
    runner.forward([SeqChunk("a", seqs["a"][12:], 12, 8)])
    with torch.inference_mode():
        ref = {k: hf(torch.tensor([v]), output_hidden_states=True).hidden_states for k, v in seqs.items()}
    rows = {k: [] for k in seqs}
    for spans, feats in Tap.got:
        assert feats.shape == (sum(n for _, _, n in spans), len(layers) * 64)
        row = 0
        for seq_id, _, n in spans:
            rows[seq_id].append(feats[row : row + n])
            row += n
    for k, v in seqs.items():
        want = torch.cat([ref[k][i][0] for i in layers], dim=-1)  # [L, 3H]
        torch.testing.assert_close(torch.cat(rows[k]), want, atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="feature layers"):
        ours.forward_features(runner.build_batch([SeqChunk("b", [1], 7, 1)]), runner.k_cache, runner.v_cache, (4,))
