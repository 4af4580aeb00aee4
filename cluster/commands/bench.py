"""`specserve bench {decode,spec,confidence,serve,cancel,mapped,prediction,logprobs,shaping,scoring,prefix_cache}`:
benchmarks that print numbers and write JSON.

Each benchmark lives in ``cluster.bench.<name>`` (the map's held-out check, which runs the mapper,
in ``cluster.mapper.heldout``) and exposes ``add_arguments(parser)`` and ``run(args) -> int``;
this module only wires them up."""
from __future__ import annotations

import importlib

BENCHES = {
    "decode": "batch-1 latency vs Hugging Face and the bandwidth floor, verify cost, throughput",
    "spec": "acceptance and speedup per workload segment and drafter, vs Hugging Face "
            "(--constrained: structured output, plain vs speculative)",
    "confidence": "an EAGLE head's confidence vs acceptance on the workloads, and what a draft confidence "
                  "floor commits per unit of cost",
    "serve": "the gRPC (and --api openai: OpenAI HTTP) front door: fixed-spec, fixed-plain and routed "
             "policies per concurrency",
    "cancel": "how many gRPC stream cancellations reach the engine, by the time between a chunk and the "
              "cancellation (fake engine)",
    "mapped": "the config `specserve map` writes vs the shipped one, on held-out traffic",
    "prediction": "what a request's predicted output buys: the drafter alone vs exact, drifting and "
                  "(edit) original-code predictions, side by side, lossless checked",
    "logprobs": "what asking for log-probabilities (0 or 20 alternatives) costs on the plain and the "
                "speculative path, side by side, with the tokens checked unchanged",
    "shaping": "what penalties, logit_bias, min_tokens and repetition_penalty cost on each path and whether "
               "speculation still pays under them, side by side, spec tokens checked equal to plain",
    "scoring": "what scoring a text (prompt_logprobs / echo with max_tokens 0) costs next to prefilling it "
               "and to generating it, the scored values checked against generation's",
    "prefix_cache": "what the prefix cache buys a conversation's second turn (or, --burst N, N requests at once "
                    "under one system prompt; --placement separate: the drafter in a DraftServer): time to first "
                    "token and to the end with and without it, side by side, the tokens checked the same",
}
MODULES = {"mapped": "cluster.mapper.heldout"}  # default: cluster.bench.<name>


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark")
    bsub = p.add_subparsers(dest="bench", required=True)
    for name, help_text in BENCHES.items():
        path = MODULES.get(name, f"cluster.bench.{name}")
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as exc:  # a benchmark not present in this build
            if exc.name != path:
                raise
            continue
        bp = bsub.add_parser(name, help=help_text)
        module.add_arguments(bp)
        bp.set_defaults(func=module.run)
