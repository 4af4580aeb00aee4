"""The PNG plots of the ``specserve map`` report (matplotlib, Agg backend: no display needed).

Owns: five figures — e2e p50/p99 vs concurrency per path and segment with the crossover marked;
tokens/s vs concurrency per path; α by draft position per segment and drafter; the speedup heatmap
(segment × concurrency, plain p50 / spec p50); measured vs predicted speedup — and, for each, the
series as drawn, read back from the figure's own artists (so ``map.json`` records what the PNG
shows, and a test can compare it with the numbers). Ignores: the numbers' meaning (``decide``).
"""
from __future__ import annotations

from pathlib import Path

PATH_STYLE = {"fixed_spec": ("speculative", "tab:blue"), "fixed_plain": ("plain", "tab:orange")}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _lines(ax, title: str) -> dict:
    """{label: {"x": [...], "y": [...]}} of the axes' labelled lines, as drawn."""
    out = {}
    for line in ax.get_lines():
        label = line.get_label()
        if label.startswith("_"):
            continue
        out[f"{title}/{label}"] = {"x": [float(x) for x in line.get_xdata()],
                                   "y": [float(y) for y in line.get_ydata()]}
    return out


def _grid(n: int):
    plt = _plt()
    cols = min(3, max(1, n))
    rows = -(-max(n, 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    return plt, fig, [ax for row in axes for ax in row]


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _log2_axis(ax, cells: list[dict]) -> None:
    levels = sorted({c["concurrency"] for c in cells})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(x) for x in levels])
    ax.minorticks_off()


def _by_segment(cells: list[dict]) -> dict[str, dict[str, list[dict]]]:
    out: dict[str, dict[str, list[dict]]] = {}
    for c in sorted(cells, key=lambda c: c["concurrency"]):
        out.setdefault(c["segment"], {}).setdefault(c["policy"], []).append(c)
    return out


def _panels(cells: list[dict], path: Path, title: str, ylabel: str, draw) -> dict:
    """One panel per segment, concurrency on a log2 axis; ``draw(ax, segment, {policy: cells})``."""
    by = _by_segment(cells)
    plt, fig, axes = _grid(len(by))
    series = {}
    for ax, (seg, pols) in zip(axes, by.items()):
        draw(ax, seg, pols)
        _log2_axis(ax, cells)
        ax.set_title(f"{seg}: {title}")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
        series.update(_lines(ax, seg))
    for ax in axes[len(by):]:
        ax.axis("off")
    _save(plt, fig, path)
    return series


def latency_plot(cells: list[dict], segments: dict, path: Path) -> dict:
    def draw(ax, seg, pols):
        for policy, cs in pols.items():
            name, color = PATH_STYLE.get(policy, (policy, None))
            ok = [c for c in cs if c["e2e_p50"] is not None]
            xs = [c["concurrency"] for c in ok]
            ax.plot(xs, [c["e2e_p50"] for c in ok], "o-", color=color, label=f"{name} p50")
            ax.plot(xs, [c["e2e_p99"] for c in ok], "x--", color=color, label=f"{name} p99")
        cross = (segments.get(seg) or {}).get("crossover") or {}
        if cross.get("kind") == "within":
            ax.axvline(cross["value"], color="black", linestyle=":", label="crossover")
            lo, hi = cross["ci90"]
            if lo is not None and hi is not None:
                ax.axvspan(lo, hi, color="grey", alpha=0.15)

    return _panels(cells, path, "e2e latency", "seconds", draw)


def throughput_plot(cells: list[dict], path: Path) -> dict:
    def draw(ax, seg, pols):
        for policy, cs in pols.items():
            name, color = PATH_STYLE.get(policy, (policy, None))
            ax.plot([c["concurrency"] for c in cs], [c["tokens_per_s"] for c in cs], "o-", color=color, label=name)

    return _panels(cells, path, "throughput", "tokens/s", draw)


