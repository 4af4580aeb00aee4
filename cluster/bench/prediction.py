"""`specserve bench prediction`: what a request's predicted output buys, side by side with the
drafter alone and with plain decoding.

Owns: per workload prompt, the target's greedy answer (plain decoding, timed: the ``plain`` row),
then, in round-robin order, the service's drafter (``--drafter``, default the portfolio) with no
prediction (``drafter``) and with each kind of prediction a client might send —
``exact``: the answer itself (a client re-asking a question it has the answer to, the upper bound);
``drift``: the answer with every ``--drift``-th token changed (an answer the client half knows);
``original`` (edit rows only): the code the prompt asks to rewrite, what an editing client sends.
Each run is one greedy request through an ``LLMEngine`` on the real target (``run_ours``), its
output checked against the plain answer (lossless: any difference is reported, and fails the run),
in a draft scope of its own per round and method so that no run drafts from another's answer.
Reported per segment and method: tokens/s and its ratio to the ``drafter`` row of the same prompt
and round (medians over prompts and rounds, and over pooled tokens), α, and the prediction's kept
tokens (``prediction_overlap``). Prints a table and writes JSON.
Ignores: concurrency (one request at a time), sampling.
"""
from __future__ import annotations

import argparse
import sys
import time

from cluster.bench.side_by_side import add_side_by_side_arguments, load_target, median, report, write_report

KINDS = ("exact", "drift", "original")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_side_by_side_arguments(p, "edit,code,chat", "the engine's drafter (K: auto)")
    p.add_argument("--drift", type=int, default=8, help="the drift prediction changes every N-th token (default 8)")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def original_code(row: dict) -> str:
    """An edit row's code: the prompt after its instruction (the first blank line); "" for others."""
    if row.get("segment") != "edit":
        return ""
    _, sep, code = row["prompt"].partition("\n\n")
    return code if sep else ""


def predictions(kind_list: list[str], answer: list[int], row: dict, tokenize, vocab: int, drift: int) -> dict:
    """kind -> the prediction's token ids, for the kinds this row has."""
    out = {}
    for kind in kind_list:
        if kind == "exact":
            out[kind] = tuple(answer)
        elif kind == "drift":
            out[kind] = tuple(t if (i + 1) % drift else (t + 1) % vocab for i, t in enumerate(answer))
        elif kind == "original" and original_code(row):
            out[kind] = tuple(tokenize(original_code(row)))
    return out


def run(args: argparse.Namespace) -> int:
    from cluster.bench.timed_run import engine_for, request_for, run_ours
    from cluster.common.config import SpecConfig
    from cluster.common.prompt_rows import read_prompt_rows
    from cluster.models.tokenizer import prompt_token_ids
    from cluster.speculative.prediction import prediction_overlap

    if args.drift < 2:
        _log("--drift must be at least 2")
        return 2
    target, segments = load_target(args)
    tok = target.tokenizer

    def tokenize(text: str) -> list[int]:
        return [int(t) for t in tok(text, add_special_tokens=False)["input_ids"]]

    plain_engine = engine_for(target)
    engine = engine_for(target, SpecConfig(drafter=args.drafter, num_draft_tokens="auto"))
    methods = ["drafter", *KINDS]
    runs: list[dict] = []
    mismatches = []
    t_start = time.perf_counter()
    for rnd in range(args.rounds):
        for seg in segments:
            for row in read_prompt_rows(args.workloads / f"{seg}.jsonl", args.prompts_per_segment):
                ids = prompt_token_ids(tok, row)
                max_tokens = min(int(row.get("max_tokens", args.max_tokens)), args.max_tokens)
                plain = run_ours(plain_engine, request_for(f"{row['id']}-r{rnd}-plain", ids, max_tokens, seg))
                runs.append(dict(round=rnd, segment=seg, prompt=row["id"], method="plain", tokens=plain.tokens,
                                 wall_s=plain.wall_s))
                preds = predictions(list(KINDS), plain.ids, row, tokenize, target.runner.vocab_size, args.drift)
                order = [m for m in methods if m == "drafter" or m in preds]
                order = order[rnd % len(order):] + order[: rnd % len(order)]  # round-robin start
                for method in order:
                    req = request_for(f"{row['id']}-r{rnd}-{method}", ids, max_tokens, seg)
                    req.draft_scope = f"bench-prediction/r{rnd}/{method}"  # no run drafts from another's answer
                    if method != "drafter":
                        req.prediction_token_ids = preds[method]
                    r = run_ours(engine, req)
                    if r.ids != plain.ids:
                        mismatches.append(req.request_id)
                    kept = prediction_overlap(preds[method], r.ids) if method != "drafter" else None
                    runs.append(dict(round=rnd, segment=seg, prompt=row["id"], method=method, tokens=r.tokens,
                                     wall_s=r.wall_s, draft_tokens=r.draft_tokens, accepted_tokens=r.accepted_tokens,
                                     rejections=r.rejections, drafts=r.drafts, prediction_tokens=len(preds.get(method, ())),
                                     prediction_kept=kept))
                    _log(f"r{rnd} {seg} {row['id']} {method}: {r.tokens / r.wall_s:.1f} tok/s "
                         f"(plain {plain.tokens / plain.wall_s:.1f}) accepted {r.accepted_tokens}/{r.draft_tokens}")
    result = build_report(args, segments, runs, mismatches, time.perf_counter() - t_start)
    return write_report(args, result, format_table(result))


