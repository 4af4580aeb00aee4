"""`specserve bench confidence`: does an EAGLE head know when it is right? Its confidence against
acceptance on the workloads, and what a draft confidence floor (``spec.draft_stop_confidence``)
would commit per unit of cost.

Owns: the target's greedy outputs for each segment's prompts (continuously batched, equal to
Hugging Face ``generate``), the head's drafts over them teacher-forced as ``train-draft`` evaluates
(``cluster.training.eagle_trainer.ttt_unroll``: while drafts 1..k-1 are correct, the tokens fed
are the drafts themselves, so those positions are what drafting sees), and per segment
- calibration: draft position 1 binned by the head's probability of its token, the share the
  target accepts (a calibrated head: share ≈ probability);
- α by draft position (conditional), at every anchor and at the steps a greedy engine drafting
  ``--steps`` tokens takes (what ``bench spec``'s eagle rows measure: a step starts after a
  rejection or a bonus token, harder than the average anchor);
- at those steps, the share whose target token is among the head's best 1..4 first-draft choices
  (what a tree with siblings at draft position 1 would catch, beyond the chain's first choice);
- the step model: a greedy engine stepping through each output (its first step at the prompt's
  last position, each next one after the accepted drafts and the target's token); a step that
  drafts d tokens costs 1 + d (c + v) target decode steps (c: a draft round, v: a verified
  position beyond the first, both as fractions of a step; defaults from the ``bench spec`` rows
  of the shipped head) and commits 1 + (accepted); tokens per unit cost for a fixed K = 1..steps
  and for each floor with K capped at ``--steps`` (a draft stops after the token whose running
  product of probabilities falls below the floor).
Ignores: wall-clock time (``bench spec`` measures the floor's speed side by side:
``--compare-stop-confidence``). A model, not a measurement: after a rejected draft the drafts that
would follow are not computed (the fed tokens are the target's), so how many get drafted there is
an estimate; what a rejected step commits is exact.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.common.prompt_rows import DEFAULT_WORKLOADS

BINS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
TOP_RANKS = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="target model source (default: SmolLM2-135M-Instruct)")
    p.add_argument("--head", default="eagle", help="eagle (the shipped head) or eagle:DIR")
    p.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    p.add_argument("--segments", default="chat,code,json", help="comma-separated segment names")
    p.add_argument("--prompts-per-segment", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=256, help="cap on each row's max_tokens")
    p.add_argument("--steps", type=int, default=5, help="draft positions evaluated (the K cap of the floors)")
    p.add_argument("--floors", default="0.05,0.1,0.15,0.2,0.25,0.3,0.4,0.5", help="comma-separated floors in (0, 1)")
    p.add_argument("--c", type=float, default=0.08, help="a draft round's cost, as a fraction of a decode step")
    p.add_argument("--v", type=float, default=0.04, help="a verified position's extra cost, fraction of a step")
    p.add_argument("--json", type=Path, required=True, help="output JSON file")
    p.add_argument("--threads", type=int, default=None, help="torch threads")


Chain = list[tuple[float, bool]]  # per draft position k = 1..: (the head's probability of its draft, correct)


@dataclass(slots=True)
class SampleChains:
    """One greedy output's drafts, teacher forced: ``by_anchor[t]`` is the chain drafted at anchor t
    (empty where no draft falls inside the sample); ``first`` is the anchor of the engine's first
    step (the prompt's last position: the first output token comes from the prefill)."""

    first: int
    by_anchor: list[Chain]
    # per anchor: the rank of the target's token among the head's first-draft choices (0: its top
    # choice, ..., TOP_RANKS: not among its TOP_RANKS best); what a tree of siblings at draft 1 catches
    first_rank: list[int] | None = None

    @property
    def anchors(self) -> list[Chain]:
        return [c for c in self.by_anchor if c]


def chains(head, model, samples, steps: int, row_tokens: int = 1024) -> list[SampleChains]:
    """Each sample's chains: per anchor (a position whose next draft is an output token of the
    sample) [(the head's probability of its draft k, draft k correct)] for k = 1.. while inside
    the sample (teacher forced)."""
    import torch

    from cluster.training.eagle_trainer import row_runner, target_row, ttt_unroll

    runner = row_runner(model, row_tokens)
    out = []
    with torch.inference_mode():
        for s in samples:
            row = target_row(runner, [s], row_tokens, head.draft_to_target, head.cfg.feature_layers)
            T = row.ids.shape[0]
            per = []
            for k, logits, valid, src in ttt_unroll(head, model.embed, row, steps):
                p, arg = torch.softmax(logits, dim=-1).max(-1)  # [T]
                truth = row.ids[(src + 1).clamp(max=T - 1)]  # [T]
                correct = head.draft_to_target[arg] == truth
                per.append((p.tolist(), correct.tolist(), valid.tolist()))
                if k == 0:
                    top = head.draft_to_target[logits.topk(min(TOP_RANKS, logits.shape[-1]), dim=-1).indices]  # [T, R]
                    hit = top == truth[:, None]
                    first_rank = torch.where(hit.any(-1), hit.float().argmax(-1), TOP_RANKS).tolist()
            by_anchor = []
            for t in range(T):
                chain = []
                for p, correct, valid in per:
                    if not valid[t]:
                        break
                    chain.append((p[t], bool(correct[t])))
                by_anchor.append(chain)
            out.append(SampleChains(len(s.prompt_ids) - 1, by_anchor, first_rank))
    return out


def _draft(chain: Chain, k: int, floor: float) -> tuple[int, int]:
    """(drafted, accepted) drafting up to ``k`` tokens, stopping after the token whose running
    probability product falls below ``floor``."""
    run, accepted, alive, d = 1.0, 0, True, 0
    for p, correct in chain[:k]:
        d += 1
        alive = alive and correct
        accepted += alive
        run *= p
        if run < floor:
            break
    return d, accepted


def _steps(sample: SampleChains, k: int, floor: float):
    """Yield (anchor, drafted, accepted) for each step a greedy engine drafting up to ``k`` tokens
    under ``floor`` takes through the sample (the next step starts after the accepted drafts and
    the target's token)."""
    t = sample.first
    while 0 <= t < len(sample.by_anchor) and sample.by_anchor[t]:
        d, accepted = _draft(sample.by_anchor[t], k, floor)
        yield t, d, accepted
        t += accepted + 1


def step_model(samples: list[SampleChains], k: int, floor: float, c: float, v: float) -> dict:
    """A greedy engine drafting up to ``k`` tokens a step under ``floor`` -> tokens committed per
    unit cost (a step: 1 + drafted (c + v)), per step, drafts per step, and α by draft position at
    those steps (what ``bench spec`` measures)."""
    committed = cost = drafted = steps = 0.0
    asked, right = [0] * k, [0] * k
    for sample in samples:
        for t, d, accepted in _steps(sample, k, floor):
            for j in range(min(d, accepted + 1)):
                asked[j] += 1
                right[j] += sample.by_anchor[t][j][1]
            committed += 1 + accepted
            cost += 1 + d * (c + v)
            drafted += d
            steps += 1
    n = max(steps, 1)
    return {"steps": int(steps), "tokens_per_cost": round(committed / cost, 4) if cost else None,
            "tokens_per_step": round(committed / n, 4), "drafts_per_step": round(drafted / n, 4),
            "alpha_by_position": [round(r / a, 4) if a else None for r, a in zip(right, asked)]}


def first_draft_top(samples: list[SampleChains], k: int) -> list[float | None]:
    """At the steps of a greedy engine drafting ``k`` tokens: the share whose target token is among
    the head's best 1, 2, .., TOP_RANKS first-draft choices (what siblings at draft 1 would catch)."""
    ranks = [sample.first_rank[t] for sample in samples if sample.first_rank is not None
             for t, _, _ in _steps(sample, k, 0.0)]
    return [round(sum(r < n for r in ranks) / len(ranks), 4) if ranks else None for n in range(1, TOP_RANKS + 1)]


def segment_report(samples: list[SampleChains], steps: int, floors: list[float], c: float, v: float) -> dict:
    anchors = [chain for sample in samples for chain in sample.anchors]
    calibration = []
    for lo, hi in zip(BINS, BINS[1:]):
        hits = [ok for chain in anchors for p, ok in chain[:1] if lo <= p < hi or (hi == 1.0 and p == 1.0)]
        calibration.append({"p": [lo, hi], "anchors": len(hits),
                            "accepted": round(sum(hits) / len(hits), 4) if hits else None})
    alpha = []
    for k in range(steps):
        asked = [chain for chain in anchors if len(chain) > k and all(ok for _, ok in chain[:k])]
        alpha.append(round(sum(chain[k][1] for chain in asked) / len(asked), 4) if asked else None)
    fixed = {str(k): step_model(samples, k, 0.0, c, v) for k in range(1, steps + 1)}
    floored = {f"{f:g}": step_model(samples, steps, f, c, v) for f in floors}
    best_fixed = max(fixed, key=lambda k: fixed[k]["tokens_per_cost"] or 0)
    best_floor = max(floored, key=lambda f: floored[f]["tokens_per_cost"] or 0)
    return {"anchors": len(anchors), "calibration": calibration, "alpha_by_position": alpha,
            "step_alpha_by_position": fixed[str(steps)]["alpha_by_position"],
            "step_first_draft_top": first_draft_top(samples, steps),
            "fixed_k": fixed, "floors": floored, "best_fixed_k": int(best_fixed), "best_floor": float(best_floor),
            "best_floor_over_best_fixed_k": round(floored[best_floor]["tokens_per_cost"]
                                                  / fixed[best_fixed]["tokens_per_cost"], 4) if anchors else None}


def _refusal(args: argparse.Namespace, floors: list[float] | None) -> str | None:
    if floors is None or not floors or not all(0.0 < f < 1.0 for f in floors):
        return f"--floors must be comma-separated numbers in (0, 1), got {args.floors!r}"
    if args.steps < 1 or args.prompts_per_segment < 1 or args.max_tokens < 1:
        return "--steps, --prompts-per-segment and --max-tokens must be >= 1"
    if not (0.0 <= args.c < 1.0 and 0.0 <= args.v < 1.0):
        return f"--c and --v are fractions of a decode step in [0, 1), got {args.c}, {args.v}"
    return None


def _floors(text: str) -> list[float] | None:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        return None


def run(args: argparse.Namespace) -> int:
    floors = _floors(args.floors)
    refusal = _refusal(args, floors)
    if refusal:
        print(f"bench confidence: {refusal}", file=sys.stderr)
        return 2
    import torch

    from cluster.common.config import EngineConfig
    from cluster.common.prompt_rows import read_prompt_rows
    from cluster.models.load import load_model
    from cluster.models.tokenizer import prompt_token_ids
    from cluster.speculative.head_formats import load_any_head
    from cluster.speculative.proposer import DrafterKind, parse_drafter_choice
    from cluster.training.self_distill import generate

    choice = parse_drafter_choice(args.head)
    if choice is None or choice.kind is not DrafterKind.EAGLE:
        print(f"bench confidence: --head must be eagle or eagle:DIR, got {args.head!r}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    target = load_model(args.model, EngineConfig(model=args.model, num_kv_blocks=2))
    model = target.runner.model
    head = load_any_head(Path(choice.model), model).eval()
    report = {"model": target.name, "head": choice.model,
              "config": {k: getattr(args, k) for k in ("segments", "prompts_per_segment", "max_tokens", "steps", "c", "v")}
              | {"floors": floors}, "segments": {}}
    for seg in [s.strip() for s in args.segments.split(",") if s.strip()]:
        rows = read_prompt_rows(args.workloads / f"{seg}.jsonl", args.prompts_per_segment)
        samples = []
        for i, r in enumerate(rows):  # one by one: each prompt's own max_tokens
            samples += generate(model, [(i, prompt_token_ids(target.tokenizer, r))],
                                max_new_tokens=min(int(r.get("max_tokens", args.max_tokens)), args.max_tokens),
                                eos_ids=target.eos_token_ids, temperature=0.0, sample_odd=False, seed=0)
        rep = report["segments"][seg] = segment_report(chains(head, model, samples, args.steps), args.steps,
                                                       floors, args.c, args.v)
        print(f"{seg}: {rep['anchors']} anchors, α by position {rep['alpha_by_position']}, at the steps of a greedy "
              f"K = {args.steps} engine {rep['step_alpha_by_position']} (the target's token among the head's best "
              f"1..{TOP_RANKS} first drafts there: {rep['step_first_draft_top']}); calibration "
              + " ".join(f"[{b['p'][0]:.1f},{b['p'][1]:.1f}):{b['accepted']}" for b in rep["calibration"] if b["anchors"]))
        print("  tokens per unit cost: fixed K " + " ".join(f"{k}:{m['tokens_per_cost']}" for k, m in rep["fixed_k"].items())
              + f"; floors (K <= {args.steps}) " + " ".join(f"{f}:{m['tokens_per_cost']}" for f, m in rep["floors"].items())
              + f"; best floor {rep['best_floor']:g} / best fixed K {rep['best_fixed_k']}: {rep['best_floor_over_best_fixed_k']}")
    report["seconds"] = round(time.perf_counter() - t0, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    return 0
