"""Phase 1 of ``specserve map``: the acceptance profile, in process, one request at a time.

Owns: per segment × drafter, each sampled row run plain and then speculative with a fixed K, back
to back (machine noise hits both alike), and from those runs: α by draft position, acceptance
length, draft cost c and verification cost v (relative to a plain decode step), the output length
distribution, the measured speedup and the speedup predicted for every K' ≤ K from the
per-position acceptance. Two ways to run a request: the real engine (``LLMEngine`` stepped here
with per-step timing, ``cluster.bench.timed_run.run_ours``; drafters share one loaded target) and any
other ``engine_impl`` of the config (e.g. ``FakeEngine``) through the engine protocol, timing the
gap between streamed deltas as the step time (no separate draft timing there: c = 0).
Ignores: concurrency (phase 2) and the choices (phase 3).

Prediction. ``p_i`` = P(the first i+1 draft tokens are all accepted | the step drafted more than
i), from the engines' ``accepted_per_position`` / ``drafted_per_position`` counters; α by position
is p_i / p_{i-1}. A step with K' drafts commits E(K') = 1 + Σ_{i<K'} p_i tokens and costs
K'·c + v(K') plain steps, with v(K') = 1 + (v - 1)·K'/K (verification cost grows with the tokens
fed). Steps that drafted nothing count as plain steps, as in ``bench spec``. Not accepted/drafted:
with K fixed, later positions are tested only after earlier ones passed, so one α for all
positions misstates the tail.
"""
from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time

from cluster.bench.spec_rows import summarize_row
from cluster.bench.timed_run import Run
from cluster.common.errors import InvalidRequestError
from cluster.mapper.progress import Budget, OutOfTime
from cluster.mapper.traffic import Traffic, sampling_params

SMALLER_K_MARGIN = 0.02  # a larger K (or any K over plain) must predict this much more speedup


# -- running one request -----------------------------------------------------------------------
class _RealEngines:
    """Plain and one speculative ``LLMEngine`` per drafter over one loaded target."""

    def __init__(self, app, drafters: list[str], k: int) -> None:
        import torch

        from cluster.bench.timed_run import engine_for
        from cluster.common.config import SpecConfig
        from cluster.models.load import load_model

        torch.set_num_threads(app.torch_threads)  # what each engine replica of the service gets
        self.target = load_model(app.model, app.engine_config(False))
        self.tokenizer = self.target.tokenizer
        self.plain = engine_for(self.target)
        self.spec_engines, self.errors = {}, {}
        for d in drafters:
            try:
                self.spec_engines[d] = engine_for(self.target, SpecConfig(drafter=d, num_draft_tokens=k))
            except Exception as exc:  # noqa: BLE001 (a drafter this model cannot run: say so, map the others)
                self.errors[d] = f"{type(exc).__name__}: {exc}"

    def ids(self, row: dict) -> list[int]:
        from cluster.models.tokenizer import row_token_ids

        return row_token_ids(self.tokenizer, row)

    def run(self, drafter: str | None, rid: str, ids: list[int], params, segment: str) -> Run:
        from cluster.bench.timed_run import run_ours
        from cluster.common.request import GenerationRequest

        engine = self.plain if drafter is None else self.spec_engines[drafter]
        return run_ours(engine, GenerationRequest(rid, list(ids), params, segment=segment))

    def close(self) -> None:
        pass


