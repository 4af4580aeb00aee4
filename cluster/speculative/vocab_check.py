"""The hard constraint of draft-model sourceulation: draft and target share one vocabulary.

Owns: comparing two Hugging Face tokenizers id-for-id (``check_vocab_compatible`` ->
``VocabReport`` naming every concrete difference) and the gate that refuses a mismatched pair
unless forced (``require_vocab_compatible``). A mismatch does not crash anything — draft ids
simply mean other strings to the target, and α silently collapses to ~0 — which is why we refuse
loudly at load time. Ignores: model embedding sizes (a padded LM head is fine as long as the
tokenizers agree) and vocabulary trimming of the draft head (a subset by construction).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from cluster.common.errors import VocabularyMismatchError

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
MAX_EXAMPLES = 5
# Encoded by both tokenizers when the vocabularies agree: catches different merges / normalizers
# (the draft would then see id sequences it never saw in training).
PROBE_TEXT = ("The quick brown fox jumps over the lazy dog. def f(x): return {'k': [1, 2.5]}\n"
              "Speculative decoding verifies draft tokens in one pass.")


@dataclass(slots=True)
class VocabReport:
    compatible: bool
    differences: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.compatible:
            return "draft and target vocabularies are identical"
        return "; ".join(self.differences)


def _examples(items: list[str]) -> str:
    shown = ", ".join(items[:MAX_EXAMPLES])
    more = f" (+{len(items) - MAX_EXAMPLES} more)" if len(items) > MAX_EXAMPLES else ""
    return shown + more


def _special(tok: Any, name: str) -> tuple[str | None, int | None]:
    token = getattr(tok, name, None)
    token = None if token is None else str(token)
    token_id = getattr(tok, f"{name}_id", None)
    return token, token_id


def check_vocab_compatible(target_tokenizer: Any, draft_tokenizer: Any) -> VocabReport:
    """Compare two tokenizers (PreTrainedTokenizerBase-like: get_vocab(), get_added_vocab(),
    bos/eos/pad/unk token attributes, encode). Every difference is named with examples."""
    diffs: list[str] = []
    t_vocab: dict[str, int] = target_tokenizer.get_vocab()
    d_vocab: dict[str, int] = draft_tokenizer.get_vocab()

    if len(t_vocab) != len(d_vocab):
        diffs.append(f"vocabulary size differs: target {len(t_vocab)}, draft {len(d_vocab)}")

    moved = sorted((tok for tok, i in t_vocab.items() if tok in d_vocab and d_vocab[tok] != i),
                   key=t_vocab.__getitem__)
    if moved:
        diffs.append(f"{len(moved)} tokens have different ids: " + _examples(
            [f"{tok!r} target {t_vocab[tok]} vs draft {d_vocab[tok]}" for tok in moved]))
    only_target = sorted((tok for tok in t_vocab if tok not in d_vocab), key=t_vocab.__getitem__)
    if only_target:
        diffs.append(f"{len(only_target)} tokens only in the target: " + _examples(
            [f"{tok!r} (id {t_vocab[tok]})" for tok in only_target]))
    only_draft = sorted((tok for tok in d_vocab if tok not in t_vocab), key=d_vocab.__getitem__)
    if only_draft:
        diffs.append(f"{len(only_draft)} tokens only in the draft: " + _examples(
            [f"{tok!r} (id {d_vocab[tok]})" for tok in only_draft]))

    for name in SPECIAL_TOKENS:
        t_special, d_special = _special(target_tokenizer, name), _special(draft_tokenizer, name)
        if t_special != d_special:
            diffs.append(f"{name} differs: target {t_special[0]!r} (id {t_special[1]}), "
                         f"draft {d_special[0]!r} (id {d_special[1]})")

    t_added = _added(target_tokenizer)
    d_added = _added(draft_tokenizer)
    if t_added != d_added:
        changed = sorted(set(t_added.items()) ^ set(d_added.items()), key=lambda kv: kv[1])
        diffs.append("added tokens differ: " + _examples(
            [f"{tok!r} id {i} ({'target' if t_added.get(tok) == i else 'draft'} only)" for tok, i in changed]))

    if not diffs:
        t_ids = list(target_tokenizer.encode(PROBE_TEXT, add_special_tokens=False))
        d_ids = list(draft_tokenizer.encode(PROBE_TEXT, add_special_tokens=False))
        if t_ids != d_ids:
            first = next((i for i, (a, b) in enumerate(zip(t_ids, d_ids)) if a != b), min(len(t_ids), len(d_ids)))
            diffs.append(f"same vocabulary but different tokenization (merges/normalizer) of a probe "
                         f"text: first difference at token {first}, target {t_ids[first:first + 3]} "
                         f"vs draft {d_ids[first:first + 3]}")
    return VocabReport(compatible=not diffs, differences=diffs)


def _added(tok: Any) -> dict[str, int]:
    getter = getattr(tok, "get_added_vocab", None)
    return dict(getter()) if getter is not None else {}


def require_vocab_compatible(target_tokenizer: Any, draft_tokenizer: Any, force: bool = False) -> VocabReport:
    """Raise VocabularyMismatchError naming the differences, unless ``force`` (then warn)."""
    report = check_vocab_compatible(target_tokenizer, draft_tokenizer)
    if report.compatible:
        return report
    message = (f"draft and target tokenizers are not compatible: {report.summary()}. Speculation "
               f"needs an identical vocabulary; pick a draft from the target's model family, use "
               f"--drafter ngram or self, or force_vocab_mismatch to run anyway (acceptance will be ~0)")
    if not force:
        raise VocabularyMismatchError(message)
    log.warning("forced despite vocabulary mismatch: %s", report.summary())
    return report
