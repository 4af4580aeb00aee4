"""`specserve bench decode`: the engine's raw decode speed on this machine, side by side with
Hugging Face ``generate`` and the memory-bandwidth floor.

Measures (medians of interleaved repetitions, same model, dtype and threads):
- batch-1 ms per token: our engine (full step: schedule, forward, sample, postprocess) and HF;
- the floor: bytes of weights read per token / memory read bandwidth measured in this run;
- verify6_cost_ratio: one forward of 6 new tokens for one sequence over one decode forward, and
  the same for 2..8 tokens (``verify_cost_ratio_by_tokens``: what verifying K = 1..7 drafts costs);
- the same batch-1 ms per token and verification ratio with the per-row native kernels (RMSNorm,
  rotary + cache write, paged attention) switched off, interleaved with the rest: what they buy;
- throughput (generated tokens/s) at 1, 4, 8, 16, 32 concurrent sequences.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

VERIFY_COUNTS = (2, 3, 4, 5, 6, 7, 8)  # tokens per verification forward: K = 1..7 draft tokens + 1
PROMPT = ("Explain, step by step, how a hash map handles collisions and what happens when it "
          "grows. Use a short Python example.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--tokens", type=int, default=64, help="decode tokens per batch-1 measurement")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--concurrency", default="1,4,8,16,32")
    p.add_argument("--throughput-tokens", type=int, default=32)
    p.add_argument("--json", type=Path, default=None)


def measure_read_bandwidth(gib: float = 1.0, reps: int = 7) -> float:
    """Bytes/s of a streaming read (sum over a buffer larger than any cache), median."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    x.sum()  # fault the pages in
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times)


def _engine(model, config):
    from cluster.engine.llm_engine import LLMEngine

    return LLMEngine(config, model.with_fresh_kv(config))


def ours_ms_per_token(engine, prompt_ids: list[int], n: int) -> float:
    """Time the decode steps only (prefill step excluded)."""
    from cluster.common.request import GenerationRequest, SamplingParams

    engine.add_request(GenerationRequest(f"b{time.monotonic_ns()}", prompt_ids,
                                         SamplingParams(max_tokens=n + 1, ignore_eos=True)))
    engine.step()  # prefill + first token
    t0 = time.perf_counter()
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    return (time.perf_counter() - t0) / steps * 1000


def hf_ms_per_token(hf, prompt_ids: list[int], n: int) -> float:
    ids = torch.tensor([prompt_ids])
    mask = torch.ones_like(ids)

    def gen(k):
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                        pad_token_id=0)
        return time.perf_counter() - t0

    return (gen(n + 1) - gen(1)) / n * 1000


def verify_cost_ratios(runner, prompt_ids: list[int], reps: int, counts: tuple[int, ...] = VERIFY_COUNTS) -> dict[int, float]:
    """n -> one forward of n new tokens for one sequence over one decode forward (1 token), at
    the prompt's context; each n's forwards interleaved with 1-token ones, medians."""
    from cluster.speculative.calibration import time_forwards

    times = time_forwards(runner, prompt_ids, prompt_ids, (1, *counts), reps * 3, seq_id="verify-bench")
    return {n: times[n] / times[1] for n in counts}


