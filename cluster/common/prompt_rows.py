"""Prompt rows: the JSONL format of workload files (``../shared/workloads/*.jsonl``) that
``specserve generate --prompts``, ``specserve bench`` and ``specserve map`` read.

Owns: parsing one row and reading a file of them (id, segment, chat, prompt, max_tokens), with
an ``InvalidRequestError`` that names the file and line. Ignores: tokenizing a row
(``cluster.models.tokenizer.prompt_token_ids``).
"""
from __future__ import annotations

import json
from pathlib import Path

from cluster.common.errors import InvalidRequestError


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
