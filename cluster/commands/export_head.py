"""`specserve export-head`: write a draft head in the `speculators` format (what vLLM serves and the
speculators package loads), from a head in any format we read (ours, speculators, EAGLE-3 /
SpecForge).

Owns: the arguments, loading the target the head is checked against (``--model``) and the head
(``--head eagle`` is the one shipped for the default model), the verifier the written config names
(``--verifier``, default the target's local Hugging Face directory: the exact weights the head
was checked against), and the closing lines (where the head is, how vLLM serves it).
The format itself: ``cluster.speculative.head_formats.speculators``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster.common.errors import InvalidRequestError, ModelLoadError

DTYPES = ("bfloat16", "float16", "float32")


def add_parser(sub) -> None:
    p = sub.add_parser("export-head", help="write an EAGLE head in the speculators format (vLLM)")
    p.add_argument("--model", default="default", help="the head's target: default | HF model dir | hub id")
    p.add_argument("--head", required=True,
                   help="eagle (the head shipped for the default model) | eagle:DIR | DIR, in any format we read")
    p.add_argument("--out", type=Path, required=True, help="directory to write (config.json + model.safetensors)")
    p.add_argument("--verifier", default=None,
                   help="the verifier the config names (speculators_config.verifier.name_or_path; vLLM serves it): "
                        "a hub id or a path; default: the target's local Hugging Face directory")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="dtype of the written float tensors")
    p.add_argument("--speculative-tokens", type=int, default=3,
                   help="K in the config's greedy proposal method (vLLM's default num_speculative_tokens)")
    p.set_defaults(func=run)


def head_dir_of(head: str) -> Path:
    from cluster.speculative.proposer import SHIPPED_EAGLE_HEAD

    if head == "eagle":
        return Path(SHIPPED_EAGLE_HEAD)
    return Path(head[len("eagle:"):] if head.startswith("eagle:") else head)


def run(args: argparse.Namespace) -> int:
    import torch

    from cluster.common.config import EngineConfig
    from cluster.models.load import load_model
    from cluster.models.loader import resolve_model
    from cluster.models.runner import ModelRunner
    from cluster.speculative.head_formats import load_any_head
    from cluster.speculative.head_formats.speculators import write_speculators_head

    if args.speculative_tokens < 1:
        raise InvalidRequestError(f"--speculative-tokens must be >= 1, got {args.speculative_tokens}")
    if args.out.exists() and any(args.out.iterdir()):
        raise InvalidRequestError(f"--out {args.out} exists and is not empty")
    source = head_dir_of(args.head)
    target = load_model(args.model, EngineConfig(model=args.model, num_kv_blocks=2))
    if not isinstance(target.runner, ModelRunner):
        raise ModelLoadError(f"export-head needs a Llama-family target; {args.model!r} runs on the HF fallback")
    model = target.runner.model
    head = load_any_head(source, model)  # refused here when it was made for another target
    verifier = args.verifier or str(resolve_model(args.model).path)
    write_speculators_head(head, model, args.out, verifier_name_or_path=verifier,
                           dtype=getattr(torch, args.dtype), speculative_tokens=args.speculative_tokens)
    print(f"export-head: {source} -> {args.out} (speculators eagle3, {args.dtype}, feature layers "
          f"{list(head.cfg.feature_layers)}, draft vocabulary {head.cfg.draft_vocab_size}, verifier {verifier})",
          file=sys.stderr)
    print(f"serve it with vLLM (which reads the verifier and K from its config): vllm serve {args.out}")
    return 0
