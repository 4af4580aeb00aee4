"""A prompt corpus built on this machine (no hub, no network) for self-distilling draft heads.

Owns: turning Python's own documentation (``pydoc_data.topics`` and standard-library
docstrings, PSF licensed) into chat-style instructions through a few task templates (explain,
summarize, write code, answer, rewrite as JSON), deduplicated, in a deterministic shuffled order,
and excluding every prompt of the benchmark workloads (``../shared/workloads/*.jsonl``): a corpus
prompt is dropped when it equals a workload prompt or shares a run of 8 words with one (so the
benchmark stays held out).
Ignores: tokenizing and generating (``cluster.training.self_distill``).
"""
from __future__ import annotations

import importlib
import json
import random
import re
import warnings
from pathlib import Path

DEFAULT_WORKLOADS = Path(__file__).resolve().parents[3] / "shared" / "workloads"
_SHINGLE = 8  # words: a corpus prompt sharing this many consecutive words with a workload prompt is dropped

_MODULES = ("json", "re", "os", "pathlib", "collections", "itertools", "functools", "datetime", "string",
            "textwrap", "random", "statistics", "math", "heapq", "bisect", "csv", "argparse", "logging",
            "dataclasses", "enum", "typing", "shutil", "subprocess", "urllib.parse", "http.client", "socket",
            "threading", "queue", "asyncio", "contextlib", "copy", "difflib", "fractions", "decimal",
            "hashlib", "base64", "zipfile", "tarfile", "sqlite3", "unittest", "inspect", "ast", "tokenize")

_TEMPLATES = (
    "Explain in simple words what the following Python documentation says:\n\n{text}",
    "Summarize this in three sentences:\n\n{text}",
    "Write a short Python example that demonstrates the following:\n\n{text}",
    "A beginner asks: what is `{name}` in Python and when would I use it? Here is the reference:\n\n{text}",
    "Rewrite the key facts of this text as a JSON object with the keys \"name\", \"purpose\" and \"example\":\n\n{text}",
    "What are the most common mistakes people make with `{name}`? Use this reference:\n\n{text}",
    "Translate the following explanation into French:\n\n{text}",
    "Write a Python function that uses `{name}` and explain it step by step.",
)


def _normalize(text: str) -> str:
    return " ".join(text.lower().split())


def _shingles(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + _SHINGLE]) for i in range(max(0, len(words) - _SHINGLE + 1))}


def workload_prompts(workloads: Path | None) -> list[str]:
    """Every prompt (and message content) of the workload files under ``workloads``."""
    if workloads is None or not Path(workloads).is_dir():
        return []
    out = []
    for path in sorted(Path(workloads).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if isinstance(row.get("prompt"), str):
                out.append(row["prompt"])
            for m in row.get("messages") or []:
                if isinstance(m, dict) and isinstance(m.get("content"), str):
                    out.append(m["content"])
    return out


def _doc_passages(max_chars: int) -> list[tuple[str, str]]:
    """(name, passage) pairs from pydoc topics and module/function docstrings."""
    passages: list[tuple[str, str]] = []
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a trimmed Python without pydoc_data: docstrings only
        topics = {}
    for name, text in sorted(topics.items()):
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            if len(para) >= 120:
                passages.append((name, para[:max_chars]))
    for mod_name in _MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            with warnings.catch_warnings():  # deprecated aliases (typing.io) warn when touched
                warnings.simplefilter("ignore", DeprecationWarning)
                doc = getattr(getattr(mod, attr, None), "__doc__", None)
            if isinstance(doc, str) and len(doc) >= 80:
                passages.append((f"{mod_name}.{attr}", " ".join(doc.split())[:max_chars]))
    return passages


def build_prompts(workloads: Path | None = DEFAULT_WORKLOADS, *, limit: int | None = None, seed: int = 0,
                  max_chars: int = 600) -> list[str]:
    """Deterministic, deduplicated instructions, none overlapping a workload prompt."""
    held_out = workload_prompts(workloads)
    exact = {_normalize(p) for p in held_out}
    shingles: set[tuple[str, ...]] = set().union(*(_shingles(p) for p in held_out)) if held_out else set()
    rng = random.Random(seed)
    passages = _doc_passages(max_chars)
    rng.shuffle(passages)
    seen: set[str] = set()
    prompts = []
    for i, (name, text) in enumerate(passages):
        prompt = _TEMPLATES[i % len(_TEMPLATES)].format(name=name, text=text)
        key = _normalize(prompt)
        if key in seen or key in exact or (_shingles(prompt) & shingles):
            continue
        seen.add(key)
        prompts.append(prompt)
        if limit is not None and len(prompts) >= limit:
            break
    return prompts
