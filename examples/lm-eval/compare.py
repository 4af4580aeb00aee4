"""Compare two lm-evaluation-harness runs of one task (``--log_samples`` output directories):
the metrics of each, and how far apart their per-choice log-likelihoods and greedy flags are.

    python examples/lm-eval/compare.py .bench/lm-eval/specserve .bench/lm-eval/hf [--json out.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _one(path: Path, pattern: str) -> Path:
    found = sorted(path.rglob(pattern))
    if not found:
        raise SystemExit(f"no {pattern} under {path}: run lm_eval with --output_path {path} --log_samples")
    return found[-1]  # the latest run


def load(path: Path) -> tuple[dict, dict[tuple[int, int], tuple[float, bool]]]:
    """(the run's metrics per task, (doc id, choice) -> (log-likelihood, is_greedy))."""
    results = json.loads(_one(path, "results_*.json").read_text())["results"]
    samples = {}
    for line in _one(path, "samples_*.jsonl").read_text().splitlines():
        s = json.loads(line)
        for choice, resp in enumerate(s["resps"]):
            ll, greedy = resp[0]
            samples[(s["doc_id"], choice)] = (float(ll), bool(greedy))
    return results, samples


def _argmax(samples: dict[tuple[int, int], tuple[float, bool]], doc: int) -> int:
    """The choice of document ``doc`` with the highest log-likelihood (what ``acc`` counts)."""
    return max((c for d, c in samples if d == doc), key=lambda c: samples[(doc, c)][0])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("first", type=Path)
    p.add_argument("second", type=Path)
    p.add_argument("--json", type=Path, default=None, help="write the comparison here")
    args = p.parse_args()
    (m1, s1), (m2, s2) = load(args.first), load(args.second)
    if s1.keys() != s2.keys():
        raise SystemExit("the runs scored different (document, choice) pairs")
    diffs = sorted(abs(s1[k][0] - s2[k][0]) for k in s1)
    report = {
        "first": {"path": str(args.first), "results": m1},
        "second": {"path": str(args.second), "results": m2},
        "pairs": len(diffs),
        "max_abs_loglikelihood_difference": diffs[-1],
        "median_abs_loglikelihood_difference": diffs[len(diffs) // 2],
        "greedy_flags_that_differ": sum(s1[k][1] != s2[k][1] for k in s1),
        "argmax_choices_that_differ": sum(_argmax(s1, d) != _argmax(s2, d) for d in {d for d, _ in s1}),
    }
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
