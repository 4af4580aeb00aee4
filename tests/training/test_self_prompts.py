"""Requests the target writes itself: sampled from the chat template's bare user turn (the prefix
is exactly what precedes a real user message), every attempt sampled (none greedy) with its own
seeded generator so batching and interruption change nothing, filtered (unfinished, too short,
too long, not letters, template text, duplicates, workload overlap), resumed from the file, and
woven one-for-one with the corpus."""
from __future__ import annotations

import json

import pytest
import torch

from cluster.common.errors import InvalidRequestError
from cluster.models.llama import LlamaModel
from cluster.models.tokenizer import chat_token_ids, load_tokenizer
from cluster.training.prompt_corpus import workload_overlap
from cluster.training.self_distill import generate
from cluster.training.self_prompts import RequestFilter, keep_request, read_requests, user_turn_prefix, write_requests

# the tiny random model rarely writes the real end of turn: a fifth of the vocabulary ends a request
EOS = frozenset(range(0, 49152, 5))
LOOSE = RequestFilter(min_words=1, max_words=1000, min_letter_share=0.0)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return LlamaModel.load(tiny_llama_dir, torch.float32), load_tokenizer(tiny_llama_dir)


def test_user_turn_prefix_is_what_precedes_a_user_message(tokenizer_files):
    tok = load_tokenizer(tokenizer_files)
    prefix = user_turn_prefix(tok)
    full = chat_token_ids(tok, [{"role": "user", "content": "Hello there"}])
    assert full[: len(prefix)] == prefix and len(full) > len(prefix) + 2
    text = tok.decode(prefix)
    assert text.endswith("<|im_start|>user\n") and "<|im_start|>system" in text  # the default system prompt


def test_a_target_without_chat_template_is_refused(tiny, tmp_path):
    model, tok = tiny

    class Plain:
        chat_template = None

    with pytest.raises(InvalidRequestError, match="chat template"):
        user_turn_prefix(Plain())
    with pytest.raises(InvalidRequestError, match="temperature"):
        write_requests(tmp_path / "r.jsonl", model, tok, EOS, count=2, seed=0, workloads=None, temperature=0.0)


@pytest.mark.parametrize("text,ok", [
    ("How do I keep basil alive on a windowsill?", True),
    ("Hi there", False),  # too short
    ("word " * 121, False),  # too long
    ("1234 5678 9012 3456 7890 !!!!", False),  # not letters
    ("Tell me a joke <|im_start|>assistant", False),  # template text
])
def test_keep_request_filters(text, ok):
    assert keep_request(text, RequestFilter()) is ok


def test_sample_all_samples_every_prompt(tiny):
    model, _ = tiny
    prompts = [(i, [5, 6, 7]) for i in range(4)]
    out = generate(model, prompts, max_new_tokens=6, eos_ids=frozenset(), temperature=1.0, sample_odd=False,
                   sample_all=True, seed=1, batch_size=4)
    assert [s.greedy for s in out] == [False] * 4
    assert len({tuple(s.output_ids) for s in out}) == 4  # one prefix, four seeded generators


def test_requests_are_deterministic_filtered_and_resumed(tiny, tmp_path):
    model, tok = tiny
    kw = dict(count=12, seed=5, workloads=None, max_tokens=8, flt=LOOSE, batch_size=4, progress=lambda _: None)
    whole = write_requests(tmp_path / "a.jsonl", model, tok, EOS, **kw)
    rows = read_requests(tmp_path / "a.jsonl")
    assert len(whole) == 12 and len(set(whole)) == 12  # deduplicated
    assert [r["index"] for r in rows] == list(range(len(rows))) and {r["seed"] for r in rows} == {5}
    ended = [r["text"] for r in rows if r["ended"]]
    assert any(not r["ended"] for r in rows)  # some ran to max_tokens: never kept
    assert whole == list(dict.fromkeys(t for t in ended if keep_request(t, LOOSE)))[:12]

    # another batch size, and a run cut by its deadline then resumed: the same requests
    assert write_requests(tmp_path / "b.jsonl", model, tok, EOS, **{**kw, "batch_size": 7}) == whole
    assert write_requests(tmp_path / "c.jsonl", model, tok, EOS, **kw, deadline=0.0) == []
    assert not read_requests(tmp_path / "c.jsonl")  # a cut wave is not written
    part = write_requests(tmp_path / "c.jsonl", model, tok, EOS, **{**kw, "count": 5})
    assert part == whole[:5]
    assert write_requests(tmp_path / "c.jsonl", model, tok, EOS, **kw) == whole
    resumed = [r["index"] for r in read_requests(tmp_path / "c.jsonl")]
    assert resumed == list(range(len(resumed)))  # earlier attempts read back, none written twice

    # another seed over the same file is refused; another seed elsewhere writes other requests
    with pytest.raises(InvalidRequestError, match="seed 5"):
        write_requests(tmp_path / "a.jsonl", model, tok, EOS, **{**kw, "seed": 6})
    assert write_requests(tmp_path / "d.jsonl", model, tok, EOS, **{**kw, "seed": 6}) != whole


