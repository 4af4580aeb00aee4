"""Prompt rows: the JSONL format of workload files (``../shared/workloads/*.jsonl``) that
``specserve generate --prompts``, ``specserve bench``, ``specserve map --traffic`` and
``specserve train-draft --prompts`` read.

Owns: parsing one row and reading a file of them (id, segment, chat, prompt, max_tokens), with
an ``InvalidRequestError`` that names the file and line; checking a row in full (``check_row``:
``prompt`` with optional ``chat``, or ``messages``; ``segment``, default ``default``;
``max_tokens``; optional ``json_schema`` / ``regex``; sampling ``temperature`` / ``top_p`` /
``top_k`` / ``seed`` / ``stop``) and reading a file or every ``*.jsonl`` of a directory (sorted)
into checked rows in order, a bad row reported with its file and line instead of stopping
(``read_checked_rows``); where the benchmark workloads lie by default (``DEFAULT_WORKLOADS``).
Ignores: tokenizing a row (``cluster.models.tokenizer.prompt_token_ids``) and what the rows are
for (``cluster.mapper.traffic`` groups them by segment).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from cluster.common.errors import InvalidRequestError, UserFacingError
from cluster.common.request import Constraint, ConstraintKind, SamplingParams
from cluster.common.segments import DEFAULT_SEGMENT

# the benchmark workloads (``*.jsonl`` per segment) beside the checkout: ../shared/workloads
DEFAULT_WORKLOADS = Path(__file__).resolve().parents[3] / "shared" / "workloads"
DEFAULT_MAX_TOKENS = 128
ROLES = ("system", "user", "assistant", "tool")


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


@dataclass(slots=True, frozen=True)
class BadRow:
    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


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
    if sum(bool(row.get(key)) for key in ("json_schema", "regex", "grammar")) > 1:
        raise InvalidRequestError("set at most one of 'json_schema', 'regex' and 'grammar'")
    if isinstance(row.get("json_schema"), dict):  # a schema given as an object: send it as JSON text
        import json

        row["json_schema"] = json.dumps(row["json_schema"])
    for key in ("json_schema", "regex", "grammar"):
        if key in row and row[key] is not None and not isinstance(row[key], str):
            raise InvalidRequestError(f"'{key}' must be a string, got {type(row[key]).__name__}")
    row["constrained"] = bool(row.get("json_schema") or row.get("regex") or row.get("grammar"))
    sampling_params(row)  # the engine's own checks of temperature, top_p, top_k, stop
    return row


def row_constraint(row: dict) -> Constraint | None:
    """The row's structured-output constraint: ``json_schema`` (an object or its JSON text),
    ``regex`` or ``grammar`` (a Lark grammar); None when it has none; more than one is refused."""
    import json

    given = [key for key in ("json_schema", "regex", "grammar") if row.get(key)]
    if len(given) > 1:
        raise InvalidRequestError(f"set at most one of 'json_schema', 'regex' and 'grammar' (got {given})")
    if not given:
        return None
    text = row[given[0]]
    return Constraint(ConstraintKind(given[0]), json.dumps(text) if isinstance(text, dict) else str(text))


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


def _files(path: Path, what: str) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".jsonl" and p.is_file())
        if not files:
            raise UserFacingError(f"no *.jsonl files in {path}")
        return files
    if not path.is_file():
        raise UserFacingError(f"{what} not found: {path}")
    return [path]


@dataclass(slots=True)
class CheckedRows:
    """Every good row of a file or directory in file order, the bad ones, the files read."""

    rows: list[dict] = field(default_factory=list)
    bad: list[BadRow] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def read_checked_rows(path: Path, what: str = "traffic") -> CheckedRows:
    """Every row of ``path`` (a JSONL file or a directory of them) through ``check_row``; a bad row
    is listed with its line number and skipped; no good row at all is an error (``what`` names
    the rows in the messages)."""
    out = CheckedRows()
    for f in _files(Path(path), what):
        out.files.append(str(f))
        with open(f, encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = check_row(parse_prompt_row(line, f"{f}:{n}"))
                except InvalidRequestError as exc:
                    msg = str(exc)
                    prefix = f"{f}:{n}: "
                    out.bad.append(BadRow(str(f), n, msg[len(prefix):] if msg.startswith(prefix) else msg))
                    continue
                row.setdefault("id", f"{f.stem}-{n}")
                row["id"] = str(row["id"])
                out.rows.append(row)
    if not out.rows:
        shown = "; ".join(str(b) for b in out.bad[:3])
        raise UserFacingError(f"no usable {what} rows in {path}" + (f" ({shown})" if shown else ""))
    return out
