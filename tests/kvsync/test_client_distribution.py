"""Sampling through the remote drafter is exact: unseeded requests on a tiny target, drafted by a
perturbed copy of it served over KVSync (so draft tokens are sometimes accepted, sometimes
rejected and resampled from the residual), produce (first, second) token pairs with the target's
own distribution — chi-square against the exact probabilities from the Hugging Face model. The
second token is the first one the rejection sampler decides (the first comes from the prefill).
Unseeded on purpose: seeded sampling in the engine is another concern (its coupling may change);
the draft side's seed derivation is tested in test_security.py."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from scipy.stats import chisquare

from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.request import GenerationRequest, SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.speculation import build_spec_controller
from cluster.kvsync.budget import DraftBudget
from cluster.kvsync.client import RemoteProposer
from cluster.kvsync.limits import KVSyncLimits
from cluster.kvsync.server import DraftServerCore, start_server
from cluster.models.load import load_model
from cluster.sampling.sampler import logits_to_probs
from cluster.speculative.draft_model import DraftModelProposer
from tests.engine.helpers import run_to_completion

ALPHA = 1e-3  # false-alarm rate of the chi-square test
N = 1200
BATCH = 32
PROMPT = [17, 301, 4242, 99, 1234, 777, 31337, 5]
PARAMS = SamplingParams(max_tokens=3, temperature=0.7, top_k=3)


@pytest.fixture(scope="module")
def draft_dir(tiny_llama_dir, tmp_path_factory):
    """The target's weights plus noise: a draft that agrees often, not always."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("tiny-draft")
    for f in tiny_llama_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    gen = torch.Generator().manual_seed(1)
    for f in tiny_llama_dir.glob("*.safetensors"):
        tensors = load_file(str(f))
        noisy = {k: (t + 0.5 * t.float().std() * torch.randn(t.shape, generator=gen)).to(t.dtype).contiguous()
                 if t.dim() > 1 else t for k, t in tensors.items()}
        save_file(noisy, str(out / f.name), metadata={"format": "pt"})
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 49152
    return out


def exact_pair_probs(target_dir) -> dict[tuple[int, int], float]:
    """P(t1, t2) for the request's params, from the Hugging Face model (not our runner)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = logits_to_probs(hf(torch.tensor([PROMPT])).logits[:, -1].float(), PARAMS)[0]  # [V]
        pairs = {}
        for t1 in torch.nonzero(p1).flatten().tolist():
            p2 = logits_to_probs(hf(torch.tensor([PROMPT + [t1]])).logits[:, -1].float(), PARAMS)[0]
            for t2 in torch.nonzero(p2).flatten().tolist():
                pairs[(t1, t2)] = float(p1[t1] * p2[t2])
    return pairs


def test_remote_draft_sampling_has_the_target_distribution(tiny_llama_dir, draft_dir):
    limits = KVSyncLimits(max_draft_tokens=2, max_batch=BATCH)
    config = EngineConfig(model=str(tiny_llama_dir), spec=SpecConfig(drafter="remote", num_draft_tokens=2),
                          kv_cache_memory_mb=32, max_num_seqs=BATCH)
    draft = load_model(str(draft_dir), EngineConfig(model=str(draft_dir), kv_cache_memory_mb=32))
    core = DraftServerCore(DraftModelProposer(draft.runner), vocab_size=draft.runner.vocab_size, limits=limits)
    server, port = start_server(core)
    # a budget that always waits: this test is about the distribution, not the deadline
    remote = RemoteProposer(f"127.0.0.1:{port}", limits=limits, budget=DraftBudget(floor_s=30.0, cap_s=30.0))
    try:
        target = load_model(str(tiny_llama_dir), config)
        engine = LLMEngine(config, target, build_spec_controller(config, target, remote))
        counts: dict[tuple[int, int], int] = {}
        drafted = accepted = 0
        for start in range(0, N, 4 * BATCH):
            reqs = [GenerationRequest(f"r{i}", list(PROMPT), PARAMS) for i in range(start, min(N, start + 4 * BATCH))]
            for r in run_to_completion(engine, reqs).values():
                counts[tuple(r["ids"][:2])] = counts.get(tuple(r["ids"][:2]), 0) + 1
                drafted += r["spec"].draft_tokens
                accepted += r["spec"].accepted_tokens
        assert engine.stats().draft_fallbacks == 0 and remote.num_failures == 0
    finally:
        remote.close()
        server.stop(0)
    # the remote drafter really drafted, with both outcomes of the acceptance test
    assert drafted >= N and 0 < accepted < drafted, (drafted, accepted)
    pvalue = assert_target_pair_distribution(counts, tiny_llama_dir)
    print(f"α = {accepted}/{drafted}; chi-square p = {pvalue:.3f}")


def assert_target_pair_distribution(counts: dict[tuple[int, int], int], target_dir) -> float:
    """Chi-square of sampled (first, second) token pairs against the exact probabilities; the p-value."""
    exact = exact_pair_probs(target_dir)
    assert set(counts) <= set(exact), set(counts) - set(exact)
    keys = sorted(exact)
    observed = torch.tensor([counts.get(k, 0) for k in keys], dtype=torch.float64)
    expected = torch.tensor([exact[k] for k in keys], dtype=torch.float64)
    stat = chisquare(observed.numpy(), expected.numpy() * (observed.sum() / expected.sum()).item())
    assert stat.pvalue > ALPHA, f"chi-square p={stat.pvalue:.2e}: {observed.tolist()} vs {expected.tolist()}"
    return float(stat.pvalue)


def test_remote_draft_q_carries_min_p(draft_dir):
    """The request's min_p reaches the DraftServer: q of each remote draft position equals the
    draft model's own probabilities under the request's parameters (Hugging Face's logits, our
    filter), min_p's cut included — the target verifies against a q that really was drafted from."""
    import transformers

    params = SamplingParams(max_tokens=3, temperature=1.0, min_p=0.3)
    limits = KVSyncLimits(max_draft_tokens=2, max_batch=4)
    draft = load_model(str(draft_dir), EngineConfig(model=str(draft_dir), kv_cache_memory_mb=32))
    core = DraftServerCore(DraftModelProposer(draft.runner), vocab_size=draft.runner.vocab_size, limits=limits)
    server, port = start_server(core)
    remote = RemoteProposer(f"127.0.0.1:{port}", limits=limits, budget=DraftBudget(floor_s=30.0, cap_s=30.0))
    try:
        from cluster.speculative.types import ProposeInput

        out = remote.propose([ProposeInput("s", list(PROMPT), 2, params)])
    finally:
        remote.close()
        server.stop(0)
    tokens, q = out.draft_token_ids[0], out.draft_probs[0]  # q [2, V]
    assert len(tokens) == 2 and q.shape == (2, draft.runner.vocab_size)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(draft_dir), torch_dtype=torch.float32).eval()
    uncut = SamplingParams(max_tokens=3, temperature=1.0)
    for j in range(2):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + tokens[:j]])).logits[:, -1].float()  # [1, V]
        want, full = logits_to_probs(logits, params)[0], logits_to_probs(logits, uncut)[0]
        assert int((want > 0).sum()) < int((full > 0).sum())  # the cut removes tokens here
        assert torch.allclose(q[j], want, atol=1e-5), (j, (q[j] > 0).sum(), (want > 0).sum())
        assert q[j][tokens[j]] > 0
