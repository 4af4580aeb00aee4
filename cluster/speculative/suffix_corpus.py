"""A suffix corpus: the target's own earlier outputs, read-only, that the suffix drafter matches
against beside what it learns from traffic (a warm start: SuffixDecoding's observation that a
model's outputs repeat themselves across requests holds for a small greedy model's stories,
answers and code from the first request on).

Owns: ``SuffixCorpus`` (documents joined by SEPARATOR, the target they were written by, and an
index of where each pair of consecutive tokens occurs), ``build_corpus`` (documents -> corpus,
duplicates dropped, bounded; ``corpus_documents`` the other way), the file (``save_corpus`` /
``load_corpus``: compressed ``.npz``
holding the documents' tokens and lengths, the target's identity and how the corpus was made),
and ``SuffixCorpusMismatch`` (a corpus written by another target is refused, as a head is: an
index never crosses models), ``SHIPPED_SUFFIX_CORPUS`` (the default model's).

The index: a stable argsort of the pair keys ``prev * stride + token`` over every position whose
token and predecessor are real (not SEPARATOR), so the positions after a sequence's last two
tokens are one binary search away — a corpus match is at least two tokens long (one-token matches
over a million tokens are right ~1 time in 5: noise beside a sequence's own history).
Memory: the tokens (int32, 4 bytes a token) and the index (positions int32 and keys int64: 12
bytes a token): 16 bytes a token, 20.8 MB for the shipped 1.30M tokens.

Ignores: matching and walking (``cluster.speculative.suffix``), where the documents came from
(``specserve suffix-corpus`` reads ``train-draft`` run directories, files of outputs and other
corpora: ``cluster.commands.suffix_corpus``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cluster.common.errors import ModelLoadError
from cluster.speculative.eagle_head import TargetIdentity

SEPARATOR = -1  # between documents: never matched, ends a continuation (as in the suffix index)
SHIPPED_SUFFIX_CORPUS = Path(__file__).resolve().parent / "corpora" / "smollm2-135m-instruct.npz"
FORMAT = "specserve-suffix-corpus/1"


class SuffixCorpusMismatch(ModelLoadError):
    """The corpus was written by another target (its tokens would mean other things)."""


@dataclass(slots=True)
class SuffixCorpus:
    tokens: np.ndarray  # [T] int32: the documents joined by SEPARATOR (one after each)
    target: TargetIdentity
    documents: int
    made_by: str = ""  # how it was made (the command), kept in the file
    _order: np.ndarray = field(init=False, repr=False)  # [P] int32 positions sorted by their pair key
    _keys: np.ndarray = field(init=False, repr=False)  # [P] int64 the sorted pair keys
    _stride: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        toks = self.tokens
        if toks.ndim != 1 or toks.dtype != np.int32:
            raise ValueError("a suffix corpus' tokens are one int32 array")
        self._stride = int(toks.max(initial=0)) + 1
        at = np.arange(1, toks.shape[0], dtype=np.int64)  # positions with a predecessor
        real = (toks[1:] != SEPARATOR) & (toks[:-1] != SEPARATOR)
        at = at[real]
        keys = toks[at - 1].astype(np.int64) * self._stride + toks[at]
        order = np.argsort(keys, kind="stable")  # positions stay ascending within a key
        self._order = at[order].astype(np.int32)
        self._keys = keys[order]

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0]) - self.documents  # less the separators

    @property
    def nbytes(self) -> int:
        return int(self.tokens.nbytes + self._order.nbytes + self._keys.nbytes)

    def pair_positions(self, prev: int, token: int) -> np.ndarray:
        """Ascending positions p with tokens[p - 1] == prev and tokens[p] == token [n] int32."""
        if not (0 <= prev < self._stride and 0 <= token < self._stride):
            return self._order[:0]
        key = np.int64(prev * self._stride + token)
        lo, hi = self._keys.searchsorted(key, "left"), self._keys.searchsorted(key, "right")
        return self._order[lo:hi]


def build_corpus(documents, target: TargetIdentity, max_tokens: int, made_by: str = "") -> SuffixCorpus:
    """documents: token lists (a prompt and the target's output, say), in order -> the corpus of
    the distinct ones (the first of equal documents kept) up to ``max_tokens`` tokens in all."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    seen: set[bytes] = set()
    parts: list[np.ndarray] = []
    total = 0
    for doc in documents:
        arr = np.asarray(doc, dtype=np.int64)
        if arr.size < 2 or (arr < 0).any():
            continue
        key = arr.tobytes()
        if key in seen:
            continue
        if total + arr.size > max_tokens:
            break
        seen.add(key)
        parts.append(arr.astype(np.int32))
        total += arr.size
    sep = np.array([SEPARATOR], dtype=np.int32)
    flat = np.concatenate([x for p in parts for x in (p, sep)]) if parts else np.empty(0, dtype=np.int32)
    return SuffixCorpus(flat, target, len(parts), made_by)


def corpus_documents(corpus: SuffixCorpus) -> list[list[int]]:
    """The corpus' documents, in order (to build a larger corpus from it)."""
    ends = np.flatnonzero(corpus.tokens == SEPARATOR)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    return [corpus.tokens[a:b].tolist() for a, b in zip(starts, ends)]


def save_corpus(corpus: SuffixCorpus, path: Path) -> None:
    """Compressed ``.npz``: tokens (uint16 where the vocabulary fits, else uint32) without the
    separators, each document's length, and the metadata as JSON."""
    flat = corpus.tokens
    real = flat[flat != SEPARATOR]
    lengths = np.diff(np.concatenate([[-1], np.flatnonzero(flat == SEPARATOR)])) - 1
    dtype = np.uint16 if real.size == 0 or int(real.max()) < 1 << 16 else np.uint32
    meta = {"format": FORMAT, "model_type": corpus.target.model_type, "fingerprint": corpus.target.fingerprint,
            "documents": corpus.documents, "tokens": int(real.size), "made_by": corpus.made_by}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:  # np.savez_compressed would add ".npz" to a name without it
        np.savez_compressed(f, tokens=real.astype(dtype), lengths=lengths.astype(np.uint32),
                            meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))


