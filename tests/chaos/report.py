"""The chaos suite's figures: what each test measured, written as one JSON file at the end.

Owns: collecting figures per section (fuzz counts and status codes seen, lost/corrupted per fault x
placement, load errors, the stopped DraftServer's added latency per step) and writing them when
``--chaos-report PATH`` is given. Ignores: judging them (the tests assert; this only records).
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path


class ChaosReport:
    def __init__(self) -> None:
        self.started = time.time()
        self.sections: dict[str, dict] = {}

    def record(self, section: str, key: str, value) -> None:
        """Set one figure; a test records before it asserts, so a failing run still reports."""
        self.sections.setdefault(section, {})[key] = value

    def count_codes(self, section: str, codes: Counter) -> None:
        seen = self.sections.setdefault(section, {}).setdefault("codes", {})
        for code, n in codes.items():
            seen[code] = seen.get(code, 0) + n

    def to_dict(self) -> dict:
        return {"started_unix": self.started, "elapsed_s": round(time.time() - self.started, 1),
                "sections": self.sections}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
