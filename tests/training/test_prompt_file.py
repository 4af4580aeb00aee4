"""An operator's own prompts for train-draft: rows encoded as the service encodes them (chat
template, raw completion, a conversation), in file order with their segment as source; rows
with a grammar, overlapping a workload prompt, duplicated, not encodable or malformed left out and
counted; a file with nothing usable refused with the reasons."""
from __future__ import annotations

import copy
import json

import pytest

from cluster.common.errors import UserFacingError
from cluster.models.tokenizer import chat_token_ids, load_tokenizer
from cluster.training.prompt_file import read_prompt_file

CONVERSATION = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "What is a lighthouse for?"},
                {"role": "assistant", "content": "It warns ships of the coast."},
                {"role": "user", "content": "And at night?"}]


@pytest.fixture(scope="module")
def tok(tokenizer_files):
    return load_tokenizer(tokenizer_files)


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _workloads(tmp_path):
    d = tmp_path / "workloads"
    d.mkdir()
    _write(d / "chat.jsonl", [{"id": "w", "segment": "chat", "chat": True, "prompt": "Write a poem about a very old harbour."}])
    return d


def test_rows_are_encoded_as_the_service_would_and_the_rest_counted(tmp_path, tok):
    rows = [{"segment": "chat", "chat": True, "prompt": "Tell me a story about a brave snail.", "max_tokens": 64,
             "temperature": 0.7},
            {"segment": "code", "prompt": "def mean(xs):\n    \"\"\"Average of xs.\"\"\"\n"},
            {"segment": "chat", "messages": CONVERSATION},
            {"segment": "json", "chat": True, "prompt": "Give me a user record.", "json_schema": {"type": "object"}},
            {"segment": "json", "chat": True, "prompt": "A date please.", "regex": r"\d{4}-\d\d-\d\d"},
            {"segment": "chat", "chat": True, "prompt": "Write a poem about a very old harbour."},  # a workload's
            {"segment": "chat", "chat": True, "prompt": "Tell me a story about a brave snail."},  # a duplicate
            "{not json",
            {"segment": "chat", "prompt": "x", "max_tokens": 0},
            {"prompt": "Plain text without a segment."}]
    found = read_prompt_file(_write(tmp_path / "mine.jsonl", rows), tok, _workloads(tmp_path))
    assert found.prompts == [
        ("prompts:chat", chat_token_ids(tok, [{"role": "user", "content": rows[0]["prompt"]}])),
        ("prompts:code", [int(t) for t in tok(rows[1]["prompt"], add_special_tokens=False)["input_ids"]]),
        ("prompts:chat", chat_token_ids(tok, CONVERSATION)),
        ("prompts:default", [int(t) for t in tok(rows[9]["prompt"], add_special_tokens=False)["input_ids"]]),
    ]
    assert dict(found.skipped) == {"with json_schema, regex or grammar (generated without a grammar)": 2,
                                   "overlapping a benchmark workload prompt": 1, "duplicate": 1}
    assert [b.split(": ")[0] for b in found.bad_rows] == [f"{tmp_path / 'mine.jsonl'}:{n}" for n in (8, 9)]
    assert found.summary().startswith("4 prompts, 1 duplicate, 1 overlapping a benchmark workload prompt, 2 with")
    assert "2 bad rows (first: " in found.summary()


def test_a_directory_is_read_in_file_order_and_the_workloads_default_to_none(tmp_path, tok):
    d = tmp_path / "traffic"
    d.mkdir()
    _write(d / "b.jsonl", [{"segment": "s", "chat": True, "prompt": "second file"}])
    _write(d / "a.jsonl", [{"segment": "s", "chat": True, "prompt": "first file"}])
    found = read_prompt_file(d, tok, None)
    want = [chat_token_ids(tok, [{"role": "user", "content": t}]) for t in ("first file", "second file")]
    assert [ids for _, ids in found.prompts] == want


def test_a_target_without_chat_template_keeps_the_raw_rows_only(tmp_path, tok):
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    path = _write(tmp_path / "p.jsonl", [{"chat": True, "prompt": "hello"}, {"prompt": "def f():"},
                                         {"messages": CONVERSATION}])
    found = read_prompt_file(path, plain, None)
    assert [s for s, _ in found.prompts] == ["prompts:default"] and sum(found.skipped.values()) == 2
    assert all("no chat template" in reason for reason in found.skipped)


def test_nothing_usable_is_refused_with_the_reasons(tmp_path, tok):
    path = _write(tmp_path / "p.jsonl", [{"chat": True, "prompt": "a", "regex": "a+"}, "[1, 2]"])
    with pytest.raises(UserFacingError, match=r"--prompts .*p.jsonl: no usable prompt \(0 prompts, 1 with json_schema"):
        read_prompt_file(path, tok, None)
    with pytest.raises(UserFacingError, match="--prompts .*missing.jsonl: prompt not found"):
        read_prompt_file(tmp_path / "missing.jsonl", tok, None)
    with pytest.raises(UserFacingError, match=r"no usable prompt rows"):  # every row malformed
        read_prompt_file(_write(tmp_path / "bad.jsonl", ["{", "[]"]), tok, None)
