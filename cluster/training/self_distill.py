"""Self-distillation data: the target's own continuations of the prompt corpus.

Owns: ``Sample`` (prompt ids + the target's output ids + whether it was greedy), generating them
in ragged batches on a private ``ModelRunner`` over the target's weights (greedy for even prompt
indices, temperature sampling for odd ones when asked), and the resumable JSONL file they are
appended to (a run that stops part-way continues with the prompts not yet done).
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


@torch.inference_mode()
def generate(model, prompts: list[tuple[int, list[int]]], *, max_new_tokens: int, eos_ids: frozenset[int],
             temperature: float, sample_odd: bool, seed: int, batch_size: int = 16,
             block_size: int = 16) -> list[Sample]:
    """Continue each (index, prompt ids) with the target (a ``LlamaModel``)."""
    longest = max((len(p) for _, p in prompts), default=0) + max_new_tokens
    blocks = batch_size * (-(-longest // block_size)) + 1
    runner = ModelRunner(model, blocks, block_size)
    out: list[Sample] = []
    for b0 in range(0, len(prompts), batch_size):
        batch = prompts[b0 : b0 + batch_size]
        gen = torch.Generator().manual_seed(seed * 1_000_003 + batch[0][0])  # resumable: per batch
        ids = {f"s{i}": list(p) for i, p in batch}
        greedy = {f"s{i}": not (sample_odd and i % 2) for i, _ in batch}
        outputs: dict[str, list[int]] = {k: [] for k in ids}
        chunks = [SeqChunk(k, v, 0, 1) for k, v in ids.items()]
        while chunks:
            logits = runner.forward(chunks)  # [len(chunks), V]
            nxt = []
            for row, c in enumerate(chunks):
                if greedy[c.seq_id] or temperature <= 0:
                    t = int(logits[row].argmax())
                else:
                    probs = torch.softmax(logits[row] / temperature, dim=-1)
                    t = int(torch.multinomial(probs, 1, generator=gen))
                outputs[c.seq_id].append(t)
                pos = c.start_pos + len(c.token_ids)
                if t in eos_ids or len(outputs[c.seq_id]) >= max_new_tokens:
                    runner.free(c.seq_id)
                    continue
                nxt.append(SeqChunk(c.seq_id, [t], pos, 1))
            chunks = nxt
        out += [Sample(i, list(p), outputs[f"s{i}"], greedy[f"s{i}"]) for i, p in batch]
    return out


def extend_samples(path: Path, model, prompts: list[tuple[int, list[int]]], *, token_budget: int,
                   deadline: float, progress: Callable[[str], None], **gen_kw) -> tuple[list[Sample], bool]:
    """Generate until the samples in ``path`` hold ``token_budget`` tokens (prompt + output) or the
    deadline passes, appending as it goes -> (all samples, whether the budget was reached)."""
    samples = read_samples(path)
    done = {s.index for s in samples}
    have = sum(len(s.token_ids) for s in samples)
    todo = [(i, p) for i, p in prompts if i not in done]
    batch_size = gen_kw.get("batch_size", 16)
    t0, made = time.monotonic(), 0
    path.parent.mkdir(parents=True, exist_ok=True)
    while have < token_budget and todo and time.monotonic() < deadline:
        batch, todo = todo[:batch_size], todo[batch_size:]
        new = generate(model, batch, **gen_kw)
        with open(path, "a") as f:
            for s in new:
                f.write(json.dumps(asdict(s)) + "\n")
        samples += new
        n = sum(len(s.token_ids) for s in new)
        have += n
        made += sum(len(s.output_ids) for s in new)
        rate = made / max(1e-9, time.monotonic() - t0)
        progress(f"data: {len(samples)} samples, {have}/{token_budget} tokens ({rate:.0f} generated tok/s)")
    return samples, have >= token_budget or not todo