def alpha_plot(profile: dict, path: Path) -> dict:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for seg, p in profile.items():
        for drafter, row in p.get("drafters", {}).items():
            ys = row["alpha_by_position"]
            ax.plot(list(range(1, len(ys) + 1)), ys, "o-", label=f"{seg}/{drafter}")
    ax.set_title("α by draft position")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accept | previous accepted)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, ncol=2)
    series = _lines(ax, "alpha")
    _save(plt, fig, path)
    return series


def heatmap_plot(segments: dict, path: Path) -> dict:
    plt = _plt()
    segs = [s for s, d in segments.items() if d.get("levels")]
    levels = sorted({lv for s in segs for lv in segments[s]["levels"]})
    grid = [[None] * len(levels) for _ in segs]
    for i, s in enumerate(segs):
        for lv, sp in zip(segments[s]["levels"], segments[s]["speedup_by_level"]):
            grid[i][levels.index(lv)] = sp
    fig, ax = plt.subplots(figsize=(1.2 * max(len(levels), 2) + 2, 0.6 * max(len(segs), 1) + 1.5))
    import numpy as np

    data = np.array([[np.nan if v is None else v for v in row] for row in grid], dtype=float) if segs else np.zeros((1, 1))
    im = ax.imshow(data, cmap="RdYlGn", vmin=0.5, vmax=1.5, aspect="auto")
    ax.set_xticks(range(len(levels)), [str(x) for x in levels])
    ax.set_yticks(range(len(segs)), segs)
    for i in range(len(segs)):
        for j in range(len(levels)):
            if grid[i][j] is not None:
                ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("concurrent requests")
    ax.set_title("speedup of speculation (plain p50 / spec p50)")
    fig.colorbar(im, ax=ax)
    _save(plt, fig, path)
    return {"heatmap": {"segments": segs, "levels": levels, "values": grid}}


def predicted_plot(profile: dict, segments: dict, path: Path) -> dict:
    """Left: concurrency 1, per segment × drafter (profile). Right: per swept cell, the measured
    spec/plain ratio against the cost model's."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    pts = [(row["predicted_speedup"], row["speedup"], f"{seg}/{d}") for seg, p in profile.items()
           for d, row in p.get("drafters", {}).items() if row["speedup"] is not None]
    if pts:
        a1.plot([p[0] for p in pts], [p[1] for p in pts], "o", label="segment/drafter")
        for x, y, lab in pts:
            a1.annotate(lab, (x, y), fontsize=6)
    a1.set_title("concurrency 1: measured vs predicted speedup")
    a1.set_xlabel("predicted (per-position α, c, v)")
    a1.set_ylabel("measured")
    xs, ys = [], []
    for seg, d in segments.items():
        pred = d.get("predicted_ratio") or {}
        for lv, r in zip(d.get("levels", []), d.get("ratio_spec_over_plain", [])):
            if str(lv) in pred:
                xs.append(pred[str(lv)])
                ys.append(r)
    if xs:
        a2.plot(xs, ys, "s", color="tab:green", label="swept cells")
    a2.set_title("spec/plain latency: measured vs cost model")
    a2.set_xlabel("cost model")
    a2.set_ylabel("measured")
    for ax in (a1, a2):
        lo, hi = ax.get_xlim()
        ax.plot([lo, hi], [lo, hi], ":", color="grey")
    series = {**_lines(a1, "profile"), **_lines(a2, "sweep")}
    _save(plt, fig, path)
    return series


def write_plots(state: dict, decision: dict, out: Path) -> dict[str, dict]:
    """Every plot the data allows; {file name: series as drawn}."""
    plots: dict[str, dict] = {}
    cells = (state.get("sweep") or {}).get("cells", [])
    profile = (state.get("profile") or {}).get("segments", {})
    segments = decision.get("segments", {})
    if cells:
        plots["latency.png"] = latency_plot(cells, segments, out / "latency.png")
        plots["throughput.png"] = throughput_plot(cells, out / "throughput.png")
        plots["speedup_heatmap.png"] = heatmap_plot(segments, out / "speedup_heatmap.png")
    if profile:
        plots["alpha_by_position.png"] = alpha_plot(profile, out / "alpha_by_position.png")
        plots["measured_vs_predicted.png"] = predicted_plot(profile, segments, out / "measured_vs_predicted.png")
    return plots
