"""Suffix drafting: no model, continuations learnt from this segment's earlier traffic.

Owns: ``SuffixIndex`` (per segment and draft scope, the prompt + output token lists of finished
sequences, a bound on the tokens held in all — past it the largest memory sheds its oldest
documents first — and one on the memories, the least recently used dropped) and ``SuffixProposer``
(DrafterKind.SUFFIX). For each sequence it matches the longest recent suffix of its committed
tokens (up to ``max_depth`` tokens) against its own history and its segment's index, and walks
the continuation greedily: at each depth the most frequent next token among the occurrences still
on the path (ties: the most recent occurrence), with the empirical probability
count(child) / count(parent). The draft stops where the running product of those probabilities
falls below ``min_token_prob``, after ``max_spec_factor * m + max_spec_offset`` tokens for a
match of m tokens, or at K. Each match length with its own set of occurrences is scored (sum of
the draft tokens' probabilities = expected accepted tokens under the empirical model); the best
wins, ties to the longer match. A sequence's tokens are learnt when it is released (the last
token list it was seen with, in ``propose`` or ``draft_context``; a sequence released again
after a preemption replaces its earlier entry, it is not counted twice).

Drafts are deterministic, so draft_probs are None (one-hot q), as for n-gram: the rejection
sampler accepts a one-hot draft token x with probability p(x), lossless for every sampling mode.

With a corpus (``SuffixCorpus``: the target's own earlier outputs, read-only; ``suffix`` on the
default model holds the one shipped for it) the same search runs in it alone, for matches of two
tokens and more, and its draft replaces the one above only where its score times
``corpus_weight`` (0.4) is higher: pooled with the sequence's own history, a corpus' many
occurrences would outvote the sequence's single one at the same match length (on edit, where the
prompt is the thing to copy, that cost 5% of accepted tokens in a replay), and at full weight
the corpus displaced drafts its segment had learnt (json: −1% tokens per unit cost in a replay,
−8% on wall-clock; at 0.4 +1% in the replay). Its walks stop at ``corpus_min_token_prob``; its
drafts' contexts are "c<m>" and, below ``CORPUS_WEAK_PROB`` on the first token, "c<m>w".

Draft scopes (``ProposeInput.draft_scope``, the request's ``draft_scope``): the index keeps what
it learns per segment *and* scope (``memory_key``), and a sequence drafts only from its own key's
documents. A draft is only a guess — the target verifies every token, so a shared index cannot
change an answer — but it changes how fast one comes, and responses report accepted drafts: a
client could tell whether someone else in its segment was recently given a continuation. A tenant
id as the scope keeps each tenant's answers to itself; ``bench serve`` gives each policy its own,
so one policy never drafts from another's answers to the same rows. The shipped corpus is the
target's own outputs on locally built prompts, no one's traffic: every scope reads it.

Ignores: which model the tokens came from — one proposer serves one target model (an engine's,
or the one DraftServer app's), so an index never crosses models.

Cost: the index is the token lists themselves (int32, 4 bytes a token) and, for a segment past
8k tokens, where each token occurs (a stable argsort: 12 bytes a token; the default 1M-token
bound is 16 MB in all); a match looks up the last token's occurrences (binary search, plus a scan
of the documents learnt since the argsort), narrows them one token further back per match
length, then walks at most ``max_candidates`` most recent occurrences.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from cluster.common.acceptance_class import classed_context
from cluster.speculative.proposer import DrafterKind
from cluster.speculative.suffix_corpus import SEPARATOR, SuffixCorpus
from cluster.speculative.token_history import TokenHistory
from cluster.speculative.types import DraftProposal, ProposeInput


@dataclass(slots=True)
class SuffixDraft:
    """The walk's result for one sequence: draft tokens [k], their running probabilities [k],
    and the match length m they rest on (0: no match, no draft)."""

    tokens: list[int]
    probs: list[float]
    match_len: int
    from_corpus: bool = False  # walked in the suffix corpus (else the sequence's history / its segment's index)

    @property
    def score(self) -> float:
        return float(sum(self.probs))


NO_DRAFT = SuffixDraft([], [], 0)


@dataclass(slots=True)
class _Segment:
    """One segment's documents, their flat buffer, and where each token occurs in it.

    Occurrences: a stable argsort of the buffer, built once the buffer is big enough to be worth
    it and kept while documents come and go at the ends: a document learnt goes to the end (its
    tokens are scanned until ``reindex_tokens`` such tokens pile up), the oldest one leaves from
    the front (positions are kept in "ever" coordinates, counting everything that left the front:
    an evicted position falls below the front and is dropped). Replacing a document in the
    middle (a preempted sequence learnt again) rebuilds it. A scan of the whole buffer for the
    last token every step made a draft cost ~0.6 ms per sequence at 1M learnt tokens, ~0.2 with
    the index (random tokens, 2 cores, warm)."""

    docs: OrderedDict[str, np.ndarray] = field(default_factory=OrderedDict)  # key -> [L] int32
    num_tokens: int = 0
    flat: np.ndarray | None = None  # docs joined by SEPARATOR, rebuilt after a change
    front: int = 0  # buffer positions (tokens and separators) evicted from the front, ever
    # (positions sorted by token, stably: ever coordinates; their tokens; ever end of what it covers)
    occurrences: tuple[np.ndarray, np.ndarray, int] | None = None
    index_min_tokens: int = 8192  # smaller buffers are scanned
    reindex_tokens: int = 32768  # unindexed tokens at the end scanned before the index is rebuilt

    def buffer(self) -> np.ndarray:
        if self.flat is None:
            parts = []
            for doc in self.docs.values():
                parts.append(doc)
                parts.append(np.array([SEPARATOR], dtype=np.int32))
            self.flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
        return self.flat

    def positions(self, token: int) -> np.ndarray:
        """Ascending positions of ``token`` in ``buffer()`` [n] int64."""
        flat = self.buffer()
        if flat.shape[0] < self.index_min_tokens:
            return np.flatnonzero(flat == token)
        index = self.occurrences
        if index is None or self.front + flat.shape[0] - index[2] > self.reindex_tokens:
            order = np.argsort(flat, kind="stable")
            index = self.occurrences = (order + self.front, flat[order], self.front + flat.shape[0])
        order, keys, end = index
        key = keys.dtype.type(token)  # a Python int would cast all of keys to int64 first (~0.5 ms at 1M)
        lo, hi = keys.searchsorted(key, "left"), keys.searchsorted(key, "right")
        found = order[lo:hi] - self.front
        found = found[found >= 0]  # occurrences evicted since the index was built
        # the unindexed end (documents learnt since): all of the buffer once the indexed ones are evicted
        start = max(0, end - self.front)
        if start < flat.shape[0]:
            found = np.concatenate([found, np.flatnonzero(flat[start:] == token) + start])
        return found

    def evict_oldest(self) -> int:
        """Drops the oldest document -> its token count."""
        _, doc = self.docs.popitem(last=False)
        self.front += doc.shape[0] + 1  # its tokens and its separator
        self.num_tokens -= doc.shape[0]
        self.flat = None
        return doc.shape[0]


def memory_key(segment: str, draft_scope: str = "") -> str:
    """The index key of what a sequence of ``segment`` and ``draft_scope`` learns and drafts from
    (the segment alone for the shared scope: its key is the segment's name)."""
    return f"{segment}\x1f{draft_scope}" if draft_scope else segment


@dataclass(slots=True)
class SuffixIndex:
    """Finished sequences' tokens per memory (a segment, or a segment and draft scope:
    ``memory_key``), bounded: at most ``max_tokens`` tokens and ``max_segments`` memories in all.

    Past the token bound the memory holding the most tokens gives up its oldest document (ties:
    the least recently used, used = learnt into or matched against), so memories share the bound
    max-min fairly: one scope learning without end (a tenant's flood) sheds its own documents once
    it holds the most and leaves the others theirs, where the least recently used memory paid for
    it before; a memory alone may fill the bound. A memory's newest document always stays. Past
    the memory bound the least recently used memory is dropped whole."""

    max_tokens: int = 1 << 20
    max_segments: int = 256
    _segments: OrderedDict[str, _Segment] = field(default_factory=OrderedDict, init=False, repr=False)
    num_tokens: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.max_segments < 1:
            raise ValueError(f"max_tokens and max_segments must be >= 1, got {self.max_tokens}, {self.max_segments}")

    @property
    def segments(self) -> list[str]:
        """Segments held, least recently used first."""
        return list(self._segments)

    def documents(self, segment: str) -> int:
        seg = self._segments.get(segment)
        return 0 if seg is None else len(seg.docs)

    def add(self, segment: str, key: str, tokens: list[int] | np.ndarray) -> None:
        """Learn ``tokens`` (prompt + output of one sequence) under ``key``, replacing what that
        key held before (a longer list of the same sequence after a preemption)."""
        doc = np.asarray(tokens, dtype=np.int32)[-self.max_tokens:]
        seg = self._touch(segment, create=True)
        old = seg.docs.pop(key, None)
        if old is not None:
            seg.num_tokens -= old.shape[0]
            self.num_tokens -= old.shape[0]
            seg.occurrences = None  # a document left the middle: positions after it moved
        if doc.shape[0]:
            seg.docs[key] = doc
            seg.num_tokens += doc.shape[0]
            self.num_tokens += doc.shape[0]
        seg.flat = None
        self._evict(keep=segment)

    def buffer(self, segment: str) -> np.ndarray | None:
        """The segment's documents joined by SEPARATOR [T] int32 (marks the segment used), or
        None for a segment with nothing learnt."""
        seg = self._touch(segment, create=False)
        return None if seg is None or not seg.docs else seg.buffer()

    def positions(self, segment: str, token: int) -> np.ndarray:
        """Ascending positions of ``token`` in the segment's ``buffer`` (which must hold something)."""
        return self._segments[segment].positions(token)

    def _touch(self, segment: str, create: bool) -> _Segment | None:
        seg = self._segments.get(segment)
        if seg is None:
            if not create:
                return None
            seg = self._segments[segment] = _Segment()
        self._segments.move_to_end(segment)
        return seg

    def _evict(self, keep: str) -> None:
        while len(self._segments) > self.max_segments:
            self._drop_segment(next(iter(self._segments)))
        while self.num_tokens > self.max_tokens:
            # the largest memory (ties: the least recently used first, the order of the dict)
            # gives up its oldest document; the one just learnt into keeps its newest document
            # (it fits the bound)
            name = max((n for n, seg in self._segments.items() if n != keep or len(seg.docs) > 1),
                       key=lambda n: self._segments[n].num_tokens)
            seg = self._segments[name]
            self.num_tokens -= seg.evict_oldest()
            if not seg.docs:
                del self._segments[name]

    def _drop_segment(self, name: str) -> None:
        seg = self._segments.pop(name)
        self.num_tokens -= seg.num_tokens


def match_starts(buf: np.ndarray, tail: np.ndarray, max_depth: int, own: bool,
                 last: np.ndarray | None = None) -> list[np.ndarray]:
    """buf [T], tail [L] (the sequence's latest tokens) -> per match length m = 1.. (index m-1)
    the positions in buf where a continuation of tail's last m tokens starts, ascending; the list
    ends at the first m with none. own: buf ends with tail itself (the sequence's history), so
    the trivial match at its end, which has no continuation, is left out. last: the positions
    of tail's last token in buf, when an index already knows them (else buf is scanned)."""
    end = buf.shape[0] - 1 if own else buf.shape[0]
    if end <= 0 or tail.shape[0] == 0:
        return []
    if last is None:
        starts = np.flatnonzero(buf[:end] == tail[-1]) + 1
    else:
        starts = last[last < end] + 1
    if starts.size == 0:
        return []
    return longer_matches(buf, tail, starts, 2, min(max_depth, tail.shape[0]), [starts])


def longer_matches(buf: np.ndarray, tail: np.ndarray, starts: np.ndarray, first: int, last: int,
                   out: list[np.ndarray]) -> list[np.ndarray]:
    """``out`` (the starts per match length up to first - 1, ``starts`` its last) extended with the
    starts of matches of first..last tokens of tail, each narrowed from the one before by one more
    token back; it ends at the first length with none."""
    for m in range(first, last + 1):
        starts = starts[starts >= m]
        starts = starts[buf[starts - m] == tail[-m]]
        if starts.size == 0:
            break
        out.append(starts)
    return out


CORPUS_WEAK_PROB = 0.5  # a corpus draft whose first token's empirical probability is below: context "c<m>w"
SMALL_WALK = 32  # at most this many occurrences in all: walked in Python lists


def walk(sources: list[tuple[np.ndarray, np.ndarray]], max_len: int, min_token_prob: float) -> tuple[list[int], list[float]]:
    """sources: (buf [T], continuation starts [n]) -> the greedy continuation and the running
    probability of each of its tokens. Ties go to the most recent occurrence (later sources and
    later positions are more recent). A few occurrences are walked in Python lists (numpy's
    per-call overhead made a walk ~0.3 ms a step, most of it over a handful of occurrences),
    many with numpy; both give the same walk."""
    if sum(starts.size for _, starts in sources) <= SMALL_WALK:
        return walk_lists(sources, max_len, min_token_prob)
    return walk_arrays(sources, max_len, min_token_prob)


def walk_lists(sources: list[tuple[np.ndarray, np.ndarray]], max_len: int,
               min_token_prob: float) -> tuple[list[int], list[float]]:
    """``walk`` over each occurrence's continuation as a Python list (up to ``max_len`` tokens,
    cut at the first SEPARATOR)."""
    # (recency: source then position, continuation); later sources and positions are more recent
    live: list[tuple[tuple[int, int], list[int]]] = []
    for i, (buf, starts) in enumerate(sources):
        for s in starts.tolist():
            cont = buf[s : s + max_len].tolist()
            if SEPARATOR in cont:
                cont = cont[: cont.index(SEPARATOR)]
            live.append(((i, s), cont))
    tokens: list[int] = []
    probs: list[float] = []
    prob = 1.0
    for depth in range(max_len):
        if len(live) == 1:  # one occurrence left: its continuation, as is
            rest = live[0][1][depth:]
            tokens += rest
            probs += [float(prob)] * len(rest)
            break
        counts: dict[int, int] = {}
        recent: dict[int, tuple[int, int]] = {}
        total = 0
        for rank, cont in live:
            if len(cont) > depth:
                t = cont[depth]
                counts[t] = counts.get(t, 0) + 1
                if rank > recent.get(t, (-1, -1)):
                    recent[t] = rank
                total += 1
        if not total:
            break
        best = max(counts, key=lambda t: (counts[t], recent[t]))  # most frequent, then most recent
        prob *= counts[best] / total
        if prob < min_token_prob:
            break
        tokens.append(best)
        probs.append(float(prob))
        live = [(rank, cont) for rank, cont in live if len(cont) > depth and cont[depth] == best]
    return tokens, probs


def walk_arrays(sources: list[tuple[np.ndarray, np.ndarray]], max_len: int,
                min_token_prob: float) -> tuple[list[int], list[float]]:
    """``walk`` with numpy over each source's occurrences."""
    tokens: list[int] = []
    probs: list[float] = []
    prob = 1.0
    live = [(buf, starts) for buf, starts in sources if starts.size]
    for depth in range(max_len):
        alive = [(buf, starts) for buf, starts in live if starts.size]
        if len(alive) == 1 and alive[0][1].size == 1:  # one occurrence left: its continuation, as is
            buf, at = alive[0][0], int(alive[0][1][0]) + depth
            rest = buf[at : at + max_len - depth]
            stop = np.flatnonzero(rest == SEPARATOR)
            rest = rest[: stop[0]] if stop.size else rest
            tokens += rest.tolist()
            probs += [float(prob)] * rest.shape[0]
            break
        nexts, ranks, keep = [], [], []
        offset = 0
        for buf, starts in live:
            at = starts + depth
            ok = at < buf.shape[0]
            at = at[ok]
            tok = buf[at]
            real = tok != SEPARATOR
            nexts.append(tok[real])
            ranks.append(at[real].astype(np.int64) + offset)
            keep.append((buf, starts[ok][real]))
            offset += buf.shape[0] + 1
        if not nexts:
            break
        tok = np.concatenate(nexts)
        if tok.size == 0:
            break
        values, inverse, counts = np.unique(tok, return_inverse=True, return_counts=True)
        recent = np.zeros(values.shape[0], dtype=np.int64)
        np.maximum.at(recent, inverse, np.concatenate(ranks))
        best = int(np.lexsort((recent, counts))[-1])  # most frequent, then most recent
        prob *= counts[best] / tok.size
        if prob < min_token_prob:
            break
        t = int(values[best])
        tokens.append(t)
        probs.append(float(prob))
        live = [(buf, starts[buf[starts + depth] == t]) for buf, starts in keep]
    return tokens, probs


@dataclass(slots=True)
class _Seen:
    history: TokenHistory  # int32, appended to step by step
    memory: str  # its index key: memory_key(segment, draft_scope)
    draft: SuffixDraft | None = None  # the proposal for exactly these tokens, once computed


@dataclass(slots=True)
class SuffixProposer:
    max_depth: int = 16  # longest suffix matched
    max_spec_tokens: int = 16  # longest draft (K caps it too)
    min_token_prob: float = 0.1  # stop once the running empirical probability falls below
    max_spec_factor: float = 2.0  # a match of m tokens drafts at most factor * m + offset tokens
    max_spec_offset: float = 1.0
    max_candidates: int = 256  # most recent occurrences walked per source
    index: SuffixIndex = field(default_factory=SuffixIndex)
    corpus: SuffixCorpus | None = None  # the target's earlier outputs, read-only (a warm start)
    corpus_min_token_prob: float = 0.1  # min_token_prob for walks in the corpus
    # a corpus draft's score (expected accepted tokens by the corpus' counts) is worth this much
    # beside the sequence's own and its segment's: the corpus' counts come from other requests and
    # overstate acceptance (chat: drafts of first-token probability 0.7 right ~0.45 of the time)
    corpus_weight: float = 0.4
    kind: DrafterKind = field(default=DrafterKind.SUFFIX, init=False)
    corpus_drafts: int = field(default=0, init=False)  # drafts proposed from the corpus (stats, tests)
    _seen: dict[str, _Seen] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_depth < 1 or self.max_spec_tokens < 1 or self.max_candidates < 1:
            raise ValueError("max_depth, max_spec_tokens and max_candidates must be >= 1")
        if not 0.0 <= self.min_token_prob <= 1.0 or not 0.0 <= self.corpus_min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob and corpus_min_token_prob must be in [0, 1], got "
                             f"{self.min_token_prob}, {self.corpus_min_token_prob}")
        if not 0.0 < self.corpus_weight <= 1.0:
            raise ValueError(f"corpus_weight must be in (0, 1], got {self.corpus_weight}")
        if self.max_spec_factor < 0 or self.max_spec_offset < 0:
            raise ValueError("max_spec_factor and max_spec_offset must be >= 0")

    def propose(self, inputs: list[ProposeInput]) -> DraftProposal:
        drafts = []
        for inp in inputs:
            d = self._draft(inp.seq_id, inp.token_ids, memory_key(inp.segment, inp.draft_scope)) \
                if inp.num_draft_tokens > 0 else NO_DRAFT
            self.corpus_drafts += d.from_corpus and bool(d.tokens)
            drafts.append(d.tokens[: inp.num_draft_tokens])
        return DraftProposal(draft_token_ids=drafts, draft_probs=[None] * len(inputs))

    def draft_context(self, seq_id: str, token_ids: list[int], segment: str = "",
                      draft_scope: str = "", acceptance_class: str = "") -> str | None:
        """"m<length>" of the match the next draft rests on (4 and longer pooled), or None when
        nothing matches: adaptive K keeps acceptance per context. A match in the corpus is
        "c<length>", and "c<length>w" where its first token's empirical probability is below
        ``CORPUS_WEAK_PROB`` (on the default model's chat such drafts are right 0.15-0.3 of the
        time, the others 0.4-0.6: a portfolio weighs them apart). The label carries the sequence's
        acceptance class (``classed_context``)."""
        d = self._draft(seq_id, token_ids, memory_key(segment, draft_scope))
        if not d.tokens:
            return None
        length = min(d.match_len, 4)
        label = f"c{length}{'w' if d.probs[0] < CORPUS_WEAK_PROB else ''}" if d.from_corpus else f"m{length}"
        return classed_context(label, acceptance_class)

    def release(self, seq_id: str) -> None:
        """The sequence is done (or preempted): learn its last seen tokens into its segment and scope."""
        seen = self._seen.pop(seq_id, None)
        if seen is not None and seen.history.length > 1:
            self.index.add(seen.memory, seq_id, seen.history.tokens.copy())  # not the spare capacity

    def proposal(self, seq_id: str, token_ids: list[int], segment: str = "", draft_scope: str = "") -> SuffixDraft:
        """The full draft (up to max_spec_tokens) with its probabilities and match length."""
        return self._draft(seq_id, token_ids, memory_key(segment, draft_scope))

    def _draft(self, seq_id: str, token_ids: list[int], memory: str) -> SuffixDraft:
        seen = self._seen.get(seq_id)
        grew = None if seen is None or seen.memory != memory else seen.history.follow(token_ids)
        if grew is None:
            seen = self._seen[seq_id] = _Seen(TokenHistory.of(token_ids, np.int32), memory)
        elif grew:
            seen.draft = None
        if seen.draft is None:
            seen.draft = self._search(seen.history.tokens, memory)
        return seen.draft

    def _search(self, history: np.ndarray, memory: str) -> SuffixDraft:
        """history [L] int32 -> the best-scoring draft over all match lengths: in the sequence's own
        history and its segment's index together, then in the corpus alone (matches of two tokens
        and more), which wins only where its score times ``corpus_weight`` is higher — its many
        occurrences never outvote the sequence's own at the same match length."""
        if history.shape[0] < 1:
            return NO_DRAFT
        tail = history[-self.max_depth:]
        learnt = self.index.buffer(memory)
        per_source = [(history, match_starts(history, tail, self.max_depth, own=True))]
        if learnt is not None:
            last = self.index.positions(memory, int(tail[-1]))
            per_source.insert(0, (learnt, match_starts(learnt, tail, self.max_depth, own=False, last=last)))
        best = self._best(per_source, NO_DRAFT, lowest=1)
        if self.corpus is not None and tail.shape[0] >= 2:
            found = corpus_match_starts(self.corpus, tail)
            if found:
                best = self._best([(self.corpus.tokens, found)], best, lowest=2, from_corpus=True,
                                  min_token_prob=self.corpus_min_token_prob, weight=self.corpus_weight)
        return best

    def _best(self, per_source: list[tuple[np.ndarray, list[np.ndarray]]], best: SuffixDraft, lowest: int,
              from_corpus: bool = False, min_token_prob: float | None = None, weight: float = 1.0) -> SuffixDraft:
        """per_source: (buf [T], continuation starts per match length m = 1.. (index m - 1)) -> the
        best of ``best`` and the walks of matches ``lowest`` tokens long and longer, their scores
        times ``weight`` against ``best``'s."""
        longest = max(len(m) for _, m in per_source)
        previous = None
        bar = best.score
        for m in range(longest, lowest - 1, -1):
            cap = min(self.max_spec_tokens, int(self.max_spec_factor * m + self.max_spec_offset))
            if bar >= weight * cap:
                break  # a walk of at most cap tokens scores at most cap, and caps shrink with m
            sizes = tuple(ms[m - 1].size if len(ms) >= m else 0 for _, ms in per_source)
            if sizes == previous:
                continue  # the same occurrences as the longer match: the same walk, lower rank
            previous = sizes
            sources = [(buf, ms[m - 1][-self.max_candidates:]) for buf, ms in per_source if len(ms) >= m]
            tokens, probs = walk(sources, cap, self.min_token_prob if min_token_prob is None else min_token_prob)
            if tokens and weight * sum(probs) > bar:
                best, bar = SuffixDraft(tokens, probs, m, from_corpus), weight * sum(probs)
        return best


def corpus_match_starts(corpus: SuffixCorpus, tail: np.ndarray) -> list[np.ndarray]:
    """tail [L >= 2] -> per match length m = 1.. (index m - 1) the positions in the corpus where a
    continuation of tail's last m tokens starts, ascending; the list ends at the first m with none.
    The corpus matches two tokens at least: index 0 holds the two-token starts too (unused)."""
    starts = corpus.pair_positions(int(tail[-2]), int(tail[-1])).astype(np.int64) + 1
    if starts.size == 0:
        return []
    return longer_matches(corpus.tokens, tail, starts, 3, tail.shape[0], [starts, starts])
