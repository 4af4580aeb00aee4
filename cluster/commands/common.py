"""Arguments shared by commands that build an engine (model, dtype, drafter, K, threads)."""
from __future__ import annotations

import argparse

from cluster.common.config import EngineConfig, SpecConfig
from cluster.common.errors import InvalidRequestError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="default | HF model dir | .gguf file | hub id")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--draft", default=None,
                   help="enable speculation: ngram | suffix (with --suffix-corpus, by default the corpus shipped for the "
                        "default model) | suffix:FILE | suffix:cold | portfolio | portfolio:DIR | self[:L] | eagle (the head "
                        "shipped for the default model) | eagle:DIR | a draft model source (same vocabulary)")
    p.add_argument("--num-draft-tokens", default="auto", help="K, or 'auto' for adaptive K")
    p.add_argument("--suffix-corpus", default=None, metavar="FILE|cold",
                   help="the corpus of --draft suffix and of the portfolio's suffix member: a file made by "
                        "`specserve suffix-corpus`, or 'cold' for none (default: the one shipped for the default model)")
    p.add_argument("--draft-vocab-trim", type=int, default=None, help="keep N ids in the draft LM head")
    p.add_argument("--force-vocab-mismatch", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--kv-cache-mb", type=int, default=512)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine the arguments describe; a value the configs refuse is one clear error line
    (``InvalidRequestError``), not a traceback."""
    try:
        spec = None
        if args.draft and args.draft.lower() != "none":
            spec = SpecConfig(drafter=args.draft, num_draft_tokens=args.num_draft_tokens,
                              draft_vocab_trim=args.draft_vocab_trim,
                              force_vocab_mismatch=args.force_vocab_mismatch, suffix_corpus=args.suffix_corpus)
        elif args.suffix_corpus is not None:
            raise ValueError("--suffix-corpus is the corpus of a suffix drafter: give --draft suffix or "
                             "--draft portfolio")
        return EngineConfig(model=args.model, dtype=args.dtype, spec=spec, torch_threads=args.threads,
                            max_num_seqs=args.max_num_seqs, kv_cache_memory_mb=args.kv_cache_mb)
    except InvalidRequestError:
        raise
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