class _ProtocolEngines:
    """Any ``EngineProtocol`` class (the config's ``engine_impl``), one instance per path; the
    step time is the gap between streamed deltas."""

    def __init__(self, app, engine_cls, options: dict, drafters: list[str], k: int) -> None:
        from cluster.common.config import SpecConfig

        self.loop = asyncio.new_event_loop()
        base = app.engine_config(False)
        self.plain = engine_cls(base, **options)
        self.spec_engines, self.errors = {}, {}
        for d in drafters:
            cfg = dataclasses.replace(base, spec=SpecConfig(drafter=d, num_draft_tokens=k))
            self.spec_engines[d] = engine_cls(cfg, **options)
        for e in [self.plain, *self.spec_engines.values()]:
            self.loop.run_until_complete(e.start())

    def ids(self, row: dict) -> list[int]:
        if "messages" in row:
            return self.plain.apply_chat_template(row["messages"])
        if row.get("chat"):
            return self.plain.apply_chat_template([{"role": "user", "content": row["prompt"]}])
        return self.plain.tokenize(row["prompt"])

    def run(self, drafter: str | None, rid: str, ids: list[int], params, segment: str) -> Run:
        from cluster.common.request import GenerationRequest, SpecMode

        engine = self.plain if drafter is None else self.spec_engines[drafter]
        mode = SpecMode.PLAIN if drafter is None else SpecMode.SPECULATIVE

        async def go() -> Run:
            req = GenerationRequest(rid, list(ids), params, segment=segment, mode=mode)
            t0 = last = time.perf_counter()
            out, gaps, spec = [], [], None
            async for o in engine.generate(req):
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
                out += o.new_token_ids
                if o.finished:
                    spec = o.spec
            run = Run(time.perf_counter() - t0, len(out), out)
            steps = gaps[1:]  # the first delta includes the prefill
            if drafter is None:
                run.decode_steps = steps
            else:
                run.verify_steps = steps
            if spec is not None:
                run.take_counters(spec)
            return run

        return self.loop.run_until_complete(go())

    def close(self) -> None:
        for e in [self.plain, *self.spec_engines.values()]:
            self.loop.run_until_complete(e.shutdown())
        self.loop.close()


def build_engines(app, drafters: list[str], k: int):
    from cluster.engine.async_engine import AsyncEngine

    cls = app.engine_impl.load()
    if isinstance(cls, type) and issubclass(cls, AsyncEngine):  # ProcessEngine too: step it here
        return _RealEngines(app, drafters, k)
    return _ProtocolEngines(app, cls, dict(app.engine_impl.options), drafters, k)


# -- aggregation ---------------------------------------------------------------------------------
def position_acceptance(runs: list[Run]) -> list[float]:
    """p_i = P(first i+1 drafts accepted | step drafted > i), summed over runs."""
    acc: list[int] = []
    dr: list[int] = []
    for r in runs:
        for i, (a, d) in enumerate(zip(r.accepted_per_position, r.drafted_per_position)):
            if i >= len(dr):
                acc.append(0)
                dr.append(0)
            acc[i] += a
            dr[i] += d
    return [a / d for a, d in zip(acc, dr) if d > 0]


def alpha_by_position(p: list[float]) -> list[float]:
    """Conditional acceptance at each position: p_i / p_{i-1} (0 where nothing got that far)."""
    out, prev = [], 1.0
    for x in p:
        out.append(x / prev if prev > 0 else 0.0)
        prev = x
    return out


def predicted_speedups(p: list[float], c: float, v: float, k: int, plain_share: float = 0.0) -> dict[int, float]:
    """Predicted speedup over plain for each K' in 1..k, from per-position acceptance ``p``.
    ``plain_share``: the fraction of decode steps that draft nothing (no n-gram match)."""
    out = {}
    v = max(v, 1.0)  # K+1 tokens never verify cheaper than 1: a measured v < 1 is timing noise
    for kk in range(1, min(k, len(p)) + 1):
        e = 1.0 + sum(p[:kk])
        vk = 1.0 + (v - 1.0) * kk / k
        tokens = (1 - plain_share) * e + plain_share
        cost = (1 - plain_share) * (kk * c + vk) + plain_share
        out[kk] = round(tokens / cost, 4) if cost > 0 else 1.0
    return out


def _dist(xs: list[int]) -> dict:
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    q = lambda f: s[min(len(s) - 1, int(round(f * (len(s) - 1))))]  # noqa: E731
    return {"n": len(s), "mean": round(statistics.fmean(s), 2), "p10": q(0.1), "p50": q(0.5), "p90": q(0.9),
            "max": s[-1], "values": s}


