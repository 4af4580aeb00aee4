"""Where the suite's time goes: a JUnit XML report of a run (``pytest --junitxml``) summed per test
file, as JSON and as a table.

``python -m tests.durations RUN.xml --json OUT.json``. A test's time is its set-up, call and
teardown added up (pytest's JUnit ``time``), so a module fixture counts in the test that built it;
under two workers the files' times add up to about twice the run's wall time.
"""
from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def module_path(classname: str) -> str:
    parts = classname.split(".")
    while parts and parts[-1][:1].isupper():  # a test class
        parts.pop()
    return "/".join(parts) + ".py"


def summarize(xml_path: str, top: int = 25) -> dict:
    root = ET.parse(xml_path).getroot()
    files: dict[str, dict] = defaultdict(lambda: {"seconds": 0.0, "tests": 0})
    tests = []
    outcomes: dict[str, int] = defaultdict(int)
    for case in root.iter("testcase"):
        path, seconds = module_path(case.get("classname", "")), float(case.get("time", 0))
        files[path]["seconds"] += seconds
        files[path]["tests"] += 1
        tests.append((seconds, f"{path}::{case.get('name')}"))
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        outcomes[kind] += 1
    suites = list(root.iter("testsuite"))
    return {
        "wall_s": sum(float(s.get("time", 0)) for s in suites),
        "test_seconds_total": round(sum(f["seconds"] for f in files.values()), 1),
        "outcomes": dict(outcomes),
        "files": sorted(({"file": k, **{"seconds": round(v["seconds"], 1), "tests": v["tests"]}}
                         for k, v in files.items()), key=lambda r: -r["seconds"]),
        "slowest_tests": [{"test": n, "seconds": round(s, 1)} for s, n in sorted(tests, reverse=True)[:top]],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("xml")
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--rows", type=int, default=30)
    args = p.parse_args(argv)
    s = summarize(args.xml)
    print(f"wall {s['wall_s']:.0f} s; test time {s['test_seconds_total']:.0f} s; {s['outcomes']}")
    for row in s["files"][: args.rows]:
        print(f"{row['seconds']:8.1f} s {row['tests']:5d}  {row['file']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
