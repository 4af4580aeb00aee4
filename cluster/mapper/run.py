"""``specserve map`` end to end: the plan, the three phases in order, and the files — also when
the run is cut short.

Owns: the plan (``--quick`` sampling and levels, defaults), loading the traffic and the Serve
config, phase 1 in this process, phase 2 against ``--addr`` or a local service started from the
config (and shut down after), phase 3, and writing every output. ``map.json`` is rewritten after
each phase, so even a killed run leaves what it measured; on Ctrl-C / SIGTERM or when
``--max-minutes`` is spent the phase in progress stops between requests and the map is decided
and written from what was measured (marked partial). Ignores: how each phase measures.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

QUICK_ROWS, QUICK_REQUESTS, QUICK_MAX_TOKENS, QUICK_MINUTES = 4, 4, 32, 15.0
QUICK_LEVELS = (1, 2, 4, 8, 16)
DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32)
PROFILE_K = 4  # fixed K of the profile: α is measured at positions 1..K, smaller K' predicted


@dataclass(slots=True)
class MapPlan:
    traffic: Path
    out: Path
    config: Path | None = None
    addr: str | None = None
    app_name: str = "specserve"
    token: str | None = None
    quick: bool = False
    max_minutes: float | None = None
    drafters: list[str] | None = None  # None: ``default_drafters``
    k: int = PROFILE_K
    levels: list[int] = field(default_factory=lambda: list(DEFAULT_LEVELS))
    requests: int = 16  # per sweep cell (at least the concurrency)
    rows_per_segment: int = 16  # profiled (and swept) rows per segment
    max_tokens: int | None = None  # cap on each row's max_tokens
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        from cluster.common.errors import InvalidRequestError

        if self.quick:
            self.rows_per_segment = min(self.rows_per_segment, QUICK_ROWS)
            self.requests = min(self.requests, QUICK_REQUESTS)
            self.max_tokens = min(self.max_tokens or QUICK_MAX_TOKENS, QUICK_MAX_TOKENS)
            self.levels = [c for c in self.levels if c <= QUICK_LEVELS[-1]] or list(QUICK_LEVELS)
            self.max_minutes = min(self.max_minutes or QUICK_MINUTES, QUICK_MINUTES)
        if not self.levels or any(c < 1 for c in self.levels):
            raise InvalidRequestError(f"concurrency levels must be positive integers, got {self.levels}")
        self.levels = sorted(set(self.levels))
        if not 1 <= self.k <= 16:
            raise InvalidRequestError(f"--k must be in [1, 16], got {self.k}")
        for name, v in (("--requests", self.requests), ("--rows-per-segment", self.rows_per_segment)):
            if v < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {v}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise InvalidRequestError(f"--max-minutes must be > 0, got {self.max_minutes}")


def _log(msg: str) -> None:
    print(f"specserve map: {msg}", file=sys.stderr, flush=True)


def _base_config(plan: MapPlan) -> dict:
    from deployments.local import DEFAULT_CONFIG, load_config

    return load_config(argparse.Namespace(config=plan.config or DEFAULT_CONFIG, model=None, drafter=None,
                                          placement=None, port=None))


def default_drafters(app) -> list[str]:
    """The config's drafter, n-gram, the portfolio (n-gram, suffix and the shipped EAGLE head
    where it fits) and the head alone. A model the head was not trained for refuses ``eagle``
    (reported in ``profile.errors``, the others mapped). Layer skip and draft models are
    profiled when named (``--drafters``): on the default model they never paid (α ≤ 0.11)."""
    names = ([app.drafter] if app.speculative else []) + ["ngram", "portfolio", "eagle"]
    return list(dict.fromkeys(names))


def map_workload(plan: MapPlan) -> dict:
    """Run the map; returns the state written to ``map.json``."""
    from cluster.bench.serve import local_config, raise_interrupt
    from cluster.mapper.profile import run_profile
    from cluster.mapper.progress import Budget
    from cluster.mapper.sweep import run_sweep
    from cluster.mapper.traffic import load_traffic
    from cluster.mapper.write import write_map_json
    from deployments.app_config import AppConfig

    traffic = load_traffic(plan.traffic)
    for b in traffic.bad[:20]:
        _log(f"skipped bad row {b}")
    if len(traffic.bad) > 20:
        _log(f"... {len(traffic.bad) - 20} more bad rows skipped (all in map.json)")
    base_cfg = _base_config(plan)
    app = AppConfig(**(base_cfg["applications"][0].get("args") or {}))
    sample = traffic.sample(plan.rows_per_segment, plan.seed)
    drafters = plan.drafters or default_drafters(app)
    plan.out.mkdir(parents=True, exist_ok=True)
    state: dict = {
        "version": 1, "partial": True, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "plan": {k: (str(v) if isinstance(v, Path) else v) for k, v in
                 ((f, getattr(plan, f)) for f in MapPlan.__slots__) if k != "token"},
        "drafters": drafters,
        "config": str(plan.config or "deployments/serve_config.yaml (shipped)"),
        "traffic": {"files": traffic.files, "rows": traffic.num_rows, "shares": traffic.shares(),
                    "rows_by_segment": {s: len(r) for s, r in traffic.segments.items()},
                    "sampled_rows": sample.num_rows, "bad_rows": [str(b) for b in traffic.bad]},
    }
    budget = Budget(plan.max_minutes, plan.progress)
    cap = min(plan.max_tokens or app.limits.max_tokens, app.limits.max_tokens)
    previous = signal.signal(signal.SIGTERM, raise_interrupt)  # `timeout`, a CI runner: like Ctrl-C
    try:
        state["profile"] = {"k": plan.k}
        run_profile(app, sample, drafters, plan.k, cap, budget, state["profile"])
        write_map_json(plan.out, state)
        state["sweep"] = {}
        if state["profile"].get("stopped"):
            state["sweep"]["stopped"] = "skipped: the time budget was spent in phase 1"
        elif plan.addr:
            run_sweep(plan.addr, plan.app_name, sample, plan.levels, plan.requests, cap, budget,
                      state["sweep"], plan.token, app.drafter)
        else:
            cfg = local_config(plan.config)
            from deployments.local import local_service

            _log("starting a local service from the config for phase 2 ...")
            # the replicas' access logs would drown the progress bar (they stay in Ray's log files)
            quiet = {} if "RAY_SERVE_LOG_TO_STDERR" in os.environ else {"RAY_SERVE_LOG_TO_STDERR": "0"}
            os.environ.update(quiet)
            try:
                with local_service(cfg) as (addr, name):
                    run_sweep(addr, name, sample, plan.levels, plan.requests, cap, budget, state["sweep"],
                              plan.token, app.drafter)
            finally:
                for key in quiet:
                    os.environ.pop(key, None)
    except KeyboardInterrupt:
        state["interrupted"] = True
        _log("interrupted: writing the partial map")
    except Exception as exc:  # noqa: BLE001 (e.g. the service did not start: keep what phase 1 measured)
        state["failed"] = f"{type(exc).__name__}: {exc}"
        _log(f"failed: {state['failed']}; writing the partial map")
    finally:
        signal.signal(signal.SIGTERM, previous)
    return finish(plan, state, base_cfg, app)


def finish(plan: MapPlan, state: dict, base_cfg: dict, app) -> dict:
    """Phase 3 and every file, from whatever was measured."""
    from cluster.mapper.decide import decide
    from cluster.mapper.plots import write_plots
    from cluster.mapper.report import render
    from cluster.mapper.write import write_atomic, write_configs, write_map_json

    try:
        state["partial"] = bool(state.get("interrupted") or state.get("failed") or (state.get("profile") or {}).get("stopped")
                                or (state.get("sweep") or {}).get("stopped"))
        decision = decide(state, app)
        state["decision"] = decision
        state["plots"] = write_plots(state, decision, plan.out)
        state["mapped_args"] = write_configs(plan.out, base_cfg, decision, str(plan.traffic))
        write_atomic(plan.out / "report.md", render(state, decision, state["plots"]))
    except KeyboardInterrupt:
        state["interrupted"] = True
    finally:
        state["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_map_json(plan.out, state)
    _log(f"wrote {plan.out}/" + "{map.json, serve_config.yaml, values-mapped.yaml, report.md"
         + "".join(f", {p}" for p in state.get("plots", {})) + "}" + (" (partial)" if state["partial"] else ""))
    return state
