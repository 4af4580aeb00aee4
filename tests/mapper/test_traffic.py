"""Traffic loading for `specserve map`: bad rows reported with their line and skipped, rows
without a segment form one segment, directories, seeded sampling."""
from __future__ import annotations

import json

import pytest

from cluster.common.errors import UserFacingError
from cluster.mapper.traffic import DEFAULT_SEGMENT, load_traffic


def _write(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_bad_rows_are_reported_with_their_line_and_skipped(tmp_path):
    f = _write(tmp_path / "t.jsonl", [
        {"prompt": "fine", "segment": "code", "max_tokens": 8},          # 1
        "{oops",                                                           # 2
        {"segment": "code"},                                               # 3 no prompt
        {"prompt": "x", "max_tokens": 0},                                  # 4
        {"prompt": "x", "temperature": -1},                                # 5
        {"prompt": "x", "json_schema": "{}", "regex": "a+"},               # 6
        {"messages": [{"role": "wizard", "content": "hi"}]},               # 7
        {"prompt": "x", "messages": [{"role": "user", "content": "hi"}]},  # 8
        "",                                                                # 9 blank: ignored
        {"prompt": "x", "segment": 7},                                     # 10
        {"messages": [{"role": "user", "content": "hi"}], "segment": "chat", "top_p": 0.9},  # 11
        [1, 2],                                                            # 12
    ])
    t = load_traffic(f)
    assert {s: [r["id"] for r in rows] for s, rows in t.segments.items()} == {"code": ["t-1"], "chat": ["t-11"]}
    assert [b.line for b in t.bad] == [2, 3, 4, 5, 6, 7, 8, 10, 12]
    why = {b.line: b.reason for b in t.bad}
    assert "not JSON" in why[2] and "prompt" in why[3] and "max_tokens" in why[4]
    assert "temperature" in why[5] and "at most one" in why[6] and "role" in why[7]
    assert "not both" in why[8] and "segment" in why[10]
    assert all(str(b).startswith(f"{f}:{b.line}: ") for b in t.bad)


def test_rows_without_segment_are_one_segment_and_constraints_are_marked(tmp_path):
    f = _write(tmp_path / "t.jsonl", [{"prompt": "a"}, {"prompt": "b", "segment": ""},
                                      {"prompt": "c", "json_schema": {"type": "object"}}])
    t = load_traffic(f)
    assert list(t.segments) == [DEFAULT_SEGMENT] and len(t.segments[DEFAULT_SEGMENT]) == 3
    rows = t.segments[DEFAULT_SEGMENT]
    assert [r["constrained"] for r in rows] == [False, False, True]
    assert json.loads(rows[2]["json_schema"]) == {"type": "object"}  # sent as JSON text
    assert t.shares() == {DEFAULT_SEGMENT: 1.0}


def test_directory_and_sampling(tmp_path):
    _write(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "segment": "s"} for i in range(10)])
    _write(tmp_path / "a.jsonl", [{"prompt": "a", "segment": "t"}])
    (tmp_path / "notes.txt").write_text("not traffic")
    t = load_traffic(tmp_path)
    assert [p.rsplit("/", 1)[1] for p in t.files] == ["a.jsonl", "b.jsonl"]
    assert t.num_rows == 11 and t.shares() == {"t": 1 / 11, "s": 10 / 11}
    s1, s2 = t.sample(4, seed=3), t.sample(4, seed=3)
    prompts = [r["prompt"] for r in s1.segments["s"]]
    assert prompts == [r["prompt"] for r in s2.segments["s"]] and len(prompts) == 4
    assert prompts == sorted(prompts, key=lambda p: int(p[1:]))  # file order kept
    assert len(s1.segments["t"]) == 1
    assert t.sample(100).num_rows == 11


def test_no_usable_rows_is_a_clear_error(tmp_path):
    f = _write(tmp_path / "t.jsonl", ["{bad", {"nope": 1}])
    with pytest.raises(UserFacingError, match=r"no usable traffic rows.*t.jsonl:1"):
        load_traffic(f)
    with pytest.raises(UserFacingError, match="not found"):
        load_traffic(tmp_path / "missing.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserFacingError, match="no \\*.jsonl"):
        load_traffic(tmp_path / "empty")
