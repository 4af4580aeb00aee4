"""Independent reference for losslessness claims: Hugging Face ``generate`` on the same weights,
and the near-tie rule. Shared by engine, spec and service tests."""
from __future__ import annotations

import json
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
    logits: list[torch.Tensor]  # [V] fp32 raw logits at each output step


class HFReference:
    """Greedy HF generate, one prompt at a time (no padding effects), memoised."""

    def __init__(self, model_dir: Path, eos_ids: frozenset[int]) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.eos = sorted(eos_ids)
        self._memo: dict[tuple, Reference] = {}

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> Reference:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._memo:
            with torch.inference_mode():
                out = self.model.generate(
                    torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
                    max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=self.eos,
                    pad_token_id=self.eos[0], output_logits=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(prompt_ids):].tolist()
            self._memo[key] = Reference(prompt_ids, tokens, [l[0].float() for l in out.logits])
        return self._memo[key]


def check_greedy_match(ours: list[int], ref: Reference) -> str:
    """'equal', or 'near-tie@i' when the first difference is a top-2 near-tie of the reference
    logits (reference top-1 vs our token, which must be the reference top-2, gap < 1e-3).
    Raises AssertionError otherwise — nothing looser is accepted."""
    n = min(len(ours), len(ref.tokens))
    for i in range(n):
        if ours[i] != ref.tokens[i]:
            logits = ref.logits[i]
            top2 = torch.topk(logits, 2)
            gap = float(top2.values[0] - top2.values[1])
            assert int(top2.indices[0]) == ref.tokens[i], "reference token is not its own argmax"
            assert ours[i] == int(top2.indices[1]) and gap < NEAR_TIE_GAP, (
                f"diverged at output position {i}: ours {ours[i]} vs reference {ref.tokens[i]} "
                f"(reference top-2 {top2.indices.tolist()}, gap {gap:.3g}) — not a near-tie")
            return f"near-tie@{i}"
    assert len(ours) == len(ref.tokens), f"lengths differ with equal prefix: {len(ours)} vs {len(ref.tokens)}"
    return "equal"
