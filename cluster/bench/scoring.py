"""`specserve bench scoring`: what scoring a text costs (gRPC ``prompt_logprobs`` with
``max_tokens`` 0; OpenAI's ``echo`` with ``max_tokens`` 0) next to prefilling it and to generating it.

Owns: per workload prompt and round, the target's greedy answer to the prompt (``generate``: one
request through a plain ``LLMEngine`` with ``logprobs`` 0, timed), then the prompt followed by that
answer, as token ids, through three requests in a rotating order: ``prefill`` (``max_tokens`` 1,
no prompt log-probabilities: the forward the text costs anyway), ``score0`` (``max_tokens`` 0,
``prompt_logprobs`` 0) and ``score5`` (5 alternatives). Checked: every answer token's scored
log-probability equals the one generation reported for it (2e-3; a larger difference is reported
and fails the run), and how many answer tokens are not their scored position's most likely token
(a near-tie between rows computed in different batch shapes; reported, not failed). Reported per
segment: medians over prompts and rounds of score0 / prefill and score5 / prefill wall time (what
the prompt's rows and log-softmax cost), of score0 / generate (scoring an answer vs producing
it), and pooled scored tokens per second. Prints a table and writes JSON.
Ignores: concurrency (one request at a time), the speculative path (scoring never drafts), the
service's transport of the values.
"""
from __future__ import annotations

import argparse
import sys
import time

from cluster.bench.side_by_side import (add_side_by_side_arguments, load_target, median, prompt_walk, ratio_text,
                                        report, write_report)

VARIANTS = ("prefill", "score0", "score5")
TOL = 2e-3  # float32 log-softmax of rows computed in different batch shapes


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_side_by_side_arguments(p, "code,chat,json", "not used: scoring and the prefill it is compared with run "
                                                    "on the plain path")


def _drive(engine, req) -> tuple[float, list[int], list, list]:
    """(wall seconds, output ids, their log-probabilities, the prompt's) of one request alone."""
    t0 = time.perf_counter()
    engine.add_request(req)
    ids, lps, prompt_lps = [], [], []
    while engine.has_work():
        for out in engine.step():
            ids += out.new_token_ids
            lps += out.logprobs
            prompt_lps += out.prompt_logprobs
    return time.perf_counter() - t0, ids, lps, prompt_lps


def run(args: argparse.Namespace) -> int:
    from cluster.bench.timed_run import engine_for, request_for

    target, segments = load_target(args)
    engine = engine_for(target)
    runs: list[dict] = []
    mismatches: list[str] = []
    t_start = time.perf_counter()
    for rnd, seg, row, ids, max_tokens, order in prompt_walk(args, target, segments, VARIANTS):
        rid = f"{row['id']}-r{rnd}"
        req = request_for(f"{rid}-generate", ids, max_tokens, seg)
        req.params.logprobs = 0
        gen_s, answer, answer_lps, _ = _drive(engine, req)
        text = list(ids) + answer  # the prompt followed by the model's own answer
        walls = {}
        for variant in order:
            req = request_for(f"{rid}-{variant}", text, 1, seg)
            if variant != "prefill":
                req.params.max_tokens, req.params.prompt_logprobs = 0, int(variant[len("score"):])
            walls[variant], _, _, scored = _drive(engine, req)
            if variant == "score5":
                tail = scored[len(ids):]  # the answer's entries
                worst = max((abs(s.chosen.logprob - g.chosen.logprob) for s, g in zip(tail, answer_lps)), default=0.0)
                if len(tail) != len(answer) or worst > TOL:
                    mismatches.append(f"{rid}: scored {len(tail)} of {len(answer)} answer tokens, worst "
                                      f"difference {worst:.2e}")
                not_top = sum(1 for s in tail if s.top and s.top[0].token_id != s.chosen.token_id)
        runs.append(dict(round=rnd, segment=seg, prompt=row["id"], prompt_tokens=len(ids), answer_tokens=len(answer),
                         generate_s=gen_s, not_top=not_top, **{f"{v}_s": walls[v] for v in VARIANTS}))
        print(f"r{rnd} {seg} {row['id']}: {len(text)} tokens scored in {walls['score0'] * 1e3:.0f} ms "
              f"(prefill {walls['prefill'] * 1e3:.0f} ms; generating the {len(answer)}-token answer "
              f"{gen_s * 1e3:.0f} ms)", file=sys.stderr, flush=True)
    result = build_report(args, segments, runs, mismatches, time.perf_counter() - t_start)
    return write_report(args, result, format_table(result))


def build_report(args: argparse.Namespace, segments: list[str], runs: list[dict], mismatches: list[str],
                 seconds: float) -> dict:
    """Per segment (and ``all``): median wall ratios of the scoring requests to the same text's
    prefill and to generating its answer, pooled scored tokens/s, answer tokens not top-1."""
    table: dict[str, dict] = {}
    for seg in [*segments, "all"]:
        mine = [r for r in runs if seg in ("all", r["segment"])]
        scored = sum(r["prompt_tokens"] + r["answer_tokens"] for r in mine)
        table[seg] = {
            "runs": len(mine),
            "score0_vs_prefill": median([r["score0_s"] / r["prefill_s"] for r in mine]),
            "score5_vs_prefill": median([r["score5_s"] / r["prefill_s"] for r in mine]),
            "score0_vs_generate": median([r["score0_s"] / r["generate_s"] for r in mine if r["answer_tokens"]]),
            "scored_tok_per_s": round(scored / sum(r["score0_s"] for r in mine), 1) if mine else None,
            "answer_tokens": sum(r["answer_tokens"] for r in mine),
            "answer_tokens_not_top1": sum(r["not_top"] for r in mine),
        }
    return report(args, "scoring", seconds, mismatches, table, runs)


def format_table(report_: dict) -> str:
    lines = [f"bench scoring: {report_['rounds']} round(s), plain path; medians over prompts and rounds of wall "
             f"time ratios; scored values equal generation's: {report_['lossless']}",
             f"{'segment':<12} {'runs':>4} {'score0/prefill':>15} {'score5/prefill':>15} {'score0/generate':>16} "
             f"{'scored tok/s':>13} {'not top-1':>10}"]

    for seg, c in report_["table"].items():
        lines.append(f"{seg:<12} {c['runs']:>4} {ratio_text(c['score0_vs_prefill']):>15} {ratio_text(c['score5_vs_prefill']):>15} "
                     f"{ratio_text(c['score0_vs_generate']):>16} {c['scored_tok_per_s'] or 0:>13.1f} "
                     f"{c['answer_tokens_not_top1']:>4}/{c['answer_tokens']:<5}")
    return "\n".join(lines)
