"""`specserve train-draft`: train an EAGLE draft head for a target on its own generations.

Owns: the arguments (-> ``TrainConfig``), loading the target, the prompts (the built-in corpus,
held out from ``../shared/workloads``; with ``--self-prompts``, requests the target wrote; with
``--prompts``, the operator's own; taken in turn, and the mix printed), the device (``--device``:
a GPU where torch sees one), the ``--minutes`` deadline, and the final report (α by draft position
on held-out prompts, where the head is, how to use it). The training itself lives in
``cluster.training.eagle_trainer``; run the same command again to resume a stopped run.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from collections import Counter
from pathlib import Path

from cluster.common.errors import InvalidRequestError, ModelLoadError


def add_parser(sub) -> None:
    from cluster.training.eagle_trainer import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train-draft", help="train an EAGLE draft head on the target's own features")
    p.add_argument("--model", default="default", help="the target: default | HF model dir | hub id")
    p.add_argument("--out", type=Path, required=True, help="run directory (head, checkpoint, data, log)")
    p.add_argument("--minutes", type=float, default=None, help="stop after this many minutes (resumable)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="self-distillation data size (prompt + output tokens)")
    p.add_argument("--epochs", type=int, default=d.epochs,
                   help="passes over the data; 0 with --init-from: no training (trim and evaluate that head)")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab_size,
                   help="draft vocabulary size; below --init-from's, that head keeps its most frequent tokens "
                        "in this run's outputs")
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps, help="training-time-test unrolled steps")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (after warm-up)")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio,
                   help="cosine decay to lr x this at the end of the last epoch")
    p.add_argument("--row-tokens", type=int, default=d.row_tokens, help="packed tokens per optimizer step")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="generated tokens per prompt")
    p.add_argument("--temperature", type=float, default=d.temperature,
                   help="odd prompts are sampled at this temperature, even ones greedy; 0: every sample greedy")
    p.add_argument("--max-prompts", type=int, default=None, help="use at most this many corpus prompts")
    p.add_argument("--self-prompts", type=int, default=d.self_prompts,
                   help="add this many requests the target writes itself (sampled from its chat template's bare "
                        "user turn, filtered; source 'self'), taken in turn with the other sources' prompts")
    p.add_argument("--self-prompt-openers", default="",
                   help="'|'-separated first words of the self-written requests, taken in turn (e.g. 'Write a poem "
                        "about|Describe|Give me advice'): the target goes on from them, so they steer the kind of "
                        "request; default: none (the bare user turn)")
    p.add_argument("--self-prompt-temperature", type=float, default=d.self_prompt_temperature,
                   help="the temperature self-written requests are sampled at (lower: tidier, less varied)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="your own prompts: a JSONL file, or a directory of them, in the rows of `specserve generate "
                        "--prompts` / `map --traffic` (prompt [+ chat] or messages; source 'prompts:<segment>'), "
                        "taken in turn with the other sources' prompts; rows with json_schema, regex or grammar, or overlapping "
                        "a benchmark workload prompt, are left out and counted")
    p.add_argument("--no-corpus", action="store_true",
                   help="leave out the built-in prompt corpus (train on --prompts and / or --self-prompts only)")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                   help="prompts longer than this are left out (counted per source)")
    p.add_argument("--workloads", type=Path, default=None,
                   help="benchmark workloads whose prompts are excluded (default ../shared/workloads)")
    p.add_argument("--init-from", type=Path, default=None,
                   help="fine-tune this trained head (same target; its draft vocabulary, or the most frequent part of "
                        "it: --draft-vocab) instead of starting afresh")
    p.add_argument("--device", default="auto",
                   help="where the target and the head run: auto (the first CUDA device where torch sees one, else "
                        "the CPU), cpu, cuda or cuda:N; a stopped run may resume on another device")
    p.add_argument("--gen-batch-size", type=int, default=d.gen_batch_size,
                   help="sequences the target generates together (larger on a GPU); a run may resume with another "
                        "(samples already made are kept)")
    p.add_argument("--format", default="specserve", choices=["specserve", "speculators"],
                   help="speculators: also write the finished head in the speculators format (vLLM) to OUT/speculators "
                        "(`specserve export-head` does the same for a head trained before)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--seed", type=int, default=d.seed)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from cluster.common.config import EngineConfig
    from cluster.common.prompt_rows import DEFAULT_WORKLOADS
    from cluster.models.device import resolve_device
    from cluster.models.load import load_model
    from cluster.models.runner import ModelRunner
    from cluster.models.tokenizer import chat_token_ids
    from cluster.training.eagle_trainer import Trainer, TrainConfig, expected_tokens_per_round
    from cluster.training.prompt_corpus import build_labelled_prompts, weave
    from cluster.training.self_prompts import REQUESTS, write_requests

    t0 = time.monotonic()
    if args.minutes is not None and args.minutes <= 0:
        raise InvalidRequestError(f"--minutes must be > 0, got {args.minutes}")
    deadline = t0 + args.minutes * 60 if args.minutes is not None else math.inf
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        cfg = TrainConfig(tokens=args.tokens, epochs=args.epochs, draft_vocab_size=args.draft_vocab,
                          ttt_steps=args.ttt_steps, lr=args.lr, min_lr_ratio=args.min_lr_ratio, row_tokens=args.row_tokens,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          max_prompts=args.max_prompts, self_prompts=args.self_prompts, seed=args.seed,
                          self_prompt_openers=tuple(o.strip() for o in args.self_prompt_openers.split("|"))
                          if args.self_prompt_openers.strip() else (),
                          self_prompt_temperature=args.self_prompt_temperature,
                          prompts=str(args.prompts.resolve()) if args.prompts else None, corpus=not args.no_corpus,
                          max_prompt_tokens=args.max_prompt_tokens, gen_batch_size=args.gen_batch_size,
                          init_from=str(args.init_from) if args.init_from else None)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    device = resolve_device(args.device)
    target = load_model(args.model, EngineConfig(model=args.model, num_kv_blocks=2), device=str(device))
    if not isinstance(target.runner, ModelRunner):
        raise ModelLoadError(f"train-draft needs a Llama-family target; {args.model!r} runs on the HF fallback")
    workloads = args.workloads or DEFAULT_WORKLOADS
    tok = target.tokenizer
    own: list[tuple[str, list[int]]] = []
    if cfg.prompts:  # read first: a file with no usable prompt stops the run before any generation
        from cluster.training.prompt_file import read_prompt_file

        found = read_prompt_file(Path(cfg.prompts), tok, workloads)
        own = found.prompts
        print(f"--prompts {args.prompts}: {found.summary()}; their max_tokens and sampling settings are not used "
              f"(--max-new-tokens {cfg.max_new_tokens} and --temperature {cfg.temperature} set how the target "
              "answers)", file=sys.stderr)
    labelled = build_labelled_prompts(workloads, limit=cfg.max_prompts, seed=cfg.seed) if cfg.corpus else []
    written: list[tuple[str, str]] = []
    if cfg.self_prompts:
        print(f"self-written requests: {cfg.self_prompts} at temperature {cfg.self_prompt_temperature}, "
              + (f"starting with {len(cfg.self_prompt_openers)} openers in turn ({' | '.join(cfg.self_prompt_openers)})"
                 if cfg.self_prompt_openers else "from the bare user turn"), file=sys.stderr)
        requests = write_requests(args.out / REQUESTS, target.runner.model, tok, target.eos_token_ids,
                                  count=cfg.self_prompts, seed=cfg.seed, workloads=workloads, deadline=deadline,
                                  openers=cfg.self_prompt_openers, temperature=cfg.self_prompt_temperature,
                                  batch_size=max(32, cfg.gen_batch_size),
                                  progress=lambda line: print(line, file=sys.stderr, flush=True))
        if len(requests) < cfg.self_prompts and time.monotonic() >= deadline:
            print("self-written requests: stopped by --minutes; run the same command again to continue",
                  file=sys.stderr)
            return 0
        if len(requests) < cfg.self_prompts:
            print(f"self-written requests: only {len(requests)} of {cfg.self_prompts} passed the filters "
                  f"(every attempt is in {args.out / REQUESTS}); going on with those", file=sys.stderr)
        written = [("self", text) for text in requests]
    use_chat = getattr(tok, "chat_template", None) is not None
    encode = lambda text: (chat_token_ids(tok, [{"role": "user", "content": text}]) if use_chat  # noqa: E731
                           else tok(text, add_special_tokens=False)["input_ids"])
    # in turn: your prompts, the target's own requests, the corpus (a source that runs out drops out)
    encoded = weave(own, [(source, encode(text)) for source, text in written],
                    [(source, encode(text)) for source, text in labelled])
    # longer prompts are skipped, not cut (the template's end matters); indices count the kept ones
    kept = [(source, [int(t) for t in ids]) for source, ids in encoded if len(ids) <= cfg.max_prompt_tokens]
    too_long = Counter(source for source, ids in encoded if len(ids) > cfg.max_prompt_tokens)
    if too_long:
        print(f"left out, longer than --max-prompt-tokens {cfg.max_prompt_tokens}: "
              + ", ".join(f"{n} {source}" for source, n in sorted(too_long.items())), file=sys.stderr)
    if not kept:
        raise InvalidRequestError(f"no prompt of at most {cfg.max_prompt_tokens} tokens to train on")
    prompts = [(i, ids) for i, (_, ids) in enumerate(kept)]
    sources = {i: source for i, (source, _) in enumerate(kept)}
    mix = Counter(sources.values())
    print(f"train-draft: target {target.name} on {device}, {len(prompts)} prompts to draw from in turn until --tokens ("
          + ", ".join(f"{n} {source}" for source, n in sorted(mix.items()))
          + f"; {'chat template' if use_chat else 'raw'} for the corpus' and self-written ones; workload prompts "
          f"under {workloads} excluded), out {args.out}", file=sys.stderr)
    trainer = Trainer(args.out, target.runner.model, target.eos_token_ids, cfg,
                      progress=lambda line: print(line, file=sys.stderr, flush=True))
    result = trainer.run(prompts, deadline, sources)
    if result is None:
        return 0
    fmt = lambda xs: ", ".join(f"{a:.3f}" for a in xs)  # noqa: E731
    k = len(result.alpha_by_position)
    print(f"train-draft: {'finished' if result.finished else 'stopped by --minutes (resumable)'} after "
          f"{result.steps} steps, {result.train_tokens} training tokens, {(time.monotonic() - t0) / 60:.1f} min")
    print(f"held-out α by draft position (greedy, {result.heldout_anchors} anchors): [{fmt(result.alpha_by_position)}]; "
          f"expected tokens per round at K={k}: {expected_tokens_per_round(result.alpha_by_position):.2f}")
    print(f"  at the steps of a greedy engine drafting {k} tokens ({result.heldout.step_den[0]} steps; what "
          f"bench spec's α measures): [{fmt(result.heldout.step_alphas)}]")
    for source, counts in result.by_source.items():
        print(f"  {source}: [{fmt(counts.alphas)}] ({counts.den[0]} anchors); at the engine's steps "
              f"[{fmt(counts.step_alphas)}] ({counts.step_den[0]} steps)")
    print(f"head: {args.out} (use it with --draft eagle:{args.out})")
    if args.format == "speculators":
        write_speculators(args, target)
    return 0


def write_speculators(args: argparse.Namespace, target) -> None:
    """The run's head, also in the speculators format, in OUT/speculators (verifier: the
    target's local Hugging Face directory)."""
    from cluster.models.loader import resolve_model
    from cluster.speculative.eagle_head import load_head
    from cluster.speculative.head_formats.speculators import write_speculators_head

    model = target.runner.model
    out = args.out / "speculators"
    write_speculators_head(load_head(args.out, model), model, out, verifier_name_or_path=str(resolve_model(args.model).path))
    print(f"speculators format: {out} (vLLM: vllm serve {out})")
