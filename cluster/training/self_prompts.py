"""Requests the target writes itself: a prompt source for self-distillation with no corpus behind it.

Owns: sampling the target from its chat template's bare user turn (the template up to where a
user's message would begin; the "Magpie" observation: an instruction-tuned model continues that
with the kind of request it was tuned on, ending it with its end-of-turn token), openers (the
first words of a request, written into the user turn before the target goes on: attempt i starts
with opener i mod their number, which steers the kind of request while its subject and phrasing
stay the target's), the filters a
written request must pass (it ended by itself, it has ``min_words``..``max_words`` words, it is
mostly letters, no special-token text, not a duplicate, not overlapping any benchmark workload
prompt by the corpus' own rule), and the resumable JSONL file the kept requests go to (the same
seed gives the same requests; a run that stops part-way continues where it stopped).
Ignores: answering the requests (``cluster.training.self_distill``) and the written corpus
(``cluster.training.prompt_corpus``, whose overlap rule this reuses).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cluster.common.errors import InvalidRequestError
from cluster.training.prompt_corpus import normalize, workload_overlap
from cluster.training.self_distill import generate

REQUESTS = "data/requests.jsonl"  # in a train-draft run directory
_WAVE = 256  # attempts per generate call at most (progress, and what a deadline loses)
_SENTINEL = "\u2063SPECSERVE-REQUEST\u2063"


@dataclass(frozen=True, slots=True)
class RequestFilter:
    min_words: int = 4
    max_words: int = 120
    min_letter_share: float = 0.6  # letters / non-space characters


def user_turn_prefix(tokenizer, opener: str = "") -> list[int]:
    """Token ids of the chat template up to a user message's first character (system prompt
    included when the template adds one by default), followed by ``opener``, the request's first
    words (tokenized with the template, as a request starting with them would be)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("self-written prompts need a target with a chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    if _SENTINEL not in text:
        raise InvalidRequestError("the chat template does not place the user's message where it can be found")
    prefix = text[: text.index(_SENTINEL)] + opener
    return [int(t) for t in tokenizer(prefix, add_special_tokens=False)["input_ids"]]


def keep_request(text: str, flt: RequestFilter) -> bool:
    """Whether a written request passes the content filters (length, letters, no template text)."""
    words = text.split()
    if not flt.min_words <= len(words) <= flt.max_words:
        return False
    if "<|" in text or "|>" in text or "<s>" in text or "</s>" in text:
        return False
    chars = [c for c in text if not c.isspace()]
    return sum(c.isalpha() for c in chars) >= flt.min_letter_share * len(chars)


def read_requests(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_requests(path: Path, model, tokenizer, eos_ids: frozenset[int], *, count: int, seed: int,
                   workloads: Path | None, temperature: float = 1.0, max_tokens: int = 96,
                   flt: RequestFilter = RequestFilter(), batch_size: int = 32,
                   progress: Callable[[str], None] = print, deadline: float = float("inf"),
                   max_attempts_per_request: int = 4, openers: tuple[str, ...] = ()) -> list[str]:
    """Requests the target writes from its bare user turn until ``count`` pass the filters (or
    ``max_attempts_per_request * count`` were written) -> the kept ones, in attempt order. Attempt
    i is sampled with its own generator seeded by (seed, i), so the result does not depend on
    batching or on where a run was stopped. Every attempt (kept or not) is one line of ``path``: a
    rerun with the same seed reads them back and goes on from the next attempt index (a wave the
    deadline cut is written again in full). With ``openers``, attempt i's request starts with
    ``openers[i % len(openers)]`` (part of the kept text); a file written with other openers or at
    another temperature is refused."""
    if count <= 0:
        return []
    if temperature <= 0:
        raise InvalidRequestError("self-written prompts are sampled: temperature must be > 0")
    if any(not o.strip() for o in openers):
        raise InvalidRequestError("an opener must have words in it")
    overlaps = workload_overlap(workloads)
    starts = list(openers) or [""]
    prefixes = [user_turn_prefix(tokenizer, o) for o in starts]
    rows = read_requests(path)
    # how the file's requests were written (a file from before openers and temperature were kept
    # had none, at 1.0); another way would write other requests on resume
    wanted = {"seed": seed, "openers": list(openers), "temperature": temperature}
    before = {"seed": None, "openers": [], "temperature": 1.0}
    for key, want in wanted.items():
        have = rows[0].get(key, before[key]) if rows else want
        if have != want:
            raise InvalidRequestError(f"{path} holds requests written with {key} {have}, not {want}")
    seen: set[str] = set()
    kept: list[str] = []

    def accept(text: str, ended: bool) -> bool:
        """Unfinished, filtered, duplicate and workload-overlapping requests are not kept."""
        key = normalize(text)
        if not ended or not keep_request(text, flt) or key in seen or overlaps(text):
            return False
        seen.add(key)
        return True

    for row in sorted(rows, key=lambda r: r["index"]):  # tried again: the filters may have changed
        if accept(row["text"], row["ended"]):
            kept.append(row["text"])
    next_index = 1 + max((r["index"] for r in rows), default=-1)
    limit = max_attempts_per_request * count
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    while len(kept) < count and next_index < limit and time.monotonic() < deadline:
        wave = min(limit - next_index, max(batch_size, min(_WAVE, 2 * (count - len(kept)))))
        batch = [(i, list(prefixes[i % len(prefixes)])) for i in range(next_index, next_index + wave)]
        done: dict[int, tuple[str, bool]] = {}

        def on_sample(s) -> None:
            ended = bool(s.output_ids) and s.output_ids[-1] in eos_ids
            ids = s.output_ids[:-1] if ended else s.output_ids
            start = starts[s.index % len(starts)]
            done[s.index] = ((start + tokenizer.decode(ids, skip_special_tokens=False)).strip(), ended)

        generate(model, batch, max_new_tokens=max_tokens, eos_ids=eos_ids, temperature=temperature,
                 sample_odd=False, sample_all=True, seed=seed, batch_size=batch_size, on_sample=on_sample,
                 stop=lambda: time.monotonic() >= deadline)
        if len(done) < len(batch):  # the deadline stopped the wave: written again in full on resume
            break
        with open(path, "a") as f:
            for i in sorted(done):  # in index order, so kept requests do not depend on batching
                text, ended = done[i]
                row = {"index": i, "seed": seed, "text": text, "ended": ended, "temperature": temperature}
                if openers:
                    row["openers"] = list(openers)
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                if accept(text, ended) and len(kept) < count:
                    kept.append(text)
        next_index += wave
        progress(f"self-written requests: {len(kept)}/{count} kept of {next_index} written "
                 f"({time.monotonic() - t0:.0f} s)")
    return kept[:count]
