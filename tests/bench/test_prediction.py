"""`specserve bench prediction`: the predictions it sends, and one tiny run on the real default model."""
import json

import pytest

from cluster.bench.prediction import original_code, predictions


def test_the_predictions_a_client_might_send():
    edit = {"segment": "edit", "prompt": "Rewrite this function.\n\ndef f(x):\n\n    return x"}
    assert original_code(edit) == "def f(x):\n\n    return x"
    assert original_code({"segment": "chat", "prompt": "a\n\nb"}) == ""
    assert original_code({"segment": "edit", "prompt": "no code here"}) == ""
    answer = list(range(10, 26))
    got = predictions(["exact", "drift", "original"], answer, edit, lambda text: [len(text)], vocab=100, drift=4)
    assert got["exact"] == tuple(answer) and got["original"] == (len(original_code(edit)),)
    changed = [i for i, (a, b) in enumerate(zip(answer, got["drift"])) if a != b]
    assert changed == [3, 7, 11, 15] and len(got["drift"]) == len(answer)
    assert "original" not in predictions(["original"], answer, {"segment": "code", "prompt": "x"}, len, 100, 4)


@pytest.mark.model
def test_a_tiny_run_is_lossless_and_reports_every_method(tmp_path):
    from cluster.cli import build_parser

    out = tmp_path / "p.json"
    args = build_parser().parse_args(["bench", "prediction", "--segments", "edit", "--prompts-per-segment", "1",
                                      "--max-tokens", "16", "--rounds", "1", "--threads", "1", "--json", str(out)])
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    assert report["lossless"] and not report["mismatches"]
    rows = report["table"]["edit"]
    assert set(rows) == {"plain", "drafter", "exact", "drift", "original"}
    assert rows["exact"]["prediction_kept"] == 1.0 and rows["exact"]["alpha"] >= 0.9
    assert rows["drafter"]["prediction_kept"] is None and rows["drift"]["prediction_kept"] < 1.0
    assert all(r["vs_drafter"] > 0 for r in rows.values() if r["vs_drafter"] is not None)
