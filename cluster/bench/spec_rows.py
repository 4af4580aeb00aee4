"""From timed runs to a ``bench spec`` row: speedups, α, costs and the prediction.

Owns: ``summarize_row`` (one segment x method row from its runs and the plain runs of the same
prompts) and the numbers it is made of.
speedup = median over prompts of plain wall-clock / spec wall-clock (whole request, prefill
included); ``pooled_speedup`` = all prompts' plain wall-clock over all of the row's; each row keeps
its per-prompt wall-clocks (``wall_s``), so two rows compare prompt by prompt too.
Costs are relative to t, the median wall time of one plain decode step (same segment):
c = draft time per draft round / t, v = (verification step wall time - its draft time) / t
(median over verification steps; the engine's bookkeeping and rejection sampling are in v).
A step's time outside the target's forward is split by part (``step_ms_parts``, means): planning
K (with a portfolio: its choice and its model-free members' drafts), the drafter, sampling, the
rest of the engine.
α is the per-position acceptance probability, accepted / (accepted + rejections)
(``cluster.speculative.acceptance``) — the unit of the formula; ``acceptance_rate`` (accepted /
drafted, biased low) is reported beside it but predicts nothing. predicted_speedup =
E(α,K) / (K·c + v) with E(α,K) = (1-α^(K+1)) / (1-α), summed over the run's verification steps
by their K (n_K steps drafted K tokens); decode steps of the spec run that drafted nothing
(ngram found no match, auto chose 0) count as plain steps (n_p):
(Σ_K n_K·E(α,K) + n_p) / (Σ_K n_K·(K·c + v) + n_p) — ``predicted_speedup``.
Ignores: the goals (``cluster.bench.spec_goals``), how the runs were made (``cluster.bench.timed_run``).
"""
from __future__ import annotations

import math
import statistics

from cluster.bench.timed_run import Run
from cluster.speculative.acceptance import expected_committed


def pooled_by_round(plain: list[Run], spec: list[Run], rounds: list[int]) -> list[float | None]:
    """Per round (fresh engines), its prompts' plain wall-clock over the row's."""
    out = []
    for rnd in sorted(set(rounds)):
        mine = [(p, s) for p, s, r in zip(plain, spec, rounds) if r == rnd]
        spent = sum(s.wall_s for _, s in mine)
        out.append(rounded(sum(p.wall_s for p, _ in mine) / spent) if spent else None)
    return out


def step_ms_parts(runs: list[Run]) -> dict[str, float] | None:
    """Mean milliseconds a decode step spends outside the target's forward, by part (they add up
    to the mean of wall - forward): ``plan`` (K per sequence; adaptive K's draft contexts, and a
    portfolio's choice, its model-free members' drafts included), ``drafter`` (``propose``: a
    single drafter's draft, a portfolio's costly member's rounds), ``sampling`` (verification's
    rejection sampling, a plain step's sampling), ``other`` (scheduling, KV, commit, detokenizing)."""
    parts = [p for r in runs for p in r.step_parts]
    if not parts:
        return None
    return {name: rounded(1e3 * sum(p[i] for p in parts) / len(parts), 3)
            for i, name in enumerate(("plan", "drafter", "sampling", "other"))}


def alpha_of(runs: list[Run]) -> float:
    """Per-position α of the runs together: accepted / (accepted + rejections); 0 without drafts."""
    accepted = sum(r.accepted_tokens for r in runs)
    trials = accepted + sum(r.rejections for r in runs)
    return accepted / trials if trials else 0.0


def position_counts(runs: list[Run]) -> tuple[list[int], list[int]]:
    """(accepted, drafted) per draft position, summed over the runs (``SpecStats``' counters)."""
    acc: list[int] = []
    drafted: list[int] = []
    for r in runs:
        for i, (a, d) in enumerate(zip(r.accepted_per_position, r.drafted_per_position)):
            while len(acc) <= i:
                acc.append(0)
                drafted.append(0)
            acc[i] += a
            drafted[i] += d
    return acc, drafted


def alpha_by_position(runs: list[Run], fixed: bool) -> list[float]:
    """α at draft position 1, 2, …: P(draft token i accepted | tokens 1..i-1 accepted). Position 1
    is exact at any K (accepted first tokens / drafts); later positions only at a fixed K, where
    every draft reaches them (accepted[i] / accepted[i-1]), so auto-K rows give position 1 alone."""
    acc, drafted = position_counts(runs)
    if not drafted or not drafted[0]:
        return []
    out = [acc[0] / drafted[0]]
    if fixed:
        out += [acc[i] / acc[i - 1] for i in range(1, len(acc)) if acc[i - 1]]
    return [round(a, 4) for a in out]


def steps_by_k(runs: list[Run]) -> list[int]:
    """[K] verification steps that drafted K tokens, over the runs together."""
    out: list[int] = []
    for r in runs:
        for k, n in enumerate(r.steps_by_num_draft_tokens):
            while len(out) <= k:
                out.append(0)
            out[k] += n
    return out


def member_counts(engine) -> dict[str, dict] | None:
    """A portfolio engine's per-member counters (steps, draft tokens, accepted), else None."""
    from cluster.speculative.proposer import MemberStatsProposer

    spec = getattr(engine, "spec", None)
    proposer = getattr(spec, "proposer", None)
    return proposer.drafter_stats() if isinstance(proposer, MemberStatsProposer) else None