def throughput(engine, prompt_ids: list[int], concurrency: int, n: int) -> float:
    from cluster.common.request import GenerationRequest, SamplingParams

    for i in range(concurrency):
        engine.add_request(GenerationRequest(f"t{concurrency}-{i}-{time.monotonic_ns()}", prompt_ids,
                                             SamplingParams(max_tokens=n, ignore_eos=True)))
    engine.step()  # admit + prefill everyone (one batched step)
    t0 = time.perf_counter()
    produced = 0
    while engine.has_work():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - t0)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    from cluster.common.config import EngineConfig
    from cluster.kernels import native
    from cluster.models.load import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=4096)
    model = load_model(args.model, config)
    hf = AutoModelForCausalLM.from_pretrained(str(model.path), dtype=config.dtype.torch).eval()
    prompt_ids = [int(t) for t in model.tokenizer(PROMPT)["input_ids"]]
    engine = _engine(model, config)
    weight_bytes = model.runner.model.weight_bytes()
    bandwidth = measure_read_bandwidth()
    ours, theirs, torch_ops = [], [], []
    ours_ms_per_token(engine, prompt_ids, 4)  # warm-up
    row_ops = native.row_ops()
    for _ in range(args.reps):  # interleaved so that machine noise hits all
        ours.append(ours_ms_per_token(engine, prompt_ids, args.tokens))
        theirs.append(hf_ms_per_token(hf, prompt_ids, args.tokens))
        if row_ops:
            with native.torch_row_ops():
                torch_ops.append(ours_ms_per_token(engine, prompt_ids, args.tokens))
    verify_by_n = verify_cost_ratios(engine.runner, prompt_ids, args.reps)
    verify = verify_by_n[6]
    if row_ops:
        with native.torch_row_ops():
            verify_torch_ops = verify_cost_ratios(engine.runner, prompt_ids, args.reps, (6,))[6]
    levels = [int(c) for c in args.concurrency.split(",")]
    tput = {c: round(throughput(engine, prompt_ids, c, args.throughput_tokens), 2) for c in levels}
    result = {
        "model": model.name, "dtype": config.dtype.value, "threads": torch.get_num_threads(),
        "ms_per_token": round(statistics.median(ours), 3),
        "hf_ms_per_token": round(statistics.median(theirs), 3),
        "weight_bytes": weight_bytes,
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 3),
        "floor_ms_per_token": round(weight_bytes / bandwidth * 1000, 3),
        "verify6_cost_ratio": round(verify, 3),
        "verify_cost_ratio_by_tokens": {str(n): round(v, 3) for n, v in verify_by_n.items()},
        # the per-row native kernels off (None where they are not built here)
        "torch_row_ops_ms_per_token": round(statistics.median(torch_ops), 3) if torch_ops else None,
        "torch_row_ops_verify6_cost_ratio": round(verify_torch_ops, 3) if row_ops else None,
        "samples_torch_row_ops_ms_per_token": [round(x, 3) for x in torch_ops],
        "throughput_tok_s": tput,
        "samples_ms_per_token": [round(x, 3) for x in ours],
        "samples_hf_ms_per_token": [round(x, 3) for x in theirs],
    }
    r = result
    result["goals"] = {
        "ms_per_token <= 1.5 x floor": [round(r["ms_per_token"] / r["floor_ms_per_token"], 3),
                                        r["ms_per_token"] <= 1.5 * r["floor_ms_per_token"]],
        "ms_per_token <= hf / 1.5": [round(r["hf_ms_per_token"] / r["ms_per_token"], 3), r["ms_per_token"] <= r["hf_ms_per_token"] / 1.5],
        "verify6_cost_ratio <= 1.3": [r["verify6_cost_ratio"], r["verify6_cost_ratio"] <= 1.3],
        "throughput(32) >= 8 x throughput(1)": (
            [round(tput[32] / tput[1], 2), tput[32] >= 8 * tput[1]] if 32 in tput and 1 in tput else None),
    }
    print(f"model {model.name} {config.dtype.value} threads={result['threads']}")
    print(f"batch-1 ms/token: ours {r['ms_per_token']}  HF {r['hf_ms_per_token']}  floor {r['floor_ms_per_token']}"
          f"  (read bandwidth {r['read_bandwidth_gb_s']} GB/s, weights {weight_bytes / 1e6:.1f} MB)")
    print(f"verify 6 tokens / decode 1 token: {r['verify6_cost_ratio']}")
    print("verify n tokens / decode 1 token: " + "  ".join(f"n={n}: {v}" for n, v in r["verify_cost_ratio_by_tokens"].items()))
    if torch_ops:
        print(f"per-row kernels off (torch's operators): ms/token {r['torch_row_ops_ms_per_token']}"
              f" ({r['torch_row_ops_ms_per_token'] / r['ms_per_token']:.2f}x), verify 6 / decode 1"
              f" {r['torch_row_ops_verify6_cost_ratio']}")
    print("throughput tok/s: " + "  ".join(f"c={c}: {v}" for c, v in tput.items()))
    for goal, val in result["goals"].items():
        print(f"  goal {goal}: {val}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0
