"""Independent reference for losslessness claims: Hugging Face ``generate`` on the same weights,
and the near-tie rule. Shared by engine, spec and service tests."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"
SEGMENTS = ("code", "edit", "summarize", "chat", "multilingual", "json")
NEAR_TIE_GAP = 1e-3  # fp32 logit gap under which two tokens are a numeric near-tie


def workload_rows(per_segment: int = 4, max_prompt_chars: int = 1500) -> list[dict]:
    """The first ``per_segment`` rows of every workload segment (shortest-first within a cap)."""
    rows = []
    for seg in SEGMENTS:
        seg_rows = [json.loads(l) for l in open(WORKLOADS / f"{seg}.jsonl") if l.strip()]
        seg_rows = [r for r in seg_rows if len(r["prompt"]) <= max_prompt_chars]
        rows.extend(seg_rows[:per_segment])
    return rows


@dataclass
class Reference:
    prompt_ids: list[int]
    tokens: list[int]  # HF greedy output (EOS included when it stopped there)
    # the two largest fp32 raw logits at each output step and their token ids: all the near-tie
    # rule reads (a full [T, V] row per step held 0.2 MB a token, per prompt, for the whole run)
    top2_values: torch.Tensor  # [T, 2]
    top2_ids: torch.Tensor  # [T, 2]


class HFReference:
    """Greedy HF generate, one prompt at a time (no padding effects), memoised.

    ``share_dir``: a folder of this test run that the run's other pytest workers share (xdist): a
    reference one worker computed is read back by the others instead of generated again (a lock
    per prompt makes the second wait for the first). It lives and dies with the run, so every
    reference is still HF's own output on this run's weights."""

    def __init__(self, model_dir: Path, eos_ids: frozenset[int], share_dir: Path | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.eos = sorted(eos_ids)
        self._memo: dict[tuple, Reference] = {}
        self.share_dir = share_dir
        if share_dir is not None:
            share_dir.mkdir(parents=True, exist_ok=True)

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> Reference:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._memo:
            with self._shared(key) as path:
                if path is not None and path.exists():
                    tokens, values, ids = torch.load(path)
                else:
                    tokens, values, ids = self._generate(prompt_ids, max_new_tokens)
                    if path is not None:
                        torch.save((tokens, values, ids), path.with_suffix(".tmp"))
                        os.replace(path.with_suffix(".tmp"), path)
            self._memo[key] = Reference(prompt_ids, tokens, values, ids)
        return self._memo[key]

    def _generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            out = self.model.generate(
                torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=self.eos,
                pad_token_id=self.eos[0], output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt_ids):].tolist()
        if not out.logits:
            return tokens, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int64)
        top2 = torch.topk(torch.stack([l[0].float() for l in out.logits]), 2, dim=-1)  # [T, V] -> [T, 2]
        return tokens, top2.values, top2.indices

    @contextlib.contextmanager
    def _shared(self, key: tuple):
        """The file of ``key`` in ``share_dir``, held under its lock (None without a share_dir)."""
        if self.share_dir is None:
            yield None
            return
        name = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
        with open(self.share_dir / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield self.share_dir / f"{name}.pt"
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def check_greedy_match(ours: list[int], ref: Reference) -> str:
    """'equal', or 'near-tie@i' when the first difference is a top-2 near-tie of the reference
    logits (reference top-1 vs our token, which must be the reference top-2, gap < 1e-3).
    Raises AssertionError otherwise — nothing looser is accepted."""
    n = min(len(ours), len(ref.tokens))
    for i in range(n):
        if ours[i] != ref.tokens[i]:
            values, ids = ref.top2_values[i], ref.top2_ids[i]  # [2], [2]
            gap = float(values[0] - values[1])
            assert int(ids[0]) == ref.tokens[i], "reference token is not its own argmax"
            assert ours[i] == int(ids[1]) and gap < NEAR_TIE_GAP, (
                f"diverged at output position {i}: ours {ours[i]} vs reference {ref.tokens[i]} "
                f"(reference top-2 {ids.tolist()}, gap {gap:.3g}) — not a near-tie")
            return f"near-tie@{i}"
    assert len(ours) == len(ref.tokens), f"lengths differ with equal prefix: {len(ours)} vs {len(ref.tokens)}"
    return "equal"
