"""The user's traffic sample for ``specserve map``: checked prompt rows grouped by segment.

Owns: the rows of a file or every ``*.jsonl`` of a directory (read and checked by
``cluster.common.prompt_rows.read_checked_rows``: sorted, so a run is reproducible; a bad row
reported with its file and line instead of stopping) grouped by segment, each segment's share,
and a seeded sample per segment (``--quick``). Ignores: tokenization (the engines do it) and
what the rows are used for (profile, sweep).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from cluster.common.prompt_rows import DEFAULT_SEGMENT, BadRow, read_checked_rows, sampling_params  # noqa: F401 (re-exported)


@dataclass(slots=True)
class Traffic:
    """Rows per segment (in file order) and the rows that were skipped."""

    segments: dict[str, list[dict]] = field(default_factory=dict)
    bad: list[BadRow] = field(default_factory=list)
    files: list[str] = field(default_factory=list)

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


def load_traffic(path: Path) -> Traffic:
    """Every good row of ``path`` (a JSONL file or a directory of them) grouped by segment; bad
    rows are listed in ``Traffic.bad`` with their line number and skipped. No good row at all is an
    error."""
    read = read_checked_rows(Path(path))
    traffic = Traffic(bad=read.bad, files=read.files)
    for row in read.rows:
        traffic.segments.setdefault(row["segment"], []).append(row)
    return traffic
