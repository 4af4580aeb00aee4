"""The mask-matcher agreement property of ``cluster.engine.grammar``, shared by the CI test
(``tests/engine/test_grammar_agreement.py``) and the chaos suite's long profile
(``tests/chaos/test_grammar_agreement.py``).

Owns: ``check_agreement`` (one constraint, several steps of random allowed tokens: every token
the mask allows the matcher consumes, EOS allowed only where the matcher accepts the output as
complete, and sampled tokens the mask forbids the matcher refuses), ``AgreementTally`` (what
happened over many constraints) and ``run_property`` (hypothesis: N generated constraints through
the check). The matcher here is llguidance's own (``GrammarMatcher._m``), checked on copies so
each probe starts from the same state. Ignores: how constraints are made
(``tests/engine/grammar_strategies.py``).
"""
from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.common.errors import InvalidRequestError
from cluster.common.request import Constraint
from cluster.engine.grammar import GrammarCompiler, GrammarError
from tests.engine.grammar_strategies import constraints

ALLOWED_PROBES = 12  # allowed tokens consumed per step (the first, the last, and random ones)
FORBIDDEN_PROBES = 12  # forbidden tokens checked per step (validate), 3 of them also consumed


class Outcome(enum.Enum):
    REFUSED = "refused at compile (INVALID_ARGUMENT)"
    FAILED = "matcher past its limits at run time (that request's error)"
    ENDED = "grammar complete or only EOS left"
    RAN = "every step checked"


@dataclass(slots=True)
class AgreementTally:
    outcomes: dict[Outcome, int] = field(default_factory=lambda: {o: 0 for o in Outcome})
    steps: int = 0
    allowed_checked: int = 0
    forbidden_checked: int = 0

    def summary(self) -> str:
        counts = ", ".join(f"{o.name.lower()} {n}" for o, n in self.outcomes.items())
        return (f"{sum(self.outcomes.values())} constraints ({counts}); {self.steps} steps, "
                f"{self.allowed_checked} allowed and {self.forbidden_checked} forbidden tokens checked")


def check_agreement(compiler: GrammarCompiler, constraint: Constraint, rng: random.Random,
                    tally: AgreementTally, steps: int = 5) -> Outcome:
    """Assert mask-matcher agreement along ``steps`` random allowed tokens of ``constraint``."""
    try:
        matcher = compiler.matcher(constraint)
    except InvalidRequestError:
        return _count(tally, Outcome.REFUSED)
    eos = set(compiler.eos_token_ids)
    for _ in range(steps):
        try:
            allowed = matcher.allowed()  # [V] bool
        except GrammarError:  # past llguidance's limits: the engine fails this request alone
            return _count(tally, Outcome.FAILED)
        tally.steps += 1
        ids = torch.nonzero(allowed).flatten().tolist()
        legal = [t for t in ids if t not in eos]
        for t in ids:
            if t in eos:
                assert matcher._m.is_accepting(), f"EOS allowed where the output is not complete: {constraint}"
        probes = legal if len(legal) <= ALLOWED_PROBES else \
            [legal[0], legal[-1]] + rng.sample(legal[1:-1], ALLOWED_PROBES - 2)
        for t in probes:
            probe = matcher._m.deep_copy()
            assert probe.consume_token(t), \
                f"mask allows token {t} the matcher refuses ({probe.get_error()[:200]}): {constraint}"
            tally.allowed_checked += 1
        forbidden = _sample_forbidden(allowed, rng)
        for i, t in enumerate(forbidden):
            assert matcher._m.validate_tokens([t]) == 0, f"matcher takes token {t} the mask forbids: {constraint}"
            if i < 3 and t not in eos:
                assert not matcher._m.deep_copy().consume_token(t), \
                    f"matcher consumes token {t} the mask forbids: {constraint}"
            tally.forbidden_checked += 1
        if not legal:
            return _count(tally, Outcome.ENDED)
        matcher.accept(rng.choice(legal))  # the engine's commit path: must not raise
        if matcher.complete:
            return _count(tally, Outcome.ENDED)
    return _count(tally, Outcome.RAN)


def run_property(compiler: GrammarCompiler, examples: int, tally: AgreementTally,
                 derandomize: bool = False) -> None:
    """``examples`` generated constraints through ``check_agreement`` (counted in ``tally``, also
    when one fails: hypothesis then raises with the shrunk constraint); ``derandomize``: the same
    constraints every run (CI)."""

    @settings(max_examples=examples, deadline=None, database=None, print_blob=True,
              derandomize=derandomize, suppress_health_check=list(HealthCheck))
    @given(constraint=constraints, seed=st.integers(0, 2**32 - 1))
    def prop(constraint: Constraint, seed: int) -> None:
        check_agreement(compiler, constraint, random.Random(seed), tally)

    prop()


def _sample_forbidden(allowed: torch.Tensor, rng: random.Random) -> list[int]:
    """Up to FORBIDDEN_PROBES tokens the mask forbids, uniformly among them."""
    vocab = allowed.shape[0]
    num_forbidden = vocab - int(allowed.sum())
    if num_forbidden <= vocab // 64:  # few: take them from the list
        forbidden = torch.nonzero(~allowed).flatten().tolist()
        return rng.sample(forbidden, min(FORBIDDEN_PROBES, len(forbidden)))
    out: list[int] = []
    while len(out) < FORBIDDEN_PROBES:  # many: rejection sampling, at least 1 draw in 64 hits
        t = rng.randrange(vocab)
        if not allowed[t]:
            out.append(t)
    return out


def _count(tally: AgreementTally, outcome: Outcome) -> Outcome:
    tally.outcomes[outcome] += 1
    return outcome
