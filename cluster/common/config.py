"""Internal engine configuration (dataclasses validated on construction).

Owns: every knob of one engine instance (model, dtype, KV pool, batching budgets, speculation).
Ignores: how the service or CLI parse them (pydantic / argparse live at the user boundary).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class DType(enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"

    @property
    def torch(self):
        import torch

        return {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16}[self]


AUTO_K = "auto"
MAX_DRAFT_TOKENS = 16  # the largest K any setting (and the KVSync protocol) may ask for


def _k_policy(value: int | str, where: str) -> int | str:
    """A K policy: a fixed K in [0, MAX_DRAFT_TOKENS] (an integer string is read as one) or "auto"."""
    if isinstance(value, str) and value != AUTO_K:
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"{where} must be an integer or 'auto', got {value!r}") from None
    if value != AUTO_K and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_DRAFT_TOKENS):
        raise ValueError(f"{where} must be in [0, {MAX_DRAFT_TOKENS}] or 'auto', got {value!r}")
    return value


DRAFT_STOP_CONFIDENCE = 0.2  # SpecConfig.draft_stop_confidence's default
COLD_SUFFIX = "cold"  # a suffix drafter without a corpus (``suffix:cold``, ``suffix_corpus: cold``; a file named so: ./cold)


def suffix_corpus_name(text: str) -> str:
    """A suffix corpus as a setting names it (``suffix:X``, ``suffix_corpus``, bench variants):
    COLD_SUFFIX in any case, else the file, without surrounding spaces."""
    text = text.strip()
    return COLD_SUFFIX if text.lower() == COLD_SUFFIX else text


def holds_suffix_corpus(drafter: str) -> bool:
    """Does this drafter string draft with ``SpecConfig.suffix_corpus``: ``suffix`` (not
    ``suffix:FILE``, which names its own) and the portfolio's suffix member."""
    low = drafter.strip().lower()
    return low == "suffix" or low == "portfolio" or low.startswith("portfolio:")


@dataclass(slots=True)
class SegmentSpeculation:
    """One traffic segment's own drafter and K policy (``router.segments.<name>``, e.g. written
    by ``specserve map``); None: the global one (``SpecConfig.drafter`` / ``num_draft_tokens``)."""

    drafter: str | None = None
    num_draft_tokens: int | str | None = None


