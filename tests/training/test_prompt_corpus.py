"""The local prompt corpus: deterministic, deduplicated, and disjoint from the benchmark workloads
(equal prompts and prompts sharing an 8-word run are dropped)."""
from __future__ import annotations

import json
from collections import Counter

from cluster.training.prompt_corpus import (_CHAT_QUESTIONS, _CHAT_SUBJECTS, _CHAT_TASKS, _MULTILINGUAL, _TEMPLATES,
                                           DEFAULT_WORKLOADS, build_labelled_prompts, build_prompts, weave,
                                           workload_prompts)


def test_corpus_is_deterministic_and_deduplicated():
    a = build_prompts(None, limit=200, seed=1)
    assert a == build_prompts(None, limit=200, seed=1) and len(a) == 200
    assert len(set(a)) == len(a)
    assert build_prompts(None, limit=200, seed=2) != a


def test_workload_prompts_are_excluded(tmp_path):
    base = build_prompts(None, limit=40)
    long_one = next(p for p in base[4:] if len(p.split()) >= 12)
    (tmp_path / "chat.jsonl").write_text(
        json.dumps({"id": "x", "prompt": "  " + base[3].upper() + " "}) + "\n"
        + json.dumps({"id": "y", "prompt": "Please: " + " ".join(long_one.split()[-9:])}) + "\n")
    kept = build_prompts(tmp_path, limit=40)
    assert base[3] not in kept and long_one not in kept
    assert len(kept) == 40


def _source(prompt: str) -> str:
    if prompt.startswith("Return only a JSON object with the keys"):
        return "json"
    if any(prompt.startswith(t.split("{")[0]) for t in _TEMPLATES):
        return "docs"
    if any(prompt.startswith(t.split("{s}")[0]) for t, _ in _MULTILINGUAL):
        return "multilingual"
    assert prompt in _CHAT_QUESTIONS or any(
        prompt.startswith(t.split("{s}")[0]) and prompt.endswith(t.split("{s}")[-1]) for t in _CHAT_TASKS), prompt
    return "chat"


def test_sources_are_woven_in_ratio():
    prompts = build_prompts(None, limit=500)
    counts = Counter(_source(p) for p in prompts)
    # _WEAVE: 4 chat, 3 docs, 2 json, 1 multilingual in 10; the 33 multilingual prompts run out first
    assert counts["multilingual"] == sum(len(subjects) for _, subjects in _MULTILINGUAL) == 33
    assert 200 <= counts["chat"] <= 225 and 130 <= counts["docs"] <= 160 and 100 <= counts["json"] <= 110, counts


def test_labelled_prompts_name_each_prompts_source():
    """``build_labelled_prompts``: the same prompts as ``build_prompts``, each with the source a
    classifier of the templates finds (train-draft reports held-out α by these)."""
    labelled = build_labelled_prompts(None, limit=300, seed=3)
    assert [text for _, text in labelled] == build_prompts(None, limit=300, seed=3)
    assert all(source == _source(text) for source, text in labelled)
    assert {source for source, _ in labelled} == {"chat", "docs", "json", "multilingual"}


def test_chat_subjects_avoid_the_chat_workloads_subjects():
    chat = " ".join(json.loads(line)["prompt"] for line in (DEFAULT_WORKLOADS / "chat.jsonl").read_text().splitlines()
                    if line.strip()).lower()
    assert len(chat) > 500
    for subject in _CHAT_SUBJECTS:
        words = subject.lower().split()
        phrase = " ".join(words[1:] if words[0] in ("a", "an", "the") else words)
        assert phrase not in chat, subject


def test_every_chat_question_and_task_is_in_the_corpus_once_and_none_is_a_workload_prompt():
    prompts = build_prompts()
    workloads = {" ".join(p.lower().split()) for p in workload_prompts(DEFAULT_WORKLOADS)}
    assert len(workloads) > 100
    assert all(prompts.count(q) == 1 for q in _CHAT_QUESTIONS)
    for task in _CHAT_TASKS:
        assert task.format(s=_CHAT_SUBJECTS[0]) in prompts, task
    assert not {" ".join(p.lower().split()) for p in prompts} & workloads


def test_weave_takes_the_lists_in_turn_then_the_rest():
    assert weave([1, 2, 3], ["a"]) == [1, "a", 2, 3]
    assert weave([1], ["a", "b", "c"]) == [1, "a", "b", "c"]
    assert weave([], ["a"]) == ["a"] and weave() == []
    assert weave([1, 2], ["a"], ["x", "y", "z"]) == [1, "a", "x", 2, "y", "z"]
