"""The one interface every drafter implements, and the parsing of a drafter choice string.

Owns: ``DrafterKind`` (which family of drafter), the ``Proposer`` protocol the engine calls once
per step for all speculating sequences, the optional capabilities a drafter may add
(``ContextualProposer``, ``LocalModelProposer``, ``RemoteDraft``, ``TargetFeatureReader``,
``DraftStatus``), and
``parse_drafter_choice`` (the ``--drafter`` / ``SpecConfig.drafter`` string -> typed
``DrafterChoice``). Ignores: building drafters (the engine does that from the choice), loading
models, and verification (``rejection_sampler``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from cluster.common.config import COLD_SUFFIX, suffix_corpus_name

if TYPE_CHECKING:  # annotations only: the protocols load without torch (the fake engine reads them)
    from cluster.speculative.types import DraftProposal, ProposeInput


class DrafterKind(enum.Enum):
    DRAFT_MODEL = "draft_model"  # an independent small model sharing the target vocabulary
    NGRAM = "ngram"  # prompt lookup: copy what followed the latest matching n-gram
    SELF = "self"  # layer skip: the first L target layers + the target LM head
    REMOTE = "remote"  # a draft model living in a DraftServer, reached over KVSync
    SUFFIX = "suffix"  # continuations learnt from the segment's earlier prompts and outputs
    PORTFOLIO = "portfolio"  # per sequence and step, the drafter expected to commit most per cost
    EAGLE = "eagle"  # a trained head drafting from the target's own features (eagle:DIR)


@runtime_checkable
class Proposer(Protocol):
    """A drafter. ``propose`` gets every speculating sequence of one engine step.

    Contract:
    - ``propose`` returns one entry per input, in order; entry i has at most
      ``inputs[i].num_draft_tokens`` draft tokens (fewer, even zero, is allowed: the engine then
      verifies what it got, or decodes plainly). ``draft_probs[i]`` is q [K_i, V] float32,
      processed with ``cluster.sampling.sampler.logits_to_probs`` under the sequence's sampling
      params, or None for a deterministic (one-hot) draft.
    - A stateful drafter (own KV cache) must roll back or extend its state so that it matches
      ``token_ids`` exactly before proposing.
    - ``release`` frees per-sequence state when a sequence finishes or is preempted; releasing an
      unknown seq_id is a no-op.
    - A drafter may also offer the optional capabilities below (``ContextualProposer``,
      ``LocalModelProposer``, ``CatchUpProposer``, ``MemberStatsProposer``, ``RemoteDraft``); the
      engine asks with ``isinstance``.
    """

    kind: DrafterKind

    def propose(self, inputs: list[ProposeInput]) -> DraftProposal: ...

    def release(self, seq_id: str) -> None: ...


@runtime_checkable
class ContextualProposer(Protocol):
    """A drafter that labels what its next draft would rest on (n-gram: the match length), so
    that adaptive K estimates acceptance per label."""

    def draft_context(self, seq_id: str, token_ids: list[int], segment: str = "",
                      draft_scope: str = "", acceptance_class: str = "") -> str | None:
        """The label of the next draft for this sequence (of ``segment`` and ``draft_scope``, see
        ``ProposeInput``; ``acceptance_class``: the sequence's, its label carries it —
        ``classed_context`` — so that each class's acceptance is learnt apart); None: nothing to draft now."""


@runtime_checkable
class LocalModelProposer(Protocol):
    """A drafter that runs a model in this process (draft model, layer skip): its runner sizes
    what a draft round costs before any round is timed."""

    runner: Any  # ModelRunner (None where a wrapper has no model behind it)


@runtime_checkable
class CatchUpProposer(Protocol):
    """A drafter with its own per-sequence state (an EAGLE head's K/V) that first runs the
    committed positions it has not run — all of the prompt on its first draft for a sequence —
    so a draft after a long plain stretch costs far more than its rounds (adaptive K prices it
    apart: the round cost is not inflated and probes wait until their catch-up is cheap)."""

    last_caught_up: int  # committed positions the last propose() ran before drafting, all rows

    def positions_behind(self, seq_id: str, token_ids: list[int]) -> int:
        """Committed positions a draft for the sequence would run first."""


@runtime_checkable
class MemberStatsProposer(Protocol):
    """A drafter made of member drafters (the portfolio): the drafts each member produced, and
    each member's draft cost on its own (the engine's cost model times members separately)."""

    # member -> (draft rounds, seconds, committed positions it caught up on first), last propose
    last_member_rounds: dict[str, tuple[int, float, int]]

    def drafter_stats(self) -> dict[str, dict]:
        """member -> {steps, draft_tokens, accepted_tokens}."""

    def member_cost_priors(self) -> dict[str, float]:
        """member -> prior cost of one draft round, in target decode steps."""

    def member_of(self, context: str) -> str:
        """The member whose draft a ``draft_context`` label announces."""

    def planning_alpha(self, seq_id: str) -> tuple[float, float] | None:
        """(α1, α) the member chosen for the sequence's next draft was valued at (adaptive K plans
        its K with them), or None to leave it to adaptive K's own estimate."""

    def use_costs(self, costs: Any) -> None:
        """Choose members with the engine's measured step costs (``adaptive_k.StepCostModel``)."""


@runtime_checkable
class RemoteDraft(Protocol):
    """A drafter in another process, kept in step over KVSync (``cluster.kvsync.client``): the
    engine tells it the target's vocabulary and step time and reads which sequences it resynced."""

    expected_vocab_size: int | None  # None until the engine sets the target's
    last_resynced: set[str]  # seq ids whose whole prefix the last propose() resent
    num_resyncs: int

    def observe_target_step(self, forward_s: float) -> None:
        """One target forward took ``forward_s``: the draft deadline follows the step time."""


@runtime_checkable
class TargetFeatureReader(Protocol):
    """A drafter elsewhere that may read the target's features (a DraftServer hosting an EAGLE
    head): the engine hands it the target runner, on which it installs its feature tap."""

    def attach_target(self, runner: Any) -> None: ...


@runtime_checkable
class DraftStatus(Protocol):
    """What a replica shows of its remote drafter: the KVSync proposer itself, or the stand-in
    a ``ProcessEngine`` keeps for the one that runs in its engine core process."""

    address: str | None
    num_resyncs: int
    num_epoch_changes: int

    def set_address(self, address: str | None) -> None: ...

    def tracked(self) -> dict[str, int]:
        """seq id -> committed length the draft side holds."""


@dataclass(slots=True)
class DrafterChoice:
    kind: DrafterKind
    self_layers: int | None = None  # SELF only; None lets the engine pick a default depth
    # DRAFT_MODEL / REMOTE: a model source (path or hub id); EAGLE: the head's directory; PORTFOLIO:
    # the directory of the head it holds as its ``eagle`` member (None: the shipped head when it fits);
    # SUFFIX: its corpus file, or COLD_SUFFIX (None: the shipped corpus when it fits)
    model: str | None = None

    @property
    def learns_from_traffic(self) -> bool:
        """Drafts from earlier requests' outputs (``suffix``, the portfolio's suffix member): a
        request repeating an earlier greedy one is drafted from that answer (α near 1), so a
        benchmark that repeats its rows measures memory, not new traffic (``bench serve``)."""
        return self.kind in (DrafterKind.SUFFIX, DrafterKind.PORTFOLIO)

    @property
    def names_suffix_corpus(self) -> bool:
        """A suffix drafter over a corpus file (``suffix:FILE``): checked against the target that wrote it."""
        return self.kind is DrafterKind.SUFFIX and self.model not in (None, COLD_SUFFIX)

    def __post_init__(self) -> None:
        if self.self_layers is not None:
            if self.kind is not DrafterKind.SELF:
                raise ValueError(f"self_layers only applies to the self drafter, not {self.kind.value}")
            if self.self_layers < 1:
                raise ValueError(f"self-speculation needs at least 1 layer, got {self.self_layers}")
        if self.kind in (DrafterKind.DRAFT_MODEL, DrafterKind.REMOTE, DrafterKind.EAGLE) and not self.model:
            raise ValueError(f"a {self.kind.value} drafter needs a model source (eagle: eagle:DIR)")


# the head shipped for the default model (SmolLM2-135M-Instruct): drafter ``eagle``; its README.md
# gives the command that made it. Any other target refuses it (target fingerprint).
SHIPPED_EAGLE_HEAD = Path(__file__).resolve().parent / "heads" / "smollm2-135m-instruct"




def is_eagle_choice(s: str | None) -> bool:
    low = (s or "").strip().lower()
    return low == "eagle" or low.startswith("eagle:")


MODEL_FREE = (DrafterKind.NGRAM, DrafterKind.SUFFIX, DrafterKind.PORTFOLIO)  # vocabulary-agnostic


def parse_drafter_choice(s: str | None) -> DrafterChoice | None:
    """"ngram" | "suffix" (with the suffix corpus shipped for the default model where it fits the
    target) | "suffix:FILE" (with the corpus in FILE) | "suffix:cold" (no corpus: traffic only) |
    "portfolio" | "portfolio:DIR" (its EAGLE member the head in DIR) | "self" |
    "self:L" | "eagle" (the head shipped for the default model) | "eagle:DIR" (a head made by
    ``specserve train-draft``) | "none" / "" (no speculation) | anything else: a draft model.

    >>> parse_drafter_choice("self:4")
    DrafterChoice(kind=<DrafterKind.SELF: 'self'>, self_layers=4, model=None)
    """
    text = (s or "").strip()
    low = text.lower()
    if low in ("", "none"):
        return None
    if low == "ngram":
        return DrafterChoice(DrafterKind.NGRAM)
    if low == "suffix":
        return DrafterChoice(DrafterKind.SUFFIX)
    if low.startswith("suffix:"):
        corpus = text[len("suffix:"):].strip()
        if not corpus:
            raise ValueError("drafter 'suffix:FILE' needs a suffix corpus file (made by `specserve suffix-corpus`), "
                             f"or 'suffix:{COLD_SUFFIX}' for none")
        return DrafterChoice(DrafterKind.SUFFIX, model=suffix_corpus_name(corpus))
    if low == "portfolio":
        return DrafterChoice(DrafterKind.PORTFOLIO)
    if low.startswith("portfolio:"):
        head_dir = text[len("portfolio:"):].strip()
        if not head_dir:
            raise ValueError("drafter 'portfolio:DIR' needs the directory of the EAGLE head it holds "
                             "(a head made by `specserve train-draft`)")
        return DrafterChoice(DrafterKind.PORTFOLIO, model=head_dir)
    if low == "self":
        return DrafterChoice(DrafterKind.SELF)
    if low == "eagle":
        if not (SHIPPED_EAGLE_HEAD / "eagle_config.json").is_file():
            raise ValueError(f"drafter 'eagle': the shipped head ({SHIPPED_EAGLE_HEAD}) is missing; train one "
                             "with `specserve train-draft --out DIR` and use 'eagle:DIR'")
        return DrafterChoice(DrafterKind.EAGLE, model=str(SHIPPED_EAGLE_HEAD))
    if low.startswith("eagle:"):
        head_dir = text[len("eagle:"):].strip()
        if not head_dir:
            raise ValueError("drafter 'eagle:DIR' needs the head's directory")
        return DrafterChoice(DrafterKind.EAGLE, model=head_dir)
    if low.startswith("self:"):
        raw = text[len("self:"):].strip()
        try:
            layers = int(raw)
        except ValueError:
            raise ValueError(
                f"drafter {text!r}: expected 'self:L' with L a positive number of target layers, "
                f"got {raw!r}") from None
        if layers < 1:
            raise ValueError(f"drafter {text!r}: self-speculation needs L >= 1 layers, got {layers}")
        return DrafterChoice(DrafterKind.SELF, self_layers=layers)
    return DrafterChoice(DrafterKind.DRAFT_MODEL, model=text)
