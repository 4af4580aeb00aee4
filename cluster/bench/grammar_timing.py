"""Time spent in the grammar path of an engine, for benchmarks only.

Owns: ``GrammarClock`` (seconds and calls per grammar operation), ``TimedGrammarCompiler`` (a
``GrammarCompiler`` whose matchers time themselves) and ``timed_grammar(engine)``, which installs
both on one engine and also times ``apply_masks`` (the -inf fill on the logits) where
``cluster.engine.target_rows`` calls it (plain steps and verification rows alike). Nothing in the
engine is timed unless a benchmark installs this, so
the serving hot path carries no timer. Ignores: what the grammar decides
(``cluster.engine.grammar``), the step's other phases (``bench spec`` times whole steps).

Operations: ``mask`` (``allowed``: the token bitmask), ``walk`` (a draft's masks, its own mask
calls included), ``forced`` (jump-forward tokens), ``accept`` (a committed token), ``apply``
(masking the logits), ``init`` (a sequence's matcher at admission). A call made inside another
timed call (``walk`` calls ``allowed``) counts once, in the outer one."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from cluster.engine.grammar import GrammarCompiler, GrammarMatcher

OPERATIONS = ("mask", "walk", "forced", "accept", "apply", "init")


@dataclass(slots=True)
class GrammarClock:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(OPERATIONS, 0.0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPERATIONS, 0))
    _depth: int = 0

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def snapshot(self) -> tuple[dict[str, float], dict[str, int]]:
        return dict(self.seconds), dict(self.calls)

    def since(self, snap: tuple[dict[str, float], dict[str, int]]) -> dict:
        """What was spent since ``snap`` -> {"seconds": {op: s}, "calls": {op: n}}."""
        s0, c0 = snap
        return {"seconds": {op: self.seconds[op] - s0[op] for op in OPERATIONS},
                "calls": {op: self.calls[op] - c0[op] for op in OPERATIONS}}

    def timed(self, op: str, fn, *args, **kwargs):
        if self._depth:
            return fn(*args, **kwargs)
        self._depth += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[op] += time.perf_counter() - t0
            self.calls[op] += 1
            self._depth -= 1


class TimedMatcher(GrammarMatcher):
    clock: GrammarClock

    def allowed(self):
        return self.clock.timed("mask", super().allowed)

    def walk(self, drafts, keep_illegal):
        return self.clock.timed("walk", super().walk, drafts, keep_illegal)

    def forced_tokens(self):
        return self.clock.timed("forced", super().forced_tokens)

    def accept(self, token):
        return self.clock.timed("accept", super().accept, token)


class TimedGrammarCompiler(GrammarCompiler):
    """Builds ``TimedMatcher``s that report to ``clock``."""

    clock: GrammarClock

    def matcher(self, constraint) -> GrammarMatcher:
        grammar = self.compile(constraint)  # cached after the first request: not timed

        def build():
            m = TimedMatcher(self, grammar)
            m.clock = self.clock
            return m

        return self.clock.timed("init", build)


@contextlib.contextmanager
def timed_grammar(engines):
    """Install a shared ``GrammarClock`` on ``engines`` (``LLMEngine``s; their grammar caches
    are kept) and time ``apply_masks`` where the target's rows are masked (``target_rows``); yields the
    clock. Restored on exit."""
    import cluster.engine.target_rows as target_rows

    clock = GrammarClock()
    saved = [(e, e.grammars) for e in engines]
    for e in engines:
        timed = TimedGrammarCompiler.__new__(TimedGrammarCompiler)
        timed.__dict__.update(e.grammars.__dict__)  # same tokenizer, cache and lock
        timed.clock = clock
        e.grammars = timed
    modules = (target_rows,)  # every step's masking: plain rows and verified rows alike
    originals = [m.apply_masks for m in modules]
    for m, fn in zip(modules, originals):
        m.apply_masks = lambda logits, allowed, _fn=fn: clock.timed("apply", _fn, logits, allowed)
    try:
        yield clock
    finally:
        for m, fn in zip(modules, originals):
            m.apply_masks = fn
        for e, g in saved:
            e.grammars = g