def member_delta(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Per member, the counters gained between two ``member_counts`` snapshots."""
    return {m: {k: v - before.get(m, {}).get(k, 0) for k, v in counts.items()} for m, counts in after.items()}


def predicted_speedup(alpha: float, steps: list[int], c: float, v: float, plain_steps: int = 0,
                      plain_cost: float = 1.0, prefill: float = 0.0) -> float:
    """Speedup over plain decoding the cost model predicts from per-position ``alpha``: steps[K]
    verification steps drafted K tokens, each committing E(α, K) tokens at K·c + v plain-step
    times; ``plain_steps`` decode steps drafted nothing (1 token each, ``plain_cost`` plain-step
    times: the speculative engine's own decode step); both runs also spend ``prefill`` plain-step
    times on the prompts (what end-to-end wall-clocks include)."""
    tokens = plain_steps + sum(n * expected_committed(alpha, k) for k, n in enumerate(steps) if k > 0)
    cost = plain_steps * plain_cost + sum(n * (k * c + v) for k, n in enumerate(steps) if k > 0)
    return (prefill + tokens) / (prefill + cost) if cost > 0 else 1.0


def median_of(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else None


def rounded(x, nd=4):
    return None if x is None else round(float(x), nd)


def mean_of(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def _predicted_pooled(alpha: float, spec: list[Run], t_mean: float | None) -> float:
    """``predicted_speedup`` over all of a row's prompts together, each cost its mean over them (a
    total time is a sum: medians understated the skewed verification steps), the prefills
    included: what the row's pooled speedup (all plain wall-clock over all of its own) measures.
    Plugged with median costs and no prefill, it overstated n-gram at K = 4 on summarize and
    multilingual by 13-18% (measured 0.82-0.87 of it) — on those segments speculation takes the
    decode time to half, so the prompts' forwards weigh twice as much in the end-to-end time."""
    if not t_mean:
        return 1.0
    c = mean_of([x for r in spec for x in r.round_costs]) or 0.0
    v = mean_of([x for r in spec for x in r.verify_steps])
    d = mean_of([x for r in spec for x in r.decode_steps])
    return predicted_speedup(alpha, steps_by_k(spec), c / t_mean, (v or t_mean) / t_mean,
                             sum(len(r.decode_steps) for r in spec), (d or t_mean) / t_mean,
                             sum(r.prefill_s for r in spec) / t_mean)


def summarize_row(plain: list[Run], spec: list[Run], hf_plain: list[Run] | None, hf: list[Run] | None,
                  k_label: int | str) -> dict:
    t = median_of([x for r in plain for x in r.decode_steps])
    t_mean = mean_of([x for r in plain for x in r.decode_steps])
    drafted = sum(r.draft_tokens for r in spec)
    drafts = sum(r.drafts for r in spec)
    alpha = alpha_of(spec)
    mal = (sum(r.accepted_tokens for r in spec) + drafts) / drafts if drafts else 1.0
    k_mean = drafted / drafts if drafts else 0.0
    c = median_of([x for r in spec for x in r.round_costs])
    v = median_of([x for r in spec for x in r.verify_steps])
    c = (c / t) if (c is not None and t) else 0.0
    v = (v / t) if (v is not None and t) else 1.0
    predicted = _predicted_pooled(alpha, spec, t_mean)
    row = {
        "k": k_label,
        "k_mean": rounded(k_mean, 3),
        "alpha": rounded(alpha),
        "acceptance_rate": rounded(sum(r.accepted_tokens for r in spec) / drafted if drafted else 0.0),
        "mean_acceptance_length": rounded(mal),
        "alpha_by_position": alpha_by_position(spec, fixed=k_label != "auto"),
        "speedup": rounded(median_of([p.wall_s / s.wall_s for p, s in zip(plain, spec)])),
        # all prompts' plain wall-clock over all of theirs: the aggregate the prediction is of
        "pooled_speedup": rounded(sum(p.wall_s for p in plain) / sum(s.wall_s for s in spec)) if spec else None,
        "predicted_speedup": rounded(predicted),
        "c": rounded(c),
        "v": rounded(v),
        # the host's share of a step (scheduling, planning K, choosing a drafter, verifying): wall
        # minus the drafter's and the target forward's time, median over the rows' decode steps
        "host_ms_per_step": rounded(1e3 * h, 3) if (h := median_of([x for r in spec for x in r.host_steps])) is not None else None,
        "step_ms_parts": step_ms_parts(spec),
        "ms_per_token": rounded(median_of([1e3 * s.wall_s / max(s.tokens, 1) for s in spec]), 3),
        "plain_ms_per_token": rounded(median_of([1e3 * p.wall_s / max(p.tokens, 1) for p in plain]), 3),
        "outputs_equal_plain": sum(p.ids == s.ids for p, s in zip(plain, spec)),
        "wall_s": [rounded(s.wall_s, 4) for s in spec],  # per prompt, in order: paired ratios between rows
        "hf_speedup": None,
        "hf_ms_per_token": None,
        "vs_hf": None,
    }
    if hf and hf_plain:
        row["hf_speedup"] = rounded(median_of([p.wall_s / s.wall_s for p, s in zip(hf_plain, hf)]))
        row["hf_ms_per_token"] = rounded(median_of([1e3 * s.wall_s / max(s.tokens, 1) for s in hf]), 3)
        row["vs_hf"] = rounded(row["hf_ms_per_token"] / row["ms_per_token"]) if row["ms_per_token"] else None
    return row
