"""The user's traffic sample for ``specserve map``: JSONL rows read, checked and grouped by segment.

Owns: reading a file or every ``*.jsonl`` of a directory (sorted, so a run is reproducible), the
row format of ``specserve generate --prompts`` (``prompt`` with optional ``chat``, or
``messages``; ``segment``; ``max_tokens``; optional ``json_schema`` / ``regex``; sampling
``temperature`` / ``top_p`` / ``top_k`` / ``seed`` / ``stop``), checking each row and reporting a
bad one with its file and line instead of stopping, the default segment for rows without one,
and a seeded sample per segment (``--quick``). Ignores: tokenization (the engines do it) and
what the rows are used for (profile, sweep).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from cluster.common.errors import InvalidRequestError, UserFacingError
from cluster.common.prompt_rows import parse_prompt_row
from cluster.common.request import SamplingParams

DEFAULT_SEGMENT = "default"  # rows without a segment are one segment
DEFAULT_MAX_TOKENS = 128
ROLES = ("system", "user", "assistant", "tool")


@dataclass(slots=True, frozen=True)
class BadRow:
    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass(slots=True)
class Traffic:
    """Rows per segment (in file order) and the rows that were skipped."""

    segments: dict[str, list[dict]] = field(default_factory=dict)
    bad: list[BadRow] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    in_order: list[dict] = field(default_factory=list)  # every good row in file order (as read)

    @property
    def num_rows(self) -> int:
        return sum(len(r) for r in self.segments.values())

    def shares(self) -> dict[str, float]:
        """Each segment's fraction of the rows: the weight of its choice in global settings."""
        n = self.num_rows
        return {s: len(r) / n for s, r in self.segments.items()} if n else {}

    def sample(self, per_segment: int, seed: int = 0) -> "Traffic":
        """At most ``per_segment`` rows of each segment, drawn without replacement (seeded), kept
        in file order."""
        rng = random.Random(seed)
        out = Traffic(bad=list(self.bad), files=list(self.files))
        for seg, rows in self.segments.items():
            keep = sorted(rng.sample(range(len(rows)), min(per_segment, len(rows))))
            out.segments[seg] = [rows[i] for i in keep]
        return out


def check_row(raw: dict) -> dict:
    """A normalized row (``id``, ``segment``, ``max_tokens``, ``prompt``+``chat`` or ``messages``,
    ``constrained``, sampling keys) or InvalidRequestError saying what is wrong."""
    row = dict(raw)
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise InvalidRequestError("'messages' must be a non-empty list")
        for m in msgs:
            if not (isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in ROLES
                    and isinstance(m["content"], str)):
                raise InvalidRequestError(f"each message needs a role in {ROLES} and a string content, got {m!r}")
        if "prompt" in row:
            raise InvalidRequestError("give 'prompt' or 'messages', not both")
    elif not row.get("prompt"):
        raise InvalidRequestError("'prompt' is empty")
    seg = row.get("segment", DEFAULT_SEGMENT)
    if seg is None or seg == "":
        seg = DEFAULT_SEGMENT
    if not isinstance(seg, str):
        raise InvalidRequestError(f"'segment' must be a string, got {seg!r}")
    row["segment"] = seg
    mt = row.get("max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(mt, bool) or not isinstance(mt, int) or mt <= 0:
        raise InvalidRequestError(f"'max_tokens' must be a positive integer, got {mt!r}")
    row["max_tokens"] = mt
    if row.get("json_schema") and row.get("regex"):
        raise InvalidRequestError("set at most one of 'json_schema' and 'regex'")
    if isinstance(row.get("json_schema"), dict):  # a schema given as an object: send it as JSON text
        import json

        row["json_schema"] = json.dumps(row["json_schema"])
    for key in ("json_schema", "regex"):
        if key in row and row[key] is not None and not isinstance(row[key], str):
            raise InvalidRequestError(f"'{key}' must be a string, got {type(row[key]).__name__}")
    row["constrained"] = bool(row.get("json_schema") or row.get("regex"))
    sampling_params(row)  # the engine's own checks of temperature, top_p, top_k, stop
    return row


def sampling_params(row: dict, max_tokens: int | None = None) -> SamplingParams:
    """The row's sampling parameters (``max_tokens`` capped when given)."""
    try:
        return SamplingParams(max_tokens=min(row["max_tokens"], max_tokens or row["max_tokens"]),
                              temperature=float(row.get("temperature", 0.0)),
                              top_p=float(row.get("top_p", 1.0)), top_k=int(row.get("top_k", 0)),
                              seed=None if row.get("seed") is None else int(row["seed"]),
                              stop=tuple(row.get("stop") or ()))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, InvalidRequestError):
            raise
        raise InvalidRequestError(f"bad sampling parameter: {exc}") from None


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".jsonl" and p.is_file())
        if not files:
            raise UserFacingError(f"no *.jsonl files in {path}")
        return files
    if not path.is_file():
        raise UserFacingError(f"traffic not found: {path}")
    return [path]


def load_traffic(path: Path) -> Traffic:
    """Every good row of ``path`` (a JSONL file or a directory of them); bad rows are listed in
    ``Traffic.bad`` with their line number and skipped. No good row at all is an error."""
    traffic = Traffic()
    for f in _files(Path(path)):
        traffic.files.append(str(f))
        with open(f, encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = check_row(parse_prompt_row(line, f"{f}:{n}"))
                except InvalidRequestError as exc:
                    msg = str(exc)
                    prefix = f"{f}:{n}: "
                    traffic.bad.append(BadRow(str(f), n, msg[len(prefix):] if msg.startswith(prefix) else msg))
                    continue
                row.setdefault("id", f"{f.stem}-{n}")
                row["id"] = str(row["id"])
                traffic.segments.setdefault(row["segment"], []).append(row)
                traffic.in_order.append(row)
    if not traffic.num_rows:
        shown = "; ".join(str(b) for b in traffic.bad[:3])
        raise UserFacingError(f"no usable traffic rows in {path}" + (f" ({shown})" if shown else ""))
    return traffic