def summarize_pair(plain: list[Run], spec: list[Run], k: int) -> dict:
    row = summarize_row(plain, spec, None, None, k)
    for key in ("hf_speedup", "hf_ms_per_token", "vs_hf"):
        row.pop(key, None)
    p = position_acceptance(spec)
    n_v = sum(len(r.verify_steps) for r in spec)
    n_p = sum(len(r.decode_steps) for r in spec)
    share = n_p / (n_v + n_p) if n_v + n_p else 0.0
    by_k = predicted_speedups(p, row["c"] or 0.0, row["v"] or 1.0, k, share)
    top = max(by_k.values(), default=0.0)
    # the smallest K within the margin of the best: more drafts that do not pay measurably only
    # add risk (a noisy v below 1 would otherwise favour the largest K on a flat curve)
    best_num_draft_tokens = min((kk for kk, sp in by_k.items() if sp >= top / (1 + SMALLER_K_MARGIN)), default=0)
    row.update(position_acceptance=[round(x, 4) for x in p],
               alpha_by_position=[round(x, 4) for x in alpha_by_position(p)],
               predicted_speedup=by_k.get(k, row["predicted_speedup"]),  # per position, at the run's K
               predicted_speedup_alpha_only=row["predicted_speedup"],
               predicted_by_k={str(kk): s for kk, s in by_k.items()},
               best_num_draft_tokens=(best_num_draft_tokens  # 0: plain
                                      if by_k.get(best_num_draft_tokens, 0.0) > 1.0 + SMALLER_K_MARGIN else 0),
               no_draft_step_share=round(share, 4),
               rows=len(spec))
    return row


# -- the phase -----------------------------------------------------------------------------------
def run_profile(app, traffic: Traffic, drafters: list[str], k: int, max_tokens: int | None,
                budget: Budget, result: dict) -> dict:
    """Fill ``result`` (segment -> drafter -> row, plus ``plain``) as rows complete, so that an
    interrupted run keeps what it measured. Returns ``result``."""
    engines = build_engines(app, drafters, k)
    result.setdefault("errors", {}).update(engines.errors)
    drafters = [d for d in drafters if d in engines.spec_engines]
    segs = result.setdefault("segments", {})
    try:
        warm = {"prompt": "Hello, how are you today?", "max_tokens": 4}  # allocations, first calls
        for d in [None, *drafters]:
            engines.run(d, f"warm-{d}", engines.ids(warm), sampling_params(warm), "warm-up")
        total = traffic.num_rows * (1 + len(drafters))
        with budget.phase("phase 1/3 profile", total) as bar:
            for seg, rows in traffic.segments.items():
                plain: list[Run] = []
                spec: dict[str, list[Run]] = {d: [] for d in drafters}
                for row in rows:
                    budget.check()
                    try:
                        ids = engines.ids(row)
                        params = sampling_params(row, max_tokens)
                        got = {d: engines.run(d, f"{row['id']}-{d or 'plain'}", ids, params, seg)
                               for d in [None, *drafters]}
                    except InvalidRequestError as exc:  # e.g. longer than the model's context
                        result.setdefault("row_errors", []).append(f"{row['id']}: {exc}")
                        continue
                    finally:
                        bar.update(1 + len(drafters))
                    plain.append(got[None])
                    for d in drafters:
                        spec[d].append(got[d])
                    t = statistics.median([x for r in plain for x in r.decode_steps] or [0.0])
                    segs[seg] = {"rows": len(plain), "constrained_rows": sum(r.get("constrained", False) for r in rows),
                                 "output_tokens": _dist([r.tokens for r in plain]),
                                 "plain_ms_per_token": round(1e3 * statistics.median([r.wall_s / max(r.tokens, 1) for r in plain]), 3),
                                 "plain_step_ms": round(1e3 * t, 3),
                                 "drafters": {d: summarize_pair(plain, spec[d], k) for d in drafters}}
    except OutOfTime as exc:
        result["stopped"] = str(exc)
    finally:
        engines.close()
    return result
