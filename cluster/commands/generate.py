"""`specserve generate`: run prompts through the engine (all concurrently) and print or write
the results. One prompt prints its text; ``--prompts FILE.jsonl --out OUT.jsonl`` writes one row
per prompt with token ids, text, finish reason, timing and speculation stats. A row's constraint
(``json_schema``, ``regex`` or ``grammar``) is enforced, and its sampling keys (``temperature``,
``top_p``, ``top_k``, ``seed``, ``stop``) win over the flags, which are the defaults."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cluster.commands.common import add_engine_args, engine_config
from cluster.common.errors import InvalidRequestError
from cluster.common.prompt_rows import DEFAULT_SEGMENT, read_prompt_rows, row_constraint
from cluster.common.request import GenerationRequest, SamplingParams
from cluster.models.tokenizer import prompt_token_ids


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text locally (no service)")
    p.add_argument("prompt", nargs="?", help="a single prompt (raw text completion)")
    p.add_argument("--chat", action="store_true", help="wrap the single prompt in the chat template")
    p.add_argument("--prompts", type=Path, help="JSONL file of prompt rows")
    p.add_argument("--out", type=Path, help="JSONL output (with --prompts)")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None, help="override each row's max_tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if bool(args.prompt) == bool(args.prompts):
        raise InvalidRequestError("give either a PROMPT or --prompts FILE.jsonl")
    if args.prompts and not args.out:
        raise InvalidRequestError("--prompts needs --out OUT.jsonl")
    from cluster.engine.async_engine import build_engine

    rows = ([{"id": "prompt", "prompt": args.prompt, "chat": args.chat}] if args.prompt
            else read_prompt_rows(args.prompts, args.limit))
    engine = build_engine(engine_config(args))
    results = run_rows(engine, rows, args)
    if args.prompt:
        print(results[0]["text"])
        return 0
    with open(args.out, "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(results)} rows to {args.out}", file=sys.stderr)
    return 0


def run_rows(engine, rows: list[dict], args: argparse.Namespace) -> list[dict]:
    """Submit every row at once and step the engine until all finish."""
    t0 = time.monotonic()
    by_id: dict[str, dict] = {}
    for row in rows:
        ids = prompt_token_ids(engine.tokenizer, row)
        max_tokens = args.max_tokens or int(row.get("max_tokens") or 128)
        own = {key: row[key] for key in ("temperature", "top_p", "top_k", "seed", "stop") if row.get(key) is not None}
        flags = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)
        sampling = flags | own
        params = SamplingParams(max_tokens=max_tokens, temperature=float(sampling["temperature"]),
                                top_p=float(sampling["top_p"]), top_k=int(sampling["top_k"]), seed=sampling["seed"],
                                stop=tuple(sampling["stop"]))
        rid = str(row["id"])
        try:
            engine.add_request(GenerationRequest(rid, ids, params, segment=str(row.get("segment", DEFAULT_SEGMENT)),
                                                 arrival_time=t0, constraint=row_constraint(row)))
        except InvalidRequestError as exc:  # which row, not only what is wrong with it
            raise InvalidRequestError(f"row {rid!r}: {exc}") from None
        by_id[rid] = {"id": rid, "segment": row.get("segment"), "prompt": row["prompt"], "chat": bool(row.get("chat")),
                      "prompt_token_ids": ids,
                      "output_token_ids": [], "text": "", "finish_reason": None,
                      "timing": {}, "_first": None}
    while engine.has_work():
        for out in engine.step():
            r = by_id[out.request_id]
            if out.new_token_ids and r["_first"] is None:
                r["_first"] = time.monotonic() - t0
            r["output_token_ids"] += out.new_token_ids
            r["text"] += out.text_delta
            if out.finished:
                e2e = time.monotonic() - t0
                n = len(r["output_token_ids"])
                r["finish_reason"] = out.finish_reason.value
                if out.error:  # finish_reason "error": what failed, for this row alone
                    r["error"] = out.error
                r["timing"] = {"queue_s": round(out.queue_time, 4), "ttft_s": round(r["_first"] or e2e, 4),
                               "e2e_s": round(e2e, 4),
                               "tpot_s": round((e2e - (r["_first"] or e2e)) / max(n - 1, 1), 5)}
                if out.spec is not None:
                    r["spec"] = out.spec.to_dict()
    for r in by_id.values():
        r.pop("_first")
    return list(by_id.values())
