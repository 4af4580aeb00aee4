"""``report.md`` of ``specserve map``: what a person reads first — where speculation pays on this
traffic, what the written config does, and the plots.

Owns: the markdown (summary table per segment, the knobs and why, the sweep table, the cost model,
what was skipped or cut short). Ignores: computing anything (``decide``) and drawing (``plots``).
"""
from __future__ import annotations

from cluster.bench.repeats import format_repeats


def _f(x, nd: int = 2) -> str:
    if x is None:
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _cross(d: dict) -> str:
    c = d.get("crossover")
    if not c:
        return "not swept"
    lo, hi = c["ci90"]
    if lo is None:  # even the low end of the interval never crossed in the levels run
        ci = " (90%: beyond the levels run)"
    else:
        ci = f" (90%: {_f(lo, 1)}–{'beyond' if hi is None else _f(hi, 1)})"
    if c["kind"] == "within":
        return f"{_f(c['value'], 1)}{ci}"
    if c["kind"] == "below":
        return f"≤ {c['value']:g} (never pays)"
    return f"> highest level{ci}"


def render(state: dict, decision: dict, plots: dict) -> str:
    knobs = decision.get("knobs", {})
    router = knobs.get("router", {})
    lines = ["# Workload map", ""]
    status = []
    for phase in ("profile", "sweep"):
        p = state.get(phase) or {}
        if p.get("stopped"):
            status.append(f"{phase} stopped early: {p['stopped']}")
    if state.get("interrupted"):
        status.append("interrupted (Ctrl-C): a partial map")
    if state.get("failed"):
        status.append(f"failed: {state['failed']}")
    if status:
        lines += ["**Partial map** — " + "; ".join(status) + ".", ""]
    t = state["traffic"]
    lines += [f"Traffic: {t['rows']} rows in {len(t['shares'])} segments from {', '.join(t['files'])}; "
              f"{len(t['bad_rows'])} bad rows skipped; sampled {t['sampled_rows']} rows."
              + (" Bad rows: " + "; ".join(t["bad_rows"][:5]) + ("; …" if len(t["bad_rows"]) > 5 else "") if t["bad_rows"] else ""),
              ""]
    lines += ["## Where speculation pays", "",
              "| segment | share | best drafter | K | α | speedup c=1 (measured / predicted) | crossover (measured) "
              "| crossover (cost model) | speculate |",
              "|---|---|---|---|---|---|---|---|---|"]
    for seg, d in decision.get("segments", {}).items():
        lines.append(f"| {seg} | {_f(d.get('share'))} | {d.get('best_drafter', '-')} | {d.get('best_num_draft_tokens', '-')} | "
                     f"{_f(d.get('alpha'))} | {_f(d.get('speedup_c1'))} / {_f(d.get('predicted_speedup_c1'))} | "
                     f"{_cross(d)} | {_f(d.get('predicted_crossover'), 1)} | {'yes' if d.get('speculate') else 'no'} |")
    lines += ["", "The crossover is the number of concurrent requests at which fixed speculation stops being "
              "faster than fixed plain decoding (e2e p50); below it speculate, above it batch.", "",
              "## What the written config does", "",
              f"- `drafter: {knobs.get('drafter')}`, `num_draft_tokens: {knobs.get('num_draft_tokens')}`",
              f"- `router.exit_threshold: {router.get('exit_threshold')}` (leave the SpecEngine at this many "
              f"in flight), `router.enter_threshold: {router.get('enter_threshold')}` (come back below it)",
              f"- `router.min_alpha: {router.get('min_alpha')}` (a segment whose live α falls below goes plain)"]
    for seg, own in (router.get("segments") or {}).items():
        lines.append(f"- `router.segments.{seg}`: " + ", ".join(f"{k} {v}" for k, v in own.items()))
    engine = {seg: own for seg, own in (router.get("segments") or {}).items()
              if "drafter" in own or "num_draft_tokens" in own}
    if engine:
        lines.append("- per-segment drafter / K in the SpecEngine (segments not listed: the global "
                     f"`{knobs.get('drafter')}`, K `{knobs.get('num_draft_tokens')}`): "
                     + "; ".join(f"{seg} drafts with {own.get('drafter', knobs.get('drafter'))} at K "
                                 f"{own.get('num_draft_tokens', knobs.get('num_draft_tokens'))}"
                                 for seg, own in engine.items()))
    lines += [f"- why {k}: {v}" for k, v in knobs.get("why", {}).items()]
    lines += ["", "Files: `serve_config.yaml` (`specserve serve --config serve_config.yaml`), "
              "`values-mapped.yaml` (`helm upgrade ... -f values-mapped.yaml`), `map.json` (every number).", ""]
    cm = decision.get("cost_model")
    if cm:
        lines += ["## Cost model", "",
                  f"Step time = {cm['a_s'] * 1e3:.2f} ms + {cm['beta_s_per_token'] * 1e3:.3f} ms × tokens fed + "
                  f"{cm['delta_s_per_seq'] * 1e3:.3f} ms × speculative sequences (fitted on {cm['points']} cells, "
                  f"R² {cm['r_squared']}). Predicted spec/plain latency ratio:", "",
                  "| segment | " + " | ".join(str(c) for c in cm["grid"]) + " |",
                  "|---|" + "---|" * len(cm["grid"])]
        for seg, d in decision.get("segments", {}).items():
            pr = d.get("predicted_ratio")
            if pr:
                lines.append(f"| {seg} | " + " | ".join(_f(pr[str(c)]) for c in cm["grid"]) + " |")
        lines.append("")
    cells = (state.get("sweep") or {}).get("cells", [])
    if cells:
        lines += ["## Sweep (through the service)", "",
                  "| segment | conc | path | TTFT p50 ms | TPOT p50 ms | e2e p50 s | e2e p99 s | tokens/s | α | errors |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for c in cells:
            ms = lambda x: None if x is None else x * 1e3  # noqa: E731
            lines.append(f"| {c['segment']} | {c['concurrency']} | {c['policy']} | {_f(ms(c['ttft_p50']), 1)} | "
                         f"{_f(ms(c['tpot_p50']), 1)} | {_f(c['e2e_p50'], 3)} | {_f(c['e2e_p99'], 3)} | "
                         f"{_f(c['tokens_per_s'], 1)} | {_f(c['acceptance_rate'])} | {sum(c['errors'].values())} |")
        early = state["sweep"].get("stopped_early") or {}
        if early:
            lines += ["", "Stopped early (plain won clearly): " + ", ".join(f"{s} at {c}" for s, c in early.items())]
        lines += format_repeats(state["sweep"].get("repeated_rows"))
        lines.append("")
    titles = {"latency.png": "End-to-end latency per path (crossover dotted, its 90% interval shaded)",
              "throughput.png": "Throughput per path", "speedup_heatmap.png": "Speedup by segment and concurrency",
              "alpha_by_position.png": "α by draft position", "measured_vs_predicted.png": "Measured vs predicted"}
    if plots:
        lines += ["## Plots", ""]
        for name in plots:
            lines += [f"### {titles.get(name, name)}", "", f"![{name}]({name})", ""]
    return "\n".join(lines)
