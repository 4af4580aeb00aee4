"""`specserve generate` end to end (in-process CLI on the real default model)."""
from __future__ import annotations

import json

from cluster.cli import main


def test_prompts_file_to_jsonl_with_spec_stats(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    rows = [
        {"id": "a", "segment": "code", "chat": False, "prompt": "def add(a, b):\n"},
        {"id": "b", "segment": "chat", "chat": True, "prompt": "Say hello."},
        {"id": "c", "segment": "summarize", "chat": False, "prompt": "one two three one two three one two"},
    ]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out.jsonl"
    rc = main(["generate", "--model", "default", "--prompts", str(src), "--out", str(out),
               "--max-tokens", "8", "--draft", "ngram", "--num-draft-tokens", "3", "--limit", "3"])
    assert rc == 0
    got = [json.loads(l) for l in out.read_text().splitlines()]
    assert [g["id"] for g in got] == ["a", "b", "c"]
    for g in got:
        assert {"id", "prompt", "chat", "prompt_token_ids", "output_token_ids", "text", "finish_reason", "timing", "spec"} <= set(g)
        assert 1 <= len(g["output_token_ids"]) <= 8 and g["finish_reason"] in ("length", "eos", "stop")
        assert g["timing"]["e2e_s"] > 0 and g["timing"]["ttft_s"] <= g["timing"]["e2e_s"]
        assert {"draft_tokens", "accepted_tokens", "acceptance_rate", "mean_acceptance_length"} <= set(g["spec"])
    # the chat row was wrapped in the chat template (im_start marker id 1 first)
    assert got[1]["prompt_token_ids"][0] == 1 and got[0]["prompt_token_ids"][0] != 1
    assert [(g["prompt"], g["chat"]) for g in got] == [(r["prompt"], r["chat"]) for r in rows]  # what was asked


def test_single_prompt_prints_text_and_bad_model_is_one_line(capsys):
    assert main(["generate", "--model", "default", "The capital of France is", "--max-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["generate", "--model", "/nonexistent/model", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specserve: error:") and "unknown model" in err[0]


def test_engine_settings_the_configs_refuse_are_one_line(capsys):
    """A K, drafter or suffix corpus the engine configs refuse is one clear error line, before any
    model loads — not a traceback; a suffix corpus no drafter would read is refused, not ignored."""
    for args, needle in ((["--draft", "ngram", "--num-draft-tokens", "x"], "num_draft_tokens must be an integer"),
                         (["--suffix-corpus", "cold"], "--suffix-corpus is the corpus of a suffix drafter"),
                         (["--draft", "ngram", "--suffix-corpus", "cold"], "no drafter configured drafts with it"),
                         (["--draft", "suffix", "--suffix-corpus", "/no/such.npz"], "no such file")):
        assert main(["generate", "--model", "default", "hi", "--max-tokens", "2", *args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("specserve: error:") and needle in err[0], (args, err)


def test_a_rows_constraint_and_sampling_keys_are_honoured(tmp_path):
    """A row's json_schema / regex / grammar constrains its output and its sampling keys win over
    the flags (they were once dropped: the output answered as if they had not been sent)."""
    import re

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    rows = [{"id": "j", "prompt": "Is the sky blue? Answer in JSON.", "chat": True, "json_schema": schema},
            {"id": "r", "prompt": "Year:", "regex": "(19|20)[0-9]{2}"},
            {"id": "g", "prompt": "Name a colour:", "grammar": 'start: " " WORD\nWORD: /[a-z]{1,8}/\n'},
            {"id": "s", "prompt": "Once upon a time", "stop": [" "]}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["generate", "--model", "default", "--prompts", str(src), "--out", str(out), "--max-tokens", "24"]) == 0
    got = {g["id"]: g for g in map(json.loads, out.read_text().splitlines())}
    assert isinstance(json.loads(got["j"]["text"])["ok"], bool) and got["j"]["finish_reason"] == "stop"
    assert re.fullmatch("(19|20)[0-9]{2}", got["r"]["text"])
    assert re.fullmatch(" [a-z]{1,8}", got["g"]["text"])
    assert got["s"]["finish_reason"] == "stop" and " " not in got["s"]["text"].strip()
    src.write_text(json.dumps({"id": "x", "prompt": "hi", "regex": "a", "grammar": 'start: "a"'}) + "\n")
    assert main(["generate", "--model", "default", "--prompts", str(src), "--out", str(out)]) == 2


def test_a_grammar_past_the_engines_limits_ends_its_row_alone_with_the_message(tmp_path):
    """Issue 64: a forced run that breaks llguidance's lexer after the first token ends that row
    alone with finish_reason error and the message, beside a row that finishes normally (a run
    that breaks at the first mask, ``a{1000000}``, is refused at admission: exit 2 naming the row)."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": "late", "prompt": "Say b", "regex": "[bc]a{300000}"},
            {"id": "ok", "prompt": "Year:", "regex": "(19|20)[0-9]{2}"}]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["generate", "--model", "default", "--prompts", str(src), "--out", str(out), "--max-tokens", "8"]) == 0
    got = {g["id"]: g for g in map(json.loads, out.read_text().splitlines())}
    assert got["late"]["finish_reason"] == "error" and got["late"]["text"] in ("b", "c")
    assert "the grammar engine hit its limits: lexer error: too many expressions constructed" in got["late"]["error"]
    assert got["ok"]["finish_reason"] in ("stop", "eos") and "error" not in got["ok"]
