"""`specserve bench spec`: speculative decoding per workload segment and drafter, at concurrency 1,
against our own plain decoding and against Hugging Face's assisted generation on the same prompts.

Owns: the methods (``Drafters``: engines sharing one loaded target — plain; ngram, self:L, draft
model and an EAGLE head (``eagle:DIR``), each with a fixed K and with ``auto`` K; suffix (over the
shipped corpus, none: ``suffix:cold``, or another: ``suffix:FILE``) and portfolio with ``auto`` K, on request
— one engine per method for a round, so they learn from
the segment's earlier prompts as a service would), deriving the draft model (first L target
layers, see ``cluster.models.derive``), picking L by a quick measurement, the HF peers
(``HfPeers``: plain ``generate``, ``prompt_lookup_num_tokens``, ``assistant_model``,
``assistant_early_exit``), the rounds (``run_rounds``: ``--rounds N`` runs everything again on
fresh engines) and the JSON report (``build_report``). Elsewhere: one timed request
(``cluster.bench.timed_run``), a row's numbers and the prediction (``cluster.bench.spec_rows``),
the goals and the table (``cluster.bench.spec_goals``).
Ignores: concurrency > 1 and the service path (``bench serve``), raw forward speed (``bench decode``).

Method. For every prompt, every method runs once, back to back (ours plain, ours spec variants, HF
plain, HF variants; the order rotated by one per prompt), so machine noise hits all of them
alike; a row reports medians over prompts (over every round's prompts with ``--rounds``, and
``pooled_speedup_by_round``: one 12-prompt run's portfolio / n-gram ratio on edit moved between
0.95 and 1.04 from run to run on the 2-core machine, so a 3% floor needs several). Each row keeps
its per-prompt wall-clocks, so two rows compare prompt by prompt too (the portfolio against
n-gram: ``portfolio_over_ngram_paired`` beside its goal).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cluster.bench.spec_goals import format_table, goals
from cluster.bench.spec_rows import (alpha_of, median_of, member_counts, member_delta, pooled_by_round,
                                     predicted_speedup, rounded, summarize_row)
from cluster.bench.timed_run import Run, engine_for, request_for, run_hf, run_ours
from cluster.common.config import COLD_SUFFIX, DRAFT_STOP_CONFIDENCE, suffix_corpus_name
from cluster.common.prompt_rows import DEFAULT_WORKLOADS, read_prompt_rows

SEGMENTS = ("code", "edit", "summarize", "chat", "multilingual", "json")
DRAFTER_KINDS = ("ngram", "self", "draft", "suffix", "suffix:cold", "portfolio")
DEFAULT_DRAFTERS = ("ngram", "self", "draft")
SELF_CANDIDATES = (4, 8, 15, 22)
LEARNING_DRAFTERS = ("suffix", "portfolio")  # they learn every finished request of a segment
LEARNING_ROWS = ("suffix", "suffix:cold", "portfolio")  # suffix:cold: no suffix corpus, traffic only


def runs_per_prompt(method: str, repeats: int) -> int:
    """How many times ``method`` runs each prompt: ``repeats``, except a drafter that learns from
    finished requests runs it once — its second run drafts the first run's answer back, and the
    median-time run kept was that copy (a portfolio "3.7x faster than plain" on chat)."""
    # portfolio@stop0/..., portfolio[...]/..., portfolio:<head>/...
    drafter = method.split("/")[0].split("@")[0].split("[")[0].split(":")[0]
    return 1 if drafter in LEARNING_DRAFTERS else max(1, repeats)


def method_order(names: list[str], prompt_index: int) -> list[str]:
    """The order the methods run in on a segment's ``prompt_index``-th prompt: rotated by one per
    prompt, so that no method always runs first or last of the prompt's runs (a fixed order put
    plain first and the EAGLE rows last on every prompt: whatever drifts over a prompt's half
    minute of runs would bias the ratios between them the same way every time)."""
    shift = prompt_index % len(names) if names else 0
    return names[shift:] + names[:shift]


def _corpus(value: str) -> str:
    value = suffix_corpus_name(value)
    if value != COLD_SUFFIX and not Path(value).is_file():
        raise ValueError(value)
    return value


_corpus.__name__ = "'cold' (its suffix member without a corpus) or a corpus file that exists"
# the portfolio's choosing settings ``--compare-portfolio`` may change (cluster/speculative/portfolio.py),
# and ``suffix_corpus=cold|FILE``: its suffix member's corpus (SpecConfig.suffix_corpus)
PORTFOLIO_KNOBS = {"explore_every": int, "probe_z": float, "probe_memory": float, "probe_budget": float,
                   "min_gain": float, "catch_up_steps": int, "verify_slope": float, "prior_alpha": float,
                   "suffix_corpus": _corpus}
SPEC_KNOBS = ("suffix_corpus",)  # of those, the ones set in the engine's SpecConfig, not on the portfolio


def portfolio_variant(text: str) -> dict:
    """``FIELD=VALUE[,FIELD=VALUE]`` -> the portfolio settings it changes; ValueError saying what is
    wrong (an unknown field, a value of the wrong type or one the portfolio refuses)."""
    from cluster.speculative.portfolio import Member, PortfolioProposer

    changes: dict = {}
    for part in [x.strip() for x in text.split(",") if x.strip()]:
        field_name, sep, value = part.partition("=")
        if not sep or field_name not in PORTFOLIO_KNOBS:
            raise ValueError(f"{part!r}: expected FIELD=VALUE with FIELD one of {', '.join(PORTFOLIO_KNOBS)}")
        try:
            changes[field_name] = PORTFOLIO_KNOBS[field_name](value)
        except ValueError:
            raise ValueError(f"{part!r}: {field_name} takes a {PORTFOLIO_KNOBS[field_name].__name__}") from None
    if not changes:
        raise ValueError(f"{text!r}: no FIELD=VALUE")
    PortfolioProposer([Member("check", None)], **{k: v for k, v in changes.items()  # its own checks of the values
                                                  if k not in SPEC_KNOBS})
    return changes


def variant_name(changes: dict) -> str:
    def shown(k, v) -> str:
        if isinstance(v, float):
            return f"{v:g}"
        return Path(v).stem if k == "suffix_corpus" and v != COLD_SUFFIX else str(v)  # as _corpus read it

    return "portfolio[" + ",".join(f"{k}={shown(k, v)}" for k, v in changes.items()) + "]/auto"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="target model source (default: SmolLM2-135M-Instruct)")
    p.add_argument("--workloads", type=Path, default=DEFAULT_WORKLOADS)
    p.add_argument("--json", type=Path, required=True, help="output JSON file")
    p.add_argument("--segments", default=",".join(SEGMENTS), help="comma-separated segment names")
    p.add_argument("--drafters", default=",".join(DEFAULT_DRAFTERS),
                   help="comma-separated: ngram, self, draft, suffix, portfolio (suffix and portfolio: adaptive K rows), "
                        "eagle (the head shipped for the default model), eagle:DIR (a trained head; several heads "
                        "run side by side: the first's rows are eagle/..., the others' eagle:<dir name>/...), "
                        "portfolio:DIR (the portfolio holding the head in DIR; row portfolio:<dir name>/auto), "
                        "suffix:cold (no corpus), suffix:FILE (over the corpus in FILE; row suffix:<file stem>/auto)")
    p.add_argument("--prompts-per-segment", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128, help="cap on each row's max_tokens")
    p.add_argument("--ngram-k", type=int, default=4, help="fixed K of the ngram rows")
    p.add_argument("--model-k", type=int, default=3, help="fixed K of the self and draft-model rows")
    p.add_argument("--self-layers", type=int, default=None, help="L of self:L (default: measured)")
    p.add_argument("--draft-layers", type=int, default=None, help="layers of the derived draft (default: L of self)")
    p.add_argument("--draft-stop-confidence", type=float, default=None,
                   help="every method's draft_stop_confidence (adaptive K: a model drafter stops once the product "
                        "of its drafts' probabilities falls below it; default: the engine's)")
    p.add_argument("--compare-stop-confidence", type=float, default=None,
                   help="also run eagle/auto and portfolio/auto at this draft_stop_confidence, side by side "
                        "(rows eagle@stopX/auto, portfolio@stopX/auto)")
    p.add_argument("--compare-portfolio", action="append", default=[], metavar="FIELD=VALUE[,FIELD=VALUE]",
                   help="also run portfolio/auto with these settings of the portfolio's choice changed, side by "
                        f"side (row portfolio[FIELD=VALUE]/auto; repeatable; fields: {', '.join(PORTFOLIO_KNOBS)})")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face peers")
    p.add_argument("--hf-auto", action="store_true",
                   help="also run HF's adaptive variants (default assistant schedule) as peers of the auto rows")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every method on each prompt, round-robin; the median-time run counts "
                        "(suffix and portfolio run each prompt once: a second run would copy the first's answer)")
    p.add_argument("--rounds", type=int, default=1,
                   help="the whole benchmark this many times, each round on fresh engines (learning and adaptive K "
                        "start over; suffix and portfolio rows repeat too): rows pool every round's runs, and "
                        "pooled_speedup_by_round gives each round's ratio (how far one run's ratio moves)")
    p.add_argument("--constrained", action="store_true",
                   help="structured output instead: each row's json_schema or regex (default segments json and "
                        "regex), constrained plain vs jump-forward and constrained speculation with each drafter "
                        "(default: ngram, suffix, portfolio; self and draft on request), unconstrained beside "
                        "them (cluster/bench/spec_constrained.py)")


def choose_self_layers(target, rows: list[tuple[str, list[int]]], k: int, max_tokens: int = 32,
                       candidates=SELF_CANDIDATES) -> tuple[int, dict]:
    """Quick measurement: for each L, run a few prompts with self:L at K=k and predict the speedup
    from the measured α, c and v (less noisy than timing whole requests); pick the best L."""
    from cluster.common.config import SpecConfig

    plain = engine_for(target)
    n = target.runner.model.arch.num_layers
    t_plain = []
    for i, (seg, ids) in enumerate(rows):
        t_plain += run_ours(plain, request_for(f"cal-p{i}", ids, max_tokens, seg)).decode_steps
    t = statistics.median(t_plain)
    found = {}
    for L in [c for c in candidates if c < n]:
        eng = engine_for(target, SpecConfig(drafter=f"self:{L}", num_draft_tokens=k))
        runs = [run_ours(eng, request_for(f"cal-{L}-{i}", ids, max_tokens, seg)) for i, (seg, ids) in enumerate(rows)]
        alpha = alpha_of(runs)
        c = statistics.median([x for r in runs for x in r.round_costs] or [0.0]) / t
        v = statistics.median([x for r in runs for x in r.verify_steps] or [t]) / t
        pred = predicted_speedup(alpha, [0] * k + [1], c, v)  # a step at the fixed K
        found[L] = {"alpha": round(alpha, 4), "c": round(c, 4), "v": round(v, 4), "predicted_speedup": round(pred, 4)}
    best = max(found, key=lambda L: found[L]["predicted_speedup"])
    return best, found


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(slots=True)
class Drafters:
    """What the methods of a run are built from: the loaded target, the drafters asked for, the
    fixed Ks, L of ``self:L`` and the derived draft model (loaded once, shared by the rounds)."""

    target: object
    kinds: list[str]
    ngram_k: int
    model_k: int
    self_layers: int | None = None
    draft: object | None = None  # the derived draft model, when "draft" is asked for
    draft_layers: int | None = None
    draft_dir: Path | None = None
    stop_confidence: float = DRAFT_STOP_CONFIDENCE  # every method's draft_stop_confidence
    compare_stop: float | None = None  # also eagle@stopX/auto and portfolio@stopX/auto at this floor
    portfolio_variants: list[dict] = field(default_factory=list)  # also portfolio[...]/auto with these settings

    def build_methods(self) -> dict[str, tuple]:
        """Fresh engines, name -> (engine, k label): nothing learnt, adaptive K at its priors."""
        from cluster.common.config import SpecConfig
        from cluster.models.runner import ModelRunner
        from cluster.speculative.draft_model import DraftModelProposer
        from cluster.speculative.proposer import is_eagle_choice

        target, kinds = self.target, self.kinds
        def spec(**kw) -> SpecConfig:  # every method's config, at the run's draft confidence floor
            return SpecConfig(**{"draft_stop_confidence": self.stop_confidence, **kw})

        def label(k) -> str:
            return "auto" if k == "auto" else f"k{k}"

        methods: dict[str, tuple] = {"plain": (engine_for(target), None)}
        if "ngram" in kinds:
            methods[f"ngram/k{self.ngram_k}"] = (engine_for(target, spec(drafter="ngram", num_draft_tokens=self.ngram_k)), self.ngram_k)
            methods["ngram/auto"] = (engine_for(target, spec(drafter="ngram", num_draft_tokens="auto")), "auto")
        for name in LEARNING_ROWS:  # model-free, learning from the prompts run before
            if name in kinds:
                methods[f"{name}/auto"] = (engine_for(target, spec(drafter=name, num_draft_tokens="auto")), "auto")
        for drafter, name in suffix_corpus_rows(kinds).items():  # the suffix drafter over another corpus
            methods[f"{name}/auto"] = (engine_for(target, spec(drafter=drafter, num_draft_tokens="auto")), "auto")
        for drafter, name in portfolio_head_rows(kinds).items():  # the portfolio holding another head
            methods[f"{name}/auto"] = (engine_for(target, spec(drafter=drafter, num_draft_tokens="auto")), "auto")
        for head, name in head_rows([d for d in kinds if is_eagle_choice(d)]).items():  # shipped or trained heads
            for k in (self.model_k, "auto"):
                methods[f"{name}/{label(k)}"] = (engine_for(target, spec(drafter=head, num_draft_tokens=k)), k)
        if "self" in kinds:
            for k in (self.model_k, "auto"):
                methods[f"self:{self.self_layers}/{label(k)}"] = (
                    engine_for(target, spec(drafter=f"self:{self.self_layers}", num_draft_tokens=k)), k)
        if "draft" in kinds:
            for k in (self.model_k, "auto"):
                proposer = DraftModelProposer(ModelRunner(self.draft.runner.model, None, 16, 128))
                methods[f"draft-l{self.draft_layers}/{label(k)}"] = (
                    engine_for(target, spec(drafter="draft", num_draft_tokens=k), proposer), k)
        if self.compare_stop is not None:  # the same adaptive rows at another draft confidence floor
            heads = [d for d in kinds if is_eagle_choice(d)]
            compared = {"eagle": heads[0]} if heads else {}  # the first head's rows
            if "portfolio" in kinds:
                compared["portfolio"] = "portfolio"
            for name, drafter in compared.items():
                methods[f"{name}@stop{self.compare_stop:g}/auto"] = (engine_for(target, spec(
                    drafter=drafter, num_draft_tokens="auto", draft_stop_confidence=self.compare_stop)), "auto")
        for changes in self.portfolio_variants:  # the portfolio row with its choosing settings changed
            engine = engine_for(target, spec(drafter="portfolio", num_draft_tokens="auto",
                                             **{k: v for k, v in changes.items() if k in SPEC_KNOBS}))
            for name, value in changes.items():
                if name not in SPEC_KNOBS:
                    setattr(engine.spec.proposer, name, value)
            methods[variant_name(changes)] = (engine, "auto")
        return methods


@dataclass(slots=True)
class HfPeers:
    """Hugging Face's methods beside ours (none with ``--no-hf``): name -> ``generate`` keyword
    arguments (``_cfg``: the model whose generation config sets K; ``_k``: a fixed K, None: HF's
    own schedule)."""

    model: object | None = None
    eos: list[int] = field(default_factory=list)
    methods: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def load(cls, args: argparse.Namespace, setup: Drafters, eos: list[int]) -> "HfPeers":
        peers = cls(eos=eos)
        if args.no_hf:
            return peers
        import torch
        from transformers import AutoModelForCausalLM

        def load(path) -> object:
            return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

        peers.model = model = load(setup.target.path)
        peers.methods["hf_plain"] = {}
        if "ngram" in setup.kinds:
            peers.methods[f"hf_lookup/k{args.ngram_k}"] = {"prompt_lookup_num_tokens": args.ngram_k}
        if "self" in setup.kinds:
            peers.methods[f"hf_early_exit/k{args.model_k}"] = {"assistant_early_exit": setup.self_layers, "_cfg": model,
                                                               "_k": args.model_k}
            if args.hf_auto:
                peers.methods["hf_early_exit/auto"] = {"assistant_early_exit": setup.self_layers, "_cfg": model, "_k": None}
        if "draft" in setup.kinds:
            draft = load(setup.draft_dir)
            peers.methods[f"hf_assisted/k{args.model_k}"] = {"assistant_model": draft, "_cfg": draft, "_k": args.model_k}
            if args.hf_auto:
                draft_auto = load(setup.draft_dir)
                peers.methods["hf_assisted/auto"] = {"assistant_model": draft_auto, "_cfg": draft_auto, "_k": None}
        return peers

    def call(self, name: str, ids: list[int], max_tokens: int) -> Run:
        kw = dict(self.methods[name])
        cfg_model, k = kw.pop("_cfg", None), kw.pop("_k", None)
        if cfg_model is not None:
            g = cfg_model.generation_config
            if k is not None:  # fixed K: exactly K drafts per round, like ours
                g.num_assistant_tokens, g.num_assistant_tokens_schedule, g.assistant_confidence_threshold = k, "constant", 0.0
            elif name.startswith("hf_early_exit"):  # HF's defaults (the target's config is shared)
                g.num_assistant_tokens, g.num_assistant_tokens_schedule, g.assistant_confidence_threshold = 20, "constant", 0.4
        return run_hf(self.model, ids, max_tokens, self.eos, **kw)

    def peer_of(self, method: str, ngram_k: int) -> str | None:
        """The HF method one of ours is compared with (HF has no adaptive prompt lookup), if run."""
        if method.startswith("ngram/"):
            peer = f"hf_lookup/k{ngram_k}"
        elif method.startswith("self:"):
            peer = f"hf_early_exit/{method.split('/')[1]}"
        elif method.startswith("draft-"):
            peer = f"hf_assisted/{method.split('/')[1]}"
        else:
            return None
        return peer if peer in self.methods else None


@dataclass(slots=True)
class Rounds:
    """Every round's runs: segment -> method -> runs (in prompt order, round after round), the
    round of each entry, a portfolio's member counts per segment (summed over the rounds), and
    the last round's methods (their names and k labels make the rows)."""

    results: dict[str, dict[str, list[Run]]] = field(default_factory=dict)
    round_of: dict[str, list[int]] = field(default_factory=dict)
    members: dict[str, dict[str, dict]] = field(default_factory=dict)  # segment -> method -> member -> counts
    methods: dict[str, tuple] = field(default_factory=dict)

    def add_members(self, seg: str, name: str, gained: dict[str, dict]) -> None:
        total = self.members.setdefault(seg, {}).setdefault(name, {})
        for m, counts in gained.items():
            total[m] = {k: total.get(m, {}).get(k, 0) + v for k, v in counts.items()}