def build_report(args: argparse.Namespace, segments: list[str], runs: list[dict], mismatches: list[str],
                 seconds: float) -> dict:
    """Per segment and method: medians of tokens/s and of the ratio to the same prompt and
    round's ``drafter`` (and ``plain``) run, pooled tokens/s, α, and the prediction's kept share."""
    by_key = {(r["round"], r["prompt"], r["method"]): r for r in runs}
    table: dict[str, dict] = {}
    for seg in segments:
        rows = {}
        for method in ("plain", "drafter", *KINDS):
            mine = [r for r in runs if r["segment"] == seg and r["method"] == method]
            if not mine:
                continue

            def ratio(base: str) -> list[float]:
                out = []
                for r in mine:
                    b = by_key.get((r["round"], r["prompt"], base))
                    if b and r["wall_s"] > 0 and b["wall_s"] > 0:
                        out.append((r["tokens"] / r["wall_s"]) / (b["tokens"] / b["wall_s"]))
                return out

            accepted = sum(r.get("accepted_tokens", 0) for r in mine)
            rejections = sum(r.get("rejections", 0) for r in mine)
            predicted = sum(r.get("prediction_tokens", 0) for r in mine)
            rows[method] = {
                "runs": len(mine),
                "tok_per_s": median([r["tokens"] / r["wall_s"] for r in mine if r["wall_s"] > 0]),
                "pooled_tok_per_s": round(sum(r["tokens"] for r in mine) / sum(r["wall_s"] for r in mine), 2),
                "vs_drafter": median(ratio("drafter")), "vs_plain": median(ratio("plain")),
                "alpha": round(accepted / (accepted + rejections), 3) if accepted + rejections else None,
                "prediction_kept": round(sum(r.get("prediction_kept") or 0 for r in mine) / predicted, 3)
                if predicted else None,
            }
        table[seg] = rows
    return report(args, "prediction", seconds, mismatches, table, runs, drift=args.drift)


def format_table(report: dict) -> str:
    lines = [f"bench prediction: drafter {report['drafter']}, {report['rounds']} round(s); ratios are medians "
             f"over prompts and rounds of tok/s to the same prompt's drafter-alone run; [α] "
             f"{{kept share of the prediction}}; lossless: {report['lossless']}",
             f"{'segment':<10} {'plain tok/s':>11} {'drafter':>14} " + " ".join(f"{k:>22}" for k in KINDS)]
    for seg, rows in report["table"].items():
        def cell(m: str) -> str:
            r = rows.get(m)
            if r is None:
                return "-"
            kept = f" {{{r['prediction_kept']:.2f}}}" if r["prediction_kept"] is not None else ""
            alpha = f" [{r['alpha']:.2f}]" if r["alpha"] is not None else ""
            return f"{r['vs_drafter']:.2f}{alpha}{kept}"
        plain = rows.get("plain", {}).get("tok_per_s")
        d = rows.get("drafter")
        drafter = f"{d['vs_plain']:.2f}x plain [{d['alpha']:.2f}]" if d and d["alpha"] is not None else "-"
        lines.append(f"{seg:<10} {plain or '-':>11} {drafter:>14} " + " ".join(f"{cell(k):>22}" for k in KINDS))
    return "\n".join(lines)
