"""One request at a time through an engine (or Hugging Face ``generate``), timed per step.

Owns: ``Run`` (a request's wall-clock, tokens, per-step walls split into prefill, plain decode and
verification steps, the drafter's seconds per round, the step's time outside the target's forward
in parts, and the request's speculation counters), ``run_ours`` (drives an ``LLMEngine`` until
the request finishes, reading the controller's ``SpecTiming`` around every step), ``run_hf``,
and ``engine_for`` (an engine over an already loaded target, with a fresh KV pool).
Used by ``bench spec``, its constrained variant, the grammar profile and the workload mapper's
profiles. Ignores: concurrency (one request at a time), sampling (greedy).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Run:
    wall_s: float
    tokens: int
    ids: list[int]
    decode_steps: list[float] = field(default_factory=list)  # plain decode step walls (no prefill)
    prefill_s: float = 0.0  # the first step's wall (the prompt's forward)
    verify_steps: list[float] = field(default_factory=list)  # verify step wall - its draft time
    round_costs: list[float] = field(default_factory=list)  # draft seconds per round, per step
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rejections: int = 0
    drafts: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # SpecStats' counters
    drafted_per_position: list[int] = field(default_factory=list)
    steps_by_num_draft_tokens: list[int] = field(default_factory=list)  # steps_by_num_draft_tokens[K]: verification steps with K drafts
    # per step (no prefill), its wall minus the target's forward in parts: (planning K and
    # choosing a drafter, the drafter, sampling / verifying the tokens, the rest of the engine)
    step_parts: list[tuple[float, float, float, float]] = field(default_factory=list)

    @property
    def host_steps(self) -> list[float]:
        """Per step (no prefill), its wall minus its drafter's and the target forward's time."""
        return [plan + sampling + other for plan, _, sampling, other in self.step_parts]

    def take_counters(self, spec) -> None:
        """The request's speculation counters (its final ``SpecStats``)."""
        self.draft_tokens, self.accepted_tokens, self.drafts = spec.draft_tokens, spec.accepted_tokens, spec.drafts
        self.rejections = spec.rejections
        self.accepted_per_position = list(spec.accepted_per_position)
        self.drafted_per_position = list(spec.drafted_per_position)
        self.steps_by_num_draft_tokens = list(spec.steps_by_num_draft_tokens)


def _timing(engine):
    t = getattr(engine.spec, "timing", None)
    return None if t is None else (t.propose_s, t.draft_rounds, t.verify_steps, t.verify_forward_s + t.plain_forward_s,
                                   t.plan_s, t.verify_s + t.plain_sample_s)


def run_ours(engine, request) -> Run:
    ids: list[int] = []
    spec = None
    walls, kinds = [], []
    t0 = time.perf_counter()
    engine.add_request(request)
    while engine.has_work():
        before = _timing(engine)
        ts = time.perf_counter()
        outs = engine.step()
        walls.append(time.perf_counter() - ts)
        after = _timing(engine)
        kinds.append(None if before is None else tuple(a - b for a, b in zip(after, before)))
        for o in outs:
            ids += o.new_token_ids
            if o.finished:
                spec = o.spec
    run = Run(time.perf_counter() - t0, len(ids), ids, prefill_s=walls[0] if walls else 0.0)
    for i, (w, k) in enumerate(zip(walls, kinds)):
        if i == 0:
            continue  # the prefill step
        if k is not None:  # what the step spent outside the drafter and the target's forward
            run.step_parts.append((k[4], k[0], k[5], w - k[0] - k[3] - k[4] - k[5]))
        if k is not None and k[2] > 0:  # a verification step
            run.verify_steps.append(w - k[0])
            if k[1] > 0:
                run.round_costs.append(k[0] / k[1])
        else:
            run.decode_steps.append(w - (k[0] if k else 0.0))
    if spec is not None:
        run.take_counters(spec)
    return run


def run_hf(model, prompt_ids: list[int], max_tokens: int, eos: list[int], **kw) -> Run:
    import torch

    with torch.inference_mode():
        inp = torch.tensor([prompt_ids])
        t0 = time.perf_counter()
        out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos[0], **kw)
        wall = time.perf_counter() - t0
    ids = out[0, len(prompt_ids):].tolist()
    return Run(wall, len(ids), ids)


def engine_for(target, spec_cfg=None, proposer=None, kv_mb: int = 128, prefix_caching: bool = True):
    from cluster.common.config import EngineConfig
    from cluster.engine.llm_engine import LLMEngine
    from cluster.engine.speculation import build_spec_controller

    config = EngineConfig(spec=spec_cfg, kv_cache_memory_mb=kv_mb, prefix_caching=prefix_caching)
    m = target.with_fresh_kv(config)
    spec = build_spec_controller(config, m, proposer) if spec_cfg is not None else None
    return LLMEngine(config, m, spec)


def request_for(rid: str, ids: list[int], max_tokens: int, segment: str):
    from cluster.common.request import GenerationRequest, SamplingParams

    return GenerationRequest(rid, list(ids), SamplingParams(max_tokens=max_tokens), segment=segment)
