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
MIN_TOKENS = 32  # the shortest reference generated: the tests' budgets up to it share one generation


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
        # prompt -> (budget it was generated with, tokens, top-2 values [T, 2], top-2 ids [T, 2])
        self._memo: dict[tuple, tuple[int, list[int], torch.Tensor, torch.Tensor]] = {}
        self.share_dir = share_dir
        if share_dir is not None:
            share_dir.mkdir(parents=True, exist_ok=True)

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> Reference:
        """HF's greedy answer of at most ``max_new_tokens``. One generation per prompt serves every
        length up to the longest asked (at least MIN_TOKENS): greedy's first n tokens do not depend
        on how many more it may take, and an answer that ended (EOS) ends the same way at any
        budget past its end."""
        key = tuple(prompt_ids)
        known = self._memo.get(key)
        if known is None or not _covers(known, max_new_tokens):
            with self._shared(key) as path:
                known = torch.load(path) if path is not None and path.exists() else None
                if known is None or not _covers(known, max_new_tokens):
                    budget = max(max_new_tokens, MIN_TOKENS, known[0] if known else 0)
                    known = (budget, *self._generate(prompt_ids, budget))
                    if path is not None:
                        torch.save(known, path.with_suffix(".tmp"))
                        os.replace(path.with_suffix(".tmp"), path)
            self._memo[key] = known
        _, tokens, values, ids = known
        n = min(len(tokens), max_new_tokens)
        return Reference(prompt_ids, tokens[:n], values[:n], ids[:n])

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


def _covers(known: tuple, max_new_tokens: int) -> bool:
    """Does a generation (budget, tokens, top-2 values, top-2 ids) answer a request for
    ``max_new_tokens``: it had that budget, or it ended before using its own."""
    budget, tokens = known[0], known[1]
    return budget >= max_new_tokens or len(tokens) < budget


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