def load_corpus(path: Path | str, target: TargetIdentity | None) -> SuffixCorpus:
    """The corpus in ``path``; refused (``SuffixCorpusMismatch``) when ``target`` is not the one that
    wrote it, or when the target has no identity to check (None: not a natively loaded model)."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"suffix corpus {path}: no such file (make one with `specserve suffix-corpus`)")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            real, lengths = z["tokens"].astype(np.int32), z["lengths"].astype(np.int64)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"suffix corpus {path}: not a suffix corpus file ({type(exc).__name__}: {exc})") from None
    if meta.get("format") != FORMAT or int(lengths.sum()) != real.size:
        raise ModelLoadError(f"suffix corpus {path}: format {meta.get('format')!r} with {lengths.sum()} tokens "
                             f"by its lengths and {real.size} stored; expected {FORMAT!r}, the two equal")
    wrote = TargetIdentity(meta["model_type"], meta["fingerprint"])
    check_target(path, wrote, target)
    ends = np.cumsum(lengths)
    flat = np.empty(real.size + lengths.size, dtype=np.int32)
    seps = ends + np.arange(lengths.size)  # each separator's position in the joined buffer
    mask = np.ones(flat.size, dtype=bool)
    mask[seps] = False
    flat[mask] = real
    flat[seps] = SEPARATOR
    return SuffixCorpus(flat, wrote, int(lengths.size), meta.get("made_by", ""))


def check_target(path: Path, wrote: TargetIdentity, target: TargetIdentity | None) -> None:
    """Refuses (``SuffixCorpusMismatch``) the corpus in ``path``, written by ``wrote``, for
    ``target`` when they differ or ``target`` has no identity (None: not a natively loaded model)."""
    if target is None:
        raise SuffixCorpusMismatch(f"suffix corpus {path} was written by a {wrote.model_type} target "
                                   f"({wrote.fingerprint}); this target cannot be identified (not loaded natively)")
    if wrote != target:
        raise SuffixCorpusMismatch(f"suffix corpus {path} was written by another target ({wrote.model_type} "
                                   f"{wrote.fingerprint}, this one is {target.model_type} {target.fingerprint}): "
                                   "its token ids would not mean the same; make one for this target with "
                                   "`specserve suffix-corpus`")


def corpus_target(path: Path | str) -> TargetIdentity | None:
    """The identity of the target that wrote the corpus in ``path`` (its metadata only), or None
    where there is no such file or it is not a corpus."""
    try:
        with np.load(Path(path), allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
        return TargetIdentity(meta["model_type"], meta["fingerprint"])
    except (OSError, ValueError, KeyError):
        return None


_LOADED: dict[tuple[str, float], SuffixCorpus] = {}


def cached_corpus(path: Path | str, target: TargetIdentity | None) -> SuffixCorpus:
    """``load_corpus``, once per process and file version: corpora are read-only, so every engine
    and drafter of a process shares one (its index built once)."""
    path = Path(path)
    try:
        key = (str(path.resolve()), path.stat().st_mtime)
    except OSError:
        return load_corpus(path, target)  # refuses: no such file
    corpus = _LOADED.get(key)
    if corpus is None:
        corpus = _LOADED[key] = load_corpus(path, target)
    else:
        check_target(path, corpus.target, target)
    return corpus
