"""Self-distillation data: the target's own continuations of the prompt corpus.

Owns: ``Sample`` (prompt ids + the target's output ids + whether it was greedy), generating them
continuously batched on a private ``ModelRunner`` over the target's weights (greedy for even
prompt indices, temperature sampling for odd ones when asked, each prompt with its own seeded
generator), and the resumable JSONL file each finished sample is appended to (a run that stops
part-way continues with the prompts not yet done; samples made for other prompts are refused).
Ignores: features and logits (recomputed during training: ``cluster.training.eagle_trainer``),
and which prompts (``cluster.training.prompt_corpus``).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from cluster.common.errors import InvalidRequestError
from cluster.models.runner import ModelRunner, SeqChunk


@dataclass(slots=True)
class Sample:
    index: int  # the prompt's index in the corpus
    prompt_ids: list[int]
    output_ids: list[int]
    greedy: bool

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


def read_samples(path: Path) -> list[Sample]:
    if not path.is_file():
        return []
    return [Sample(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


@dataclass(slots=True)
class _Running:
    index: int
    prompt_ids: list[int]
    greedy: bool
    gen: torch.Generator
    output_ids: list[int]


@torch.inference_mode()
def generate(model, prompts: list[tuple[int, list[int]]], *, max_new_tokens: int, eos_ids: frozenset[int],
             temperature: float, sample_odd: bool, seed: int, sample_all: bool = False, batch_size: int = 16, block_size: int = 16,
             on_sample: Callable[[Sample], None] | None = None, admit: Callable[[], bool] = lambda: True,
             stop: Callable[[], bool] = lambda: False) -> list[Sample]:
    """Continue each (index, prompt ids) with the target (a ``LlamaModel``), continuously batched:
    up to ``batch_size`` sequences step together and a finished one's slot goes to the next prompt
    at once (its prefill shares the forward with the others' decodes). Sampled prompts draw from a
    generator seeded by (seed, prompt index), so a sample does not depend on its batch neighbours
    (the runner's logits do not either); ``sample_all`` samples every prompt. ``on_sample`` gets each sample as it finishes;
    ``admit()`` False stops taking new prompts (the running ones finish); ``stop()`` True drops
    the running ones and returns."""
    longest = max((len(p) for _, p in prompts), default=0) + max_new_tokens
    blocks = batch_size * (-(-longest // block_size)) + 1
    runner = ModelRunner(model, blocks, block_size)
    queue = list(reversed(prompts))  # pop() takes them in order
    running: dict[str, _Running] = {}
    out: list[Sample] = []
    while (queue or running) and not stop():
        chunks = [SeqChunk(k, [r.output_ids[-1]], len(r.prompt_ids) + len(r.output_ids) - 1, 1)
                  for k, r in running.items()]
        while queue and len(running) < batch_size and admit():
            i, p = queue.pop()
            greedy = not (sample_all or (sample_odd and i % 2)) or temperature <= 0
            running[f"s{i}"] = _Running(i, list(p), greedy, torch.Generator().manual_seed(seed * 1_000_003 + i), [])
            chunks.append(SeqChunk(f"s{i}", list(p), 0, 1))
        if not chunks:
            break
        logits = runner.forward(chunks).cpu()  # [len(chunks), V]: chosen on the CPU, each prompt by its generator
        for row, c in enumerate(chunks):
            r = running[c.seq_id]
            if r.greedy:
                t = int(logits[row].argmax())
            else:
                probs = torch.softmax(logits[row] / temperature, dim=-1)
                t = int(torch.multinomial(probs, 1, generator=r.gen))
            r.output_ids.append(t)
            if t in eos_ids or len(r.output_ids) >= max_new_tokens:
                runner.free(c.seq_id)
                del running[c.seq_id]
                sample = Sample(r.index, r.prompt_ids, r.output_ids, r.greedy)
                out.append(sample)
                if on_sample is not None:
                    on_sample(sample)
    for key in running:  # stopped: unfinished sequences are dropped (generated again on resume)
        runner.free(key)
    return out


def extend_samples(path: Path, model, prompts: list[tuple[int, list[int]]], *, token_budget: int,
                   deadline: float, progress: Callable[[str], None], **gen_kw) -> tuple[list[Sample], bool]:
    """Generate until the samples in ``path`` hold ``token_budget`` tokens (prompt + output) or the
    deadline passes, appending each sample as it finishes -> (all samples, whether the budget was
    reached or every prompt is done)."""
    samples = read_samples(path)
    current = dict(prompts)
    changed = [s.index for s in samples if current.get(s.index) != s.prompt_ids]
    if changed:
        raise InvalidRequestError(
            f"{path}: {len(changed)} of its samples answer other prompts than this run's (first: prompt "
            f"{changed[0]}): the prompts changed since the run started (another --prompts file or its "
            "content, another corpus); use another --out")
    done = {s.index for s in samples}
    todo = [(i, p) for i, p in prompts if i not in done]
    state = {"have": sum(len(s.token_ids) for s in samples), "made": 0, "left": len(todo)}
    every = gen_kw.get("batch_size", 16)
    t0 = time.monotonic()
    path.parent.mkdir(parents=True, exist_ok=True)

    def on_sample(s: Sample) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(asdict(s)) + "\n")
        samples.append(s)
        state["have"] += len(s.token_ids)
        state["made"] += len(s.output_ids)
        state["left"] -= 1
        if len(samples) % every == 0:
            rate = state["made"] / max(1e-9, time.monotonic() - t0)
            progress(f"data: {len(samples)} samples, {state['have']}/{token_budget} tokens ({rate:.0f} generated tok/s)")

    if state["have"] < token_budget and todo:
        generate(model, todo, on_sample=on_sample, admit=lambda: state["have"] < token_budget,
                 stop=lambda: time.monotonic() >= deadline, **gen_kw)
    return samples, state["have"] >= token_budget or state["left"] == 0