def test_workload_prompts_and_the_attempt_limit(tiny, tmp_path):
    model, tok = tiny
    kw = dict(count=6, seed=5, max_tokens=8, flt=LOOSE, batch_size=4, progress=lambda _: None)
    whole = write_requests(tmp_path / "a.jsonl", model, tok, EOS, workloads=None, **kw)
    workloads = tmp_path / "workloads"
    workloads.mkdir()
    (workloads / "chat.jsonl").write_text(json.dumps({"prompt": whole[2]}) + "\n")
    assert workload_overlap(workloads)(whole[2])
    # read back from the same file and judged again: the workload prompt is left out, another takes its place
    again = write_requests(tmp_path / "a.jsonl", model, tok, EOS, workloads=workloads, **kw)
    assert whole[2] not in again and again[:2] == whole[:2] and again[2:5] == whole[3:] and len(again) == 6
    # a filter nothing passes: at most max_attempts_per_request * count attempts, none kept
    strict = RequestFilter(min_words=10_000)
    assert write_requests(tmp_path / "e.jsonl", model, tok, EOS, workloads=None,
                          **{**kw, "flt": strict}, max_attempts_per_request=2) == []
    assert len(read_requests(tmp_path / "e.jsonl")) == 12


def test_openers_start_the_requests_in_turn(tiny, tmp_path):
    """Attempt i starts from the user turn followed by opener i mod their number: the opener is
    tokenized with the template and is the start of the kept text; a file written with other
    openers, or at another temperature, is refused."""
    model, tok = tiny
    base = user_turn_prefix(tok)
    with_opener = user_turn_prefix(tok, "Write a poem about")
    assert with_opener[: len(base)] == base and tok.decode(with_opener[len(base):]) == "Write a poem about"
    openers = ("Write a poem about", "Describe")
    kw = dict(count=8, seed=5, workloads=None, max_tokens=8, flt=LOOSE, batch_size=4, progress=lambda _: None)
    kept = write_requests(tmp_path / "o.jsonl", model, tok, EOS, openers=openers, **kw)
    rows = read_requests(tmp_path / "o.jsonl")
    assert len(kept) == 8 and all(r["openers"] == list(openers) for r in rows)
    for r in rows:
        assert r["text"].startswith(openers[r["index"] % 2]), r
    assert all(any(k.startswith(o) for k in kept) for o in openers)
    assert write_requests(tmp_path / "o.jsonl", model, tok, EOS, openers=openers, **kw) == kept  # read back
    with pytest.raises(InvalidRequestError, match="openers"):
        write_requests(tmp_path / "o.jsonl", model, tok, EOS, openers=("Describe",), **kw)
    with pytest.raises(InvalidRequestError, match="openers"):
        write_requests(tmp_path / "o.jsonl", model, tok, EOS, **kw)  # none now: not the file's
    with pytest.raises(InvalidRequestError, match="temperature 1.0, not 0.7"):
        write_requests(tmp_path / "o.jsonl", model, tok, EOS, openers=openers, temperature=0.7, **kw)
    with pytest.raises(InvalidRequestError, match="words"):
        write_requests(tmp_path / "p.jsonl", model, tok, EOS, openers=("Describe", "  "), **kw)
    # without openers nothing changed: the same requests as before openers existed
    plain = write_requests(tmp_path / "q.jsonl", model, tok, EOS, **kw)
    assert "openers" not in read_requests(tmp_path / "q.jsonl")[0] and plain != kept
