"""Prompt rows read in full: every checked row of a file in file order whatever its segment, a bad
row reported with its file and line and skipped, nothing usable an error naming what was read."""
from __future__ import annotations

import json

import pytest

from cluster.common.errors import UserFacingError
from cluster.common.prompt_rows import DEFAULT_SEGMENT, read_checked_rows


def test_rows_in_file_order_with_the_bad_ones_listed(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join([json.dumps({"segment": "b", "prompt": "one"}), "{oops",
                               json.dumps({"segment": "a", "prompt": "two", "max_tokens": 8}),
                               json.dumps({"prompt": "three", "top_p": 7}), json.dumps({"prompt": "four"})]) + "\n")
    read = read_checked_rows(path)
    assert [(r["segment"], r["prompt"]) for r in read.rows] == [("b", "one"), ("a", "two"), (DEFAULT_SEGMENT, "four")]
    assert [r["id"] for r in read.rows] == ["rows-1", "rows-3", "rows-5"] and read.files == [str(path)]
    assert [(b.line, b.reason.split(":")[0]) for b in read.bad] == [(2, "not JSON"), (4, "top_p must be in (0, 1], got 7.0")]


def test_nothing_usable_names_what_was_read(tmp_path):
    with pytest.raises(UserFacingError, match="prompt not found"):
        read_checked_rows(tmp_path / "missing.jsonl", what="prompt")
    (tmp_path / "bad.jsonl").write_text("[]\n")
    with pytest.raises(UserFacingError, match=r"no usable traffic rows in .*bad.jsonl \(.*bad.jsonl:1: "):
        read_checked_rows(tmp_path / "bad.jsonl")
