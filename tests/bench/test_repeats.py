"""Repeated rows in a benchmark through the service: what counts as a repeat, where each level's
rows start, whether the drafter learns (the end-to-end counts through a real Serve app are in
tests/deployments/test_service_fake.py::test_bench_serve_quick and tests/mapper/test_map_model.py)."""
from __future__ import annotations

import pytest

from cluster.bench import serve as bench
from cluster.bench.repeats import SpecAnswers, format_repeats, level_start, scoped_rows


def _ok(path):
    return {"error": None, "path": path}


def test_spec_answers_count_speculative_requests_that_repeat_a_row():
    a, b, c = ({"segment": "chat", "prompt": t} for t in "abc")
    answers = SpecAnswers()
    assert answers.wave([a, b], [_ok("plain"), _ok("plain")]) == 0  # plain drafts nothing
    assert answers.wave([a, b], [_ok("speculative"), {"error": "UNAVAILABLE"}]) == 0
    assert answers.wave([a, b, b], [_ok("speculative"), _ok("speculative"), _ok("speculative")]) == 2
    assert answers.wave([c], [{"error": None}], forced_speculative=False) == 0  # unary, routed plain
    assert answers.wave([c], [{"error": None}], forced_speculative=True) == 0  # unary, fixed-spec
    assert answers.wave([{**c, "chat": True}], [_ok("speculative")]) == 0  # another request
    assert answers.summary("suffix") == {"speculative_requests": 6, "repeated": 2, "drafter": "suffix",
                                         "drafter_learns_from_traffic": True}
    assert answers.summary("portfolio")["drafter_learns_from_traffic"] is True
    assert answers.summary("ngram")["drafter_learns_from_traffic"] is False
    assert answers.summary(None)["drafter_learns_from_traffic"] is None
    assert "WARNING: 2 of 6 speculative-path requests" in "\n".join(format_repeats(answers.summary("suffix")))
    assert "no effect" in "\n".join(format_repeats(answers.summary("ngram")))
    assert format_repeats(SpecAnswers().summary("suffix")) == []


@pytest.mark.parametrize("num_rows, scoped, repeated", [(32, False, 0), (10, False, 6), (10, True, 0)])
def test_each_level_takes_fresh_rows_while_the_workload_lasts(num_rows, scoped, repeated):
    """bench serve's walk over levels (1 then 4, 8 requests each), fixed-spec alone: 16 rows in
    all, fresh ones on a workload of 32 rows; a workload of 10 cycles and repeats 6 — none when
    each pass over it goes in a draft scope of its own (``scoped_rows``, as bench serve sends)."""
    rows = [{"segment": "s", "prompt": str(i)} for i in range(num_rows)]
    if scoped:
        rows = scoped_rows(rows, "bench-x/fixed_spec/grpc", 16)
        assert len(rows) == 20 and rows[3]["draft_scope"] == "bench-x/fixed_spec/grpc/c0"
        assert rows[13] == {"segment": "s", "prompt": "3", "draft_scope": "bench-x/fixed_spec/grpc/c1"}
    answers, start, got = SpecAnswers(), 0, 0
    for c in (1, 4):
        rounds, per = bench.round_plan(8, c, 0)
        for r in range(rounds):
            wave = bench.wave_rows(rows, start + r * per, per, c)
            got += answers.wave(wave, [_ok("speculative")] * len(wave))
        start = level_start(start, rounds, per)
    assert got == repeated and answers.speculative == 16


def test_the_same_row_in_another_draft_scope_is_no_repeat():
    a = {"segment": "chat", "prompt": "a"}
    answers = SpecAnswers()
    waves = [[a], [{**a, "draft_scope": "t1"}], [{**a, "draft_scope": "t2"}], [{**a, "draft_scope": "t1"}]]
    assert [answers.wave(w, [_ok("speculative")]) for w in waves] == [0, 0, 0, 1]
