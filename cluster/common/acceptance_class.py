"""Acceptance classes: the kinds of request whose draft acceptance is learnt, and gated, apart.

A sequence's class is named by its sampling parameters alone: greedy or sampled (temperature > 0),
its logits shaped or not (a penalty or ``logit_bias``). Drafters tag their draft contexts with it
(``classed_context``), adaptive K keys its estimates by it, the SpecEngine reports a live α per
class and segment, and the Router gates each class on its own α.

Owns: the tags, the class of a ``SamplingParams`` and the names stats, metrics and the Router use.
Ignores: how α is estimated (``cluster.speculative.acceptance``) and what is gated on it
(``cluster.routing.policy``, rule 6).
"""
from __future__ import annotations

SAMPLED = "+sampled"  # a draft context's tag for a sampled sequence (temperature > 0)
SHAPED = "+shaped"  # ... for a sequence whose logits are shaped (penalties, logit_bias)


def acceptance_class(params) -> str:
    """The tags of the traffic whose acceptance a sequence is judged with (``SamplingParams``;
    "": greedy and unshaped). A one-hot draft token is accepted at the target's probability of it
    there, not whenever it is the argmax: on the default model the portfolio's drafts were accepted
    about half as often at temperature 0.7 as greedy (0.19 against 0.32 of the draft tokens,
    ``bench shaping``). A repetition penalty pushes the target off the tokens already in the prompt
    and output — the ones the n-gram and suffix drafters copy — and took chat's speedup from 1.28x
    to 1.09x and json's from 2.03x to 1.50x. Each class is learnt apart, so that neither kind of
    traffic sets the other's rates (nor its K)."""
    return (SAMPLED if not params.greedy else "") + (SHAPED if params.shapes_logits else "")


ACCEPTANCE_CLASSES = ("", SAMPLED, SHAPED, SAMPLED + SHAPED)  # every value of ``acceptance_class``
BASE_CLASS = "base"  # the name of the class of greedy, unshaped sequences


def class_name(acceptance_class: str) -> str:
    """An acceptance class as engine stats and the Router name it: "base", "sampled", "shaped",
    "sampled+shaped"."""
    return acceptance_class[1:] if acceptance_class else BASE_CLASS


CLASS_NAMES = tuple(class_name(c) for c in ACCEPTANCE_CLASSES)


def classed_context(context: str, acceptance_class: str) -> str:
    """A draft context as acceptance is learnt for it: tagged with the sequence's
    ``acceptance_class``."""
    return f"{context}{acceptance_class}"