@dataclass(slots=True)
class SpecConfig:
    """Speculative decoding. drafter: "ngram", "suffix", "portfolio" / "portfolio:DIR" (its EAGLE member the
    head in DIR), "self" / "self:L" (first L target layers), "eagle" (the head shipped for the default model) /
    "eagle:DIR" (a trained head), or a model source sharing the target vocabulary. num_draft_tokens: fixed K,
    or "auto" (adaptive K in [0, max_draft_tokens]).
    segments: per traffic segment its own drafter and / or K policy (``SegmentSpeculation``); max_draft_tokens is
    at least every fixed K configured (the adaptive bound, the draft-token KV slots, KVSync's limit)."""

    drafter: str = "ngram"
    num_draft_tokens: int | str = AUTO_K
    max_draft_tokens: int = 6
    # adaptive K only: a model drafter (eagle, a draft model, self) stops a sequence's draft once
    # the product of its draft tokens' probabilities falls below this, so K is a cap (0: it drafts
    # the K planned); a fixed K always drafts K. 0.2: where the shipped head's next draft token is
    # expected to commit less than it costs (docs/measurements.md, "Draft confidence")
    draft_stop_confidence: float = DRAFT_STOP_CONFIDENCE
    ngram_min: int = 1
    ngram_max: int = 4
    draft_vocab_trim: int | None = None  # keep the N most frequent tokens in the draft LM head
    force_vocab_mismatch: bool = False
    moe_validated: bool = False  # MoE targets speculate only after an acceptance measurement
    # live MoE gate per segment (cluster.speculative.moe): probe draft tokens per measurement window, and
    # the α a window must reach to open its segment ("auto": adaptive K's break-even, else 0.5)
    moe_min_draft_tokens: int = 256
    moe_alpha_threshold: float | str = AUTO_K
    segments: dict[str, SegmentSpeculation] = field(default_factory=dict)
    # the corpus of ``suffix`` and of the portfolio's suffix member (cluster/speculative/suffix_corpus.py):
    # None: the one shipped for the default model where it fits the target, else none; "cold": none
    # (traffic only); a file made by ``specserve suffix-corpus``. ``suffix:FILE`` names its own.
    suffix_corpus: str | None = None

    def __post_init__(self) -> None:
        if not self.drafter:
            raise ValueError("spec.drafter must be set (ngram, suffix, portfolio, self[:L] or a draft model)")
        self.num_draft_tokens = _k_policy(self.num_draft_tokens, "num_draft_tokens")
        self.segments = {name: s if isinstance(s, SegmentSpeculation) else SegmentSpeculation(**s)
                         for name, s in self.segments.items()}
        for name, own in self.segments.items():
            drafter = None if own.drafter is None else own.drafter.strip()
            if drafter is not None and drafter.lower() in ("", "none"):
                raise ValueError(f"router.segments.{name}.drafter: {own.drafter!r} is not a drafter "
                                 "(num_draft_tokens: 0 stops a segment drafting)")
            k = None if own.num_draft_tokens is None else _k_policy(
                own.num_draft_tokens, f"router.segments.{name}.num_draft_tokens")
            self.segments[name] = SegmentSpeculation(drafter, k)
        fixed = [k for k in [self.num_draft_tokens, *(self.k_policy(n) for n in self.segments)] if k != AUTO_K]
        self.max_draft_tokens = max([self.max_draft_tokens, *fixed])
        if not 1 <= self.max_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"max_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.max_draft_tokens}")
        if isinstance(self.draft_stop_confidence, bool) or not 0.0 <= self.draft_stop_confidence < 1.0:
            raise ValueError(f"draft_stop_confidence must be in [0, 1), got {self.draft_stop_confidence!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.moe_min_draft_tokens < 1:
            raise ValueError(f"moe_min_draft_tokens must be >= 1, got {self.moe_min_draft_tokens}")
        if self.moe_alpha_threshold != AUTO_K and (isinstance(self.moe_alpha_threshold, (str, bool))
                                                   or not 0.0 <= self.moe_alpha_threshold <= 1.0):
            raise ValueError(f"moe_alpha_threshold must be 'auto' or in [0, 1], got {self.moe_alpha_threshold!r}")
        self._check_suffix_corpus()

    def _check_suffix_corpus(self) -> None:
        if self.suffix_corpus is None:
            return
        corpus = suffix_corpus_name(self.suffix_corpus) if isinstance(self.suffix_corpus, str) else ""
        if not corpus:
            raise ValueError(f"suffix_corpus must be a corpus file (made by `specserve suffix-corpus`) or "
                             f"'{COLD_SUFFIX}', got {self.suffix_corpus!r}")
        self.suffix_corpus = corpus
        named = [self.drafter, *(own.drafter for own in self.segments.values() if own.drafter is not None)]
        if not any(holds_suffix_corpus(d) for d in named):
            raise ValueError(f"suffix_corpus {self.suffix_corpus!r}: no drafter configured drafts with it "
                             f"(it is the corpus of 'suffix' and of the portfolio's suffix member; drafters: "
                             f"{', '.join(repr(d) for d in dict.fromkeys(named))})")

    @property
    def adaptive(self) -> bool:
        """Some sequences plan K adaptively: the global policy or a segment's is "auto"."""
        return any(self.k_policy(name) == AUTO_K for name in [None, *self.segments])

    def drafter_for(self, segment: str | None) -> str:
        """The drafter in force for ``segment`` (its own, else the global one)."""
        own = self.segments.get(segment) if segment is not None else None
        return self.drafter if own is None or own.drafter is None else own.drafter

    def k_policy(self, segment: str | None) -> int | str:
        """The K policy in force for ``segment``: a fixed K or "auto" (its own, else the global one)."""
        own = self.segments.get(segment) if segment is not None else None
        return self.num_draft_tokens if own is None or own.num_draft_tokens is None else own.num_draft_tokens

    def drafters(self) -> dict[str, list[str]]:
        """Every drafter configured -> the segments that name it (the global one first, with [])."""
        out: dict[str, list[str]] = {self.drafter: []}
        for name, own in self.segments.items():
            if own.drafter is not None and own.drafter != self.drafter.strip():
                out.setdefault(own.drafter, []).append(name)
        return out


@dataclass(slots=True)
class EngineConfig:
    model: str = "default"
    dtype: DType | str = DType.FLOAT32
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_mb
    kv_cache_memory_mb: int = 512
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    max_queue: int = 1024
    max_model_len: int | None = None  # None: the model's own context length
    torch_threads: int | None = None
    spec: SpecConfig | None = None
    seed: int = 0
    # share the K/V blocks of common prompt prefixes between requests (the paged runner only; never
    # for a request owed its prompt's log-probabilities or on an engine whose drafter reads the
    # target's features, EAGLE)
    prefix_caching: bool = True
    # CPU seconds to check a new constraint and compute its first mask (serve config:
    # limits.constraint_compile_s); over it the request is INVALID_ARGUMENT ("too complex")
    grammar_compile_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.grammar_compile_s > 0:
            raise ValueError(f"grammar_compile_s must be > 0, got {self.grammar_compile_s}")
        if isinstance(self.dtype, str):
            try:
                self.dtype = DType(self.dtype)
            except ValueError:
                raise ValueError(f"dtype must be one of {[d.value for d in DType]}, got {self.dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be >= 2")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_queue < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_queue must be >= 1")
        if isinstance(self.spec, dict):
            self.spec = SpecConfig(**self.spec)
