"""`specserve suffix-corpus`: a suffix corpus from the target's own generations or your traffic.

Owns: the arguments, reading the sources in the order given — the self-distilled samples of
``train-draft`` run directories (``--from DIR``, each checked to have been made by this target: its
``eagle_config.json``; all samples, or ``--greedy-only``), files of outputs (``--from-outputs
FILE``: JSONL rows with the output ``text`` and, optionally, what was asked — ``prompt`` with
``chat``, or ``messages`` — as ``specserve generate --prompts`` writes them or as your logs hold
them; tokenized by this target, so any model's text will do) and corpora (``--from-corpus FILE`` or
``shipped``: their documents, each corpus checked against this target) — and the report
(documents, tokens, the file's size, the memory the drafter will hold). The corpus itself (dedup,
bound, file format) lives in ``cluster.speculative.suffix_corpus``; the drafter reading it is
``suffix`` with ``--suffix-corpus FILE`` (also the portfolio's suffix member) or ``suffix:FILE``.
The samples of ``train-draft`` leave out every prompt in ``../shared/workloads/``; a corpus from
outputs holds whatever those files hold.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from cluster.common.errors import InvalidRequestError, ModelLoadError


SOURCE_FLAGS = {"run": "--from", "outputs": "--from-outputs", "corpus": "--from-corpus"}
SHIPPED = "shipped"  # --from-corpus shipped: the corpus shipped for the default model


class _Source(argparse.Action):
    """Every source flag appends (kind, value) to one list, so the sources keep their command-line
    order (the order documents are taken in, up to ``--max-tokens``)."""

    def __call__(self, parser, namespace, value, option_string=None):
        kind = next(k for k, flag in SOURCE_FLAGS.items() if flag == option_string)
        namespace.sources = [*(namespace.sources or []), (kind, value)]


def add_parser(sub) -> None:
    p = sub.add_parser("suffix-corpus", help="build a suffix corpus from the target's own generations or your traffic")
    p.add_argument("--model", default="default", help="the target: default | HF model dir | hub id")
    p.add_argument("--from", dest="sources", action=_Source, metavar="DIR", default=[],
                   help="a train-draft run directory whose data/samples.jsonl to take (repeatable)")
    p.add_argument("--from-outputs", dest="sources", action=_Source, metavar="FILE", default=[],
                   help="a JSONL file of outputs: rows with 'text' and optionally 'prompt' (+ 'chat') or "
                        "'messages', e.g. what `specserve generate --prompts` writes (repeatable)")
    p.add_argument("--from-corpus", dest="sources", action=_Source, metavar="FILE|shipped", default=[],
                   help=f"the documents of a corpus this target wrote; '{SHIPPED}': the one shipped for the default "
                        "model (repeatable)")
    p.add_argument("--out", type=Path, required=True, help="the corpus file to write (.npz)")
    p.add_argument("--max-tokens", type=int, default=2_000_000,
                   help="tokens in all (prompts and outputs; the drafter holds 16 bytes a token)")
    p.add_argument("--greedy-only", action="store_true", help="only the samples decoded greedily (--from runs)")
    p.set_defaults(func=run)


def command_line(args: argparse.Namespace) -> str:
    """The command that makes this corpus again (kept in the file)."""
    words = ["specserve", "suffix-corpus", "--model", args.model]
    for kind, value in args.sources:
        words += [SOURCE_FLAGS[kind], str(value)]
    words += ["--out", str(args.out), "--max-tokens", str(args.max_tokens)]
    if args.greedy_only:
        words.append("--greedy-only")
    return " ".join(shlex.quote(w) for w in words)


def run(args: argparse.Namespace) -> int:
    from cluster.common.config import EngineConfig
    from cluster.models.load import load_model
    from cluster.models.runner import ModelRunner
    from cluster.speculative.eagle_head import target_identity
    from cluster.speculative.suffix_corpus import (
        SHIPPED_SUFFIX_CORPUS, build_corpus, corpus_documents, load_corpus, save_corpus,
    )

    if args.max_tokens < 1:
        print(f"suffix-corpus: --max-tokens must be >= 1, got {args.max_tokens}", file=sys.stderr)
        return 2
    if not args.sources:
        print("suffix-corpus: give at least one source: --from DIR, --from-outputs FILE or --from-corpus FILE",
              file=sys.stderr)
        return 2
    if args.greedy_only and not any(kind == "run" for kind, _ in args.sources):
        print("suffix-corpus: --greedy-only picks among the samples of --from runs; none is given", file=sys.stderr)
        return 2
    target = load_model(args.model, EngineConfig(model=args.model, num_kv_blocks=2))
    if not isinstance(target.runner, ModelRunner):
        raise ModelLoadError(f"{args.model}: a suffix corpus is tied to a natively loaded (Llama-family) target")
    identity = target_identity(target.runner.model)
    documents = []
    for kind, value in args.sources:
        if kind == "run":
            docs, what = run_documents(Path(value), identity, args.greedy_only), "samples"
        elif kind == "outputs":
            docs, what = output_documents(Path(value), target.tokenizer), "rows"
        else:
            path = SHIPPED_SUFFIX_CORPUS if value == SHIPPED else Path(value)
            docs, what = corpus_documents(load_corpus(path, identity)), "documents"
        print(f"{value}: {len(docs)} {what}, {sum(len(d) for d in docs)} tokens")
        documents += docs
    corpus = build_corpus(documents, identity, args.max_tokens, made_by=command_line(args))
    save_corpus(corpus, args.out)
    print(f"{args.out}: {corpus.documents} distinct documents, {corpus.num_tokens} tokens, "
          f"{args.out.stat().st_size / 1e6:.1f} MB on disk, {corpus.nbytes / 1e6:.1f} MB in memory; "
          f"use it with --draft suffix --suffix-corpus {args.out} (or --draft portfolio --suffix-corpus {args.out})")
    return 0


def run_documents(src: Path, identity, greedy_only: bool) -> list[list[int]]:
    """A train-draft run directory's samples (prompt and output tokens), refused where another
    target made them."""
    from cluster.speculative.eagle_head import CONFIG_FILE, EagleConfig
    from cluster.training.eagle_trainer import SAMPLES
    from cluster.training.self_distill import read_samples

    config, samples = src / CONFIG_FILE, src / SAMPLES
    if not config.is_file() or not samples.is_file():
        raise ModelLoadError(f"{src}: not a train-draft run directory (needs {CONFIG_FILE} and {SAMPLES})")
    made_by = EagleConfig.from_json(json.loads(config.read_text())).target
    if made_by != identity:
        raise ModelLoadError(f"{src}: its samples were generated by another target ({made_by.model_type} "
                             f"{made_by.fingerprint}; this one is {identity.model_type} {identity.fingerprint})")
    return [s.token_ids for s in read_samples(samples) if s.greedy or not greedy_only]


def output_documents(path: Path, tokenizer) -> list[list[int]]:
    """Each row's prompt (``prompt``, in the chat template where ``chat`` is set, or ``messages``;
    none where the row has neither) and output ``text``, tokenized by this target; a row that is not
    JSON or has no string ``text`` stops the command naming its file and line."""
    from cluster.models.tokenizer import row_token_ids

    if not path.is_file():
        raise InvalidRequestError(f"--from-outputs {path}: no such file")
    documents = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"{where}: not JSON: {exc}") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise InvalidRequestError(f"{where}: each row needs the output as a string 'text'")
            prompt = row.get("prompt")
            try:
                if "messages" not in row and prompt is not None and not isinstance(prompt, str):
                    raise InvalidRequestError("'prompt' must be a string")
                asked = row_token_ids(tokenizer, row) if "messages" in row or prompt is not None else []
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"{where}: {exc}") from None
            documents.append(asked + [int(t) for t in tokenizer(row["text"], add_special_tokens=False)["input_ids"]])
    return documents
