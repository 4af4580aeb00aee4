"""examples/lm-eval/compare.py: two lm-eval runs' metrics and per-choice log-likelihoods side by side."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "lm-eval" / "compare.py"


def _run_dir(root: Path, lls: dict[int, list[float]], acc: float) -> Path:
    out = root / "default"
    out.mkdir(parents=True)
    (out / "results_2026-12-06T00-00-00.json").write_text(json.dumps({"results": {"t": {"acc,none": acc}}}))
    lines = [json.dumps({"doc_id": d, "resps": [[[ll, i == 0]] for i, ll in enumerate(choices)]})
             for d, choices in lls.items()]
    (out / "samples_t_2026-12-06T00-00-00.jsonl").write_text("\n".join(lines))
    return root


def test_compare_reports_metrics_differences_and_flipped_choices(tmp_path):
    a = _run_dir(tmp_path / "a", {0: [-1.0, -2.0], 1: [-3.0, -2.9]}, 0.5)
    b = _run_dir(tmp_path / "b", {0: [-1.0001, -2.0], 1: [-2.8, -2.9]}, 1.0)
    out = tmp_path / "cmp.json"
    done = subprocess.run([sys.executable, str(SCRIPT), str(a), str(b), "--json", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["pairs"] == 4 and report["first"]["results"] == {"t": {"acc,none": 0.5}}
    assert abs(report["max_abs_loglikelihood_difference"] - 0.2) < 1e-9
    assert report["argmax_choices_that_differ"] == 1 and report["greedy_flags_that_differ"] == 0


def test_compare_refuses_a_directory_without_samples(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "--log_samples" in done.stderr