def run_rounds(args: argparse.Namespace, segments: list[str], prompts: dict[str, list[tuple]], setup: Drafters,
               hf: HfPeers) -> Rounds:
    """``args.rounds`` rounds, each on fresh engines: every prompt of every segment, every method
    in turn (the order rotated per prompt), keeping each method's median-time run of its repeats."""
    out = Rounds()
    t_start = time.perf_counter()
    for rnd in range(args.rounds):
        methods = out.methods = setup.build_methods()
        # warm-up: one short request per method (allocations, first-call overheads)
        seg0, (_, ids0, _) = segments[0], prompts[segments[0]][0]
        for name, (eng, _) in methods.items():
            run_ours(eng, request_for(f"warm-{name}", ids0[:64], 4, seg0))
        for name in hf.methods:
            hf.call(name, ids0[:64], 4)
        for seg in segments:
            per = out.results.setdefault(seg, {m: [] for m in list(methods) + list(hf.methods)})
            before = {name: member_counts(eng) for name, (eng, _) in methods.items()}
            for j, (pid, ids, max_tokens) in enumerate(prompts[seg]):
                reps: dict[str, list[Run]] = {m: [] for m in per}
                order = method_order(list(methods), j + rnd)
                for rep in range(max(1, args.repeats)):  # interleaved: every method on this prompt, in turn
                    for name in order:
                        if rep < runs_per_prompt(name, args.repeats):
                            reps[name].append(run_ours(methods[name][0], request_for(f"{pid}-{name}-{rep}", ids, max_tokens, seg)))
                    for name in hf.methods:
                        reps[name].append(hf.call(name, ids, max_tokens))
                for name, runs in reps.items():  # machine noise: keep each method's median-time run
                    per[name].append(sorted(runs, key=lambda r: r.wall_s)[(len(runs) - 1) // 2])
                out.round_of.setdefault(seg, []).append(rnd)
                _log(f"[{time.perf_counter() - t_start:7.1f}s] {seg} {pid}" + (f" round {rnd + 1}" if args.rounds > 1 else "")
                     + ": " + " ".join(f"{n}={1e3 * per[n][-1].wall_s / max(per[n][-1].tokens, 1):.1f}" for n in per) + " ms/token")
            for name, (eng, _) in methods.items():
                if before[name] is not None:
                    out.add_members(seg, name, member_delta(before[name], member_counts(eng)))
    return out


def build_report(args: argparse.Namespace, segments: list[str], setup: Drafters, hf: HfPeers, done: Rounds,
                 calibration: dict | None, seconds: float) -> dict:
    """The JSON: a row per segment and method (and its HF peer), the plain rows, the goals."""
    import torch

    table: dict[str, dict] = {}
    for seg, per in done.results.items():
        table[seg] = {}
        for name, (_, k) in done.methods.items():
            if name == "plain":
                continue
            peer = hf.peer_of(name, args.ngram_k)
            table[seg][name] = summarize_row(per["plain"], per[name], per.get("hf_plain"), per.get(peer) if peer else None, k)
            table[seg][name]["pooled_speedup_by_round"] = pooled_by_round(per["plain"], per[name], done.round_of[seg])
            if name in done.members.get(seg, {}):  # a portfolio: what each member drafted (all repeats)
                table[seg][name]["members"] = done.members[seg][name]
    plain_rows = {seg: {"ms_per_token": rounded(median_of([1e3 * r.wall_s / max(r.tokens, 1) for r in per["plain"]]), 3),
                        "decode_step_ms": rounded(1e3 * (median_of([x for r in per["plain"] for x in r.decode_steps]) or 0), 3),
                        "hf_ms_per_token": rounded(median_of([1e3 * r.wall_s / max(r.tokens, 1) for r in per.get("hf_plain", [])]), 3)}
                  for seg, per in done.results.items()}
    ngram_key = f"ngram/k{args.ngram_k}" if "ngram" in setup.kinds else None
    hf_peers = {name: peer for name in done.methods if (peer := hf.peer_of(name, args.ngram_k))}
    return {
        "model": setup.target.name,
        "config": {"segments": segments, "drafters": list(done.methods)[1:], "prompts_per_segment": args.prompts_per_segment,
                   "repeats": args.repeats, "rounds": args.rounds,
                   "runs_per_prompt": {name: runs_per_prompt(name, args.repeats) for name in done.methods},
                   "max_tokens_cap": args.max_tokens, "ngram_k": args.ngram_k, "model_k": args.model_k,
                   "self_layers": setup.self_layers, "draft_layers": setup.draft_layers if "draft" in setup.kinds else None,
                   "draft_dir": str(setup.draft_dir) if setup.draft_dir else None, "threads": torch.get_num_threads(),
                   "hf_peers": hf_peers, "concurrency": 1, "greedy": True,
                   "draft_stop_confidence": setup.stop_confidence,
                   "compare_stop_confidence": setup.compare_stop,
                   "compare_portfolio": setup.portfolio_variants,
                   "method_order": "rotated by one per prompt (method_order)"},
        "calibration": calibration,
        "plain": plain_rows,
        "segments": table,
        "summary": goals(table, ngram_key),
        "seconds": round(seconds, 1),
    }


def head_rows(heads: list[str]) -> dict[str, str]:
    """EAGLE drafter choice -> its rows' name: ``eagle`` for the first (the goals read it), then
    ``eagle:<directory name>`` — several heads measured side by side in one run."""
    return {h: "eagle" if i == 0 else f"eagle:{Path(h.split(':', 1)[1]).name if ':' in h else h}"
            for i, h in enumerate(heads)}


def suffix_corpus_rows(kinds: list[str]) -> dict[str, str]:
    """``suffix:FILE`` drafter choices -> their rows' name, ``suffix:<file stem>``."""
    return {d: f"suffix:{Path(d.split(':', 1)[1].strip()).stem}" for d in kinds
            if d.lower().startswith("suffix:") and d not in DRAFTER_KINDS}


def portfolio_head_rows(kinds: list[str]) -> dict[str, str]:
    """``portfolio:DIR`` drafter choices -> their rows' name, ``portfolio:<directory name>``."""
    return {d: f"portfolio:{Path(d.split(':', 1)[1].strip()).name}" for d in kinds
            if d.lower().startswith("portfolio:")}


def _refusal(args: argparse.Namespace, kinds: list[str]) -> str | None:
    """Why the arguments cannot run (before the model loads), else None."""
    from cluster.speculative.proposer import is_eagle_choice

    portfolios, corpora = portfolio_head_rows(kinds), suffix_corpus_rows(kinds)
    bad = [d for d in kinds if d not in DRAFTER_KINDS and not is_eagle_choice(d) and d not in portfolios
           and d not in corpora]
    if bad:
        return (f"unknown drafters {bad}; expected some of {DRAFTER_KINDS}, eagle, eagle:DIR, portfolio:DIR "
                "or suffix:FILE")
    if any(not name.split(":", 1)[1] for name in portfolios.values()):
        return f"portfolio:DIR needs the head's directory, got {list(portfolios)}"
    if len(set(portfolios.values())) < len(portfolios):
        return f"portfolios side by side need heads in distinct directory names, got {list(portfolios)}"
    missing = [d for d in corpora if not Path(d.split(":", 1)[1].strip()).is_file()]
    if missing:
        return f"suffix:FILE needs a corpus file that exists (made by `specserve suffix-corpus`), got {missing}"
    if len(set(corpora.values())) < len(corpora):
        return f"suffix drafters side by side need corpora with distinct file names, got {list(corpora)}"
    if args.rounds < 1:
        return f"--rounds must be >= 1, got {args.rounds}"
    heads = [d for d in kinds if is_eagle_choice(d)]
    names = list(head_rows(heads).values())
    if len(set(names)) < len(heads):  # their rows would share names
        return (f"EAGLE heads side by side need distinct directory names (rows {names}), got {heads}")
    for flag, value in (("--draft-stop-confidence", args.draft_stop_confidence),
                        ("--compare-stop-confidence", args.compare_stop_confidence)):
        if value is not None and not 0.0 <= value < 1.0:
            return f"{flag} must be in [0, 1), got {value}"
    if args.compare_stop_confidence is not None and not (heads or "portfolio" in kinds):
        return "--compare-stop-confidence compares eagle/auto and portfolio/auto: ask for eagle or portfolio in --drafters"
    if args.compare_portfolio and "portfolio" not in kinds:
        return "--compare-portfolio runs portfolio/auto with other settings: ask for portfolio in --drafters"
    variants = []
    for text in args.compare_portfolio:
        try:
            variants.append(portfolio_variant(text))
        except ValueError as exc:
            return f"--compare-portfolio {exc}"
    if len({variant_name(v) for v in variants}) < len(variants):
        return f"--compare-portfolio: the same settings twice ({args.compare_portfolio})"
    return None


def run(args: argparse.Namespace) -> int:
    if args.constrained:
        from cluster.bench.spec_constrained import run_constrained

        return run_constrained(args)
    import torch

    from cluster.common.cache_dir import cache_root
    from cluster.common.config import EngineConfig
    from cluster.models.derive import derive_truncated_draft
    from cluster.models.load import load_model
    from cluster.models.tokenizer import prompt_token_ids
    from cluster.speculative.vocab_check import require_vocab_compatible

    if args.threads:
        torch.set_num_threads(args.threads)
    segments = [s.strip() for s in args.segments.split(",") if s.strip()]
    kinds = [d.strip() for d in args.drafters.split(",") if d.strip()]
    refusal = _refusal(args, kinds)
    if refusal:
        _log(refusal)
        return 2
    target = load_model(args.model, EngineConfig())
    tok = target.tokenizer
    prompts = {seg: [(r["id"], prompt_token_ids(tok, r), min(int(r.get("max_tokens", args.max_tokens)), args.max_tokens))
                     for r in read_prompt_rows(args.workloads / f"{seg}.jsonl", args.prompts_per_segment)] for seg in segments}
    setup = Drafters(target, kinds, args.ngram_k, args.model_k, self_layers=args.self_layers,
                     compare_stop=args.compare_stop_confidence,
                     portfolio_variants=[portfolio_variant(t) for t in args.compare_portfolio])
    if args.draft_stop_confidence is not None:
        setup.stop_confidence = args.draft_stop_confidence

    # L for self:L (and the draft's depth): a quick measurement on a few prompts
    calibration = None
    if ("self" in kinds or ("draft" in kinds and args.draft_layers is None)) and setup.self_layers is None:
        cal_rows = [(seg, ids) for seg in segments for _, ids, _ in prompts[seg][:1]][:2]
        t0 = time.perf_counter()
        setup.self_layers, found = choose_self_layers(target, cal_rows, args.model_k, max_tokens=min(24, args.max_tokens))
        calibration = {"candidates": found, "chosen": setup.self_layers, "seconds": round(time.perf_counter() - t0, 1)}
        _log(f"self:L quick measurement -> L={setup.self_layers} {found}")
    setup.draft_layers = args.draft_layers or setup.self_layers
    if "draft" in kinds:
        setup.draft_dir = derive_truncated_draft(target.path, setup.draft_layers,
                                                 cache_root() / "derived" / f"{Path(target.path).name}-first{setup.draft_layers}")
        setup.draft = load_model(str(setup.draft_dir), EngineConfig())
        require_vocab_compatible(tok, setup.draft.tokenizer)

    hf = HfPeers.load(args, setup, sorted(target.eos_token_ids))
    t_start = time.perf_counter()
    done = run_rounds(args, segments, prompts, setup, hf)
    report = build_report(args, segments, setup, hf, done, calibration, time.perf_counter() - t_start)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(format_table(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specserve bench spec", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
