"""Arguments shared by commands that build an engine (model, dtype, drafter, K, threads)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from cluster.engine.config import EngineConfig, SpecConfig
from cluster.engine.request import InvalidRequestError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="default | HF model dir | .gguf file | hub id")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--draft", default=None,
                   help="enable speculation: ngram | suffix | portfolio | self[:L] | a draft model spec (same vocabulary)")
    p.add_argument("--num-spec-tokens", default="auto", help="K, or 'auto' for adaptive K")
    p.add_argument("--draft-vocab-trim", type=int, default=None, help="keep N ids in the draft LM head")
    p.add_argument("--force-vocab-mismatch", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--kv-cache-mb", type=int, default=512)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    spec = None
    if args.draft and args.draft.lower() != "none":
        spec = SpecConfig(drafter=args.draft, num_spec_tokens=args.num_spec_tokens,
                          draft_vocab_trim=args.draft_vocab_trim,
                          force_vocab_mismatch=args.force_vocab_mismatch)
    return EngineConfig(model=args.model, dtype=args.dtype, spec=spec, torch_threads=args.threads,
                        max_num_seqs=args.max_num_seqs, kv_cache_memory_mb=args.kv_cache_mb)


def parse_prompt_row(line: str, where: str) -> dict:
    """One JSONL prompt row (``where``: ``file:line`` for the message); InvalidRequestError says
    what is wrong. A row carries a string 'prompt' or, for ``specserve map``, a 'messages' list."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{where}: not JSON: {exc}") from None
    if not isinstance(row, dict) or not (isinstance(row.get("prompt"), str) or "messages" in row):
        raise InvalidRequestError(f"{where}: each row needs a string 'prompt'")
    return row


def read_prompt_rows(path: Path, limit: int | None = None) -> list[dict]:
    """Rows like shared/workloads/*.jsonl: id, segment, chat, prompt, max_tokens (optional)."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = parse_prompt_row(line, f"{path}:{n}")
            if not isinstance(row.get("prompt"), str):
                raise InvalidRequestError(f"{path}:{n}: each row needs a string 'prompt'")
            row.setdefault("id", f"row-{n}")
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    return rows


def prompt_token_ids(tokenizer, row: dict) -> list[int]:
    from cluster.models.tokenizer import chat_token_ids

    if row.get("chat"):
        return chat_token_ids(tokenizer, [{"role": "user", "content": row["prompt"]}])
    return [int(t) for t in tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]]
