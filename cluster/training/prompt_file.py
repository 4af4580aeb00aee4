"""Operators' own prompts for ``specserve train-draft --prompts``: a head trained on prompts shaped
like the traffic it will draft for.

Owns: reading a JSONL file, or every ``*.jsonl`` of a directory, of prompt rows in the format
``specserve generate --prompts`` and ``specserve map --traffic`` read
(``cluster.common.prompt_rows.read_checked_rows``: a bad row is reported with its file and line
and skipped), which rows can be used, and encoding
each as the service would: ``prompt`` with ``chat`` true through the chat template, ``prompt``
alone as raw text (a completion), ``messages`` through the chat template over the conversation.
Skipped, and counted by reason: a row with ``json_schema``, ``regex`` or ``grammar`` (train-draft generates
without a grammar, so the answer it would train on is not the one the service gives), a row
equal to or sharing a run of words with a benchmark workload prompt (the corpus' held-out rule,
``prompt_corpus.workload_overlap``), a duplicate, a row the target cannot encode (a chat row for a
target without a chat template). Each prompt's source is ``prompts:<segment>``, so the held-out
report gives α per segment of the operator's traffic.
Ignores: the rows' ``max_tokens`` and sampling settings (``--max-new-tokens`` and ``--temperature``
set how the target answers, and the command says so), and prompts longer than the recipe's
``max_prompt_tokens`` (the command drops those with every source's).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from cluster.common.errors import InvalidRequestError, UserFacingError
from cluster.common.prompt_rows import read_checked_rows
from cluster.models.tokenizer import row_token_ids
from cluster.training.prompt_corpus import workload_overlap

SOURCE_PREFIX = "prompts:"


@dataclass(slots=True)
class PromptFile:
    """The usable prompts of a file, in file order, and what was left out."""

    prompts: list[tuple[str, list[int]]]  # (source ``prompts:<segment>``, token ids)
    skipped: Counter = field(default_factory=Counter)  # reason -> rows
    bad_rows: list[str] = field(default_factory=list)  # "file:line: reason"

    def summary(self) -> str:
        parts = [f"{len(self.prompts)} prompts"]
        parts += [f"{n} {reason}" for reason, n in sorted(self.skipped.items())]
        if self.bad_rows:
            parts.append(f"{len(self.bad_rows)} bad rows (first: {self.bad_rows[0]})")
        return ", ".join(parts)


def _texts(row: dict) -> list[str]:
    if "messages" in row:
        return [m["content"] for m in row["messages"]]
    return [row["prompt"]]


def read_prompt_file(path: Path, tokenizer, workloads: Path | None) -> PromptFile:
    """The usable prompts of ``path`` (a file or a directory of ``*.jsonl``); UserFacingError when
    none is usable, saying why the rows were left out."""
    try:
        read = read_checked_rows(Path(path), what="prompt")
    except UserFacingError as exc:
        raise UserFacingError(f"--prompts {path}: {exc}") from None
    overlaps = workload_overlap(workloads)
    out = PromptFile([], bad_rows=[str(b) for b in read.bad])
    seen: set[tuple[int, ...]] = set()
    for row in read.rows:
        if row["constrained"]:
            out.skipped["with json_schema, regex or grammar (generated without a grammar)"] += 1
            continue
        if any(overlaps(text) for text in _texts(row)):
            out.skipped["overlapping a benchmark workload prompt"] += 1
            continue
        try:
            ids = row_token_ids(tokenizer, row)
        except InvalidRequestError as exc:
            out.skipped[f"not encodable ({exc})"] += 1
            continue
        if tuple(ids) in seen:
            out.skipped["duplicate"] += 1
            continue
        seen.add(tuple(ids))
        out.prompts.append((SOURCE_PREFIX + row["segment"], ids))
    if not out.prompts:
        raise UserFacingError(f"--prompts {path}: no usable prompt ({out.summary()})")
    return out
