"""Vocabulary gate on real (locally trained) Hugging Face fast tokenizers."""
from __future__ import annotations

import logging

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from cluster.common.errors import VocabularyMismatchError
from cluster.speculative.vocab_check import check_vocab_compatible, require_vocab_compatible

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
ENGLISH = ["the cat sat on the mat and the dog sat on the log"] * 20 + [
    "speculative decoding drafts tokens and the target verifies them in one pass"] * 20
CODE = ["def add(a, b): return a + b", "for i in range(10): print(i)",
        "class Node: def __init__(self, value): self.value = value"] * 20


def train(corpus: list[str], vocab_size: int = 120, specials=SPECIALS, **special_kw) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        show_progress=False))
    kw = dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    kw.update(special_kw)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kw)


@pytest.fixture(scope="module")
def english():
    return train(ENGLISH)


def test_same_tokenizer_is_compatible(english, tmp_path):
    assert check_vocab_compatible(english, english).compatible
    # A copy saved and reloaded from disk (how a draft checkpoint ships its tokenizer).
    english.save_pretrained(tmp_path)
    reloaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    report = require_vocab_compatible(english, reloaded)
    assert report.compatible and report.differences == []


def test_different_training_text_is_refused_with_named_differences(english):
    code = train(CODE, vocab_size=100)
    report = check_vocab_compatible(english, code)
    assert not report.compatible
    text = report.summary()
    assert f"vocabulary size differs: target {len(english.get_vocab())}, draft {len(code.get_vocab())}" in text
    assert "tokens have different ids" in text or "tokens only in the target" in text
    assert "tokens only in the draft" in text
    # Concrete examples are named, e.g. a code-only token.
    code_only = sorted(set(code.get_vocab()) - set(english.get_vocab()), key=code.get_vocab().get)
    assert repr(code_only[0]) in text
    with pytest.raises(VocabularyMismatchError) as err:
        require_vocab_compatible(english, code)
    assert "vocabulary size differs" in str(err.value)
    assert "force_vocab_mismatch" in str(err.value)


def test_ids_moved_are_named(english):
    # Same strings, different ids: special tokens listed in another order shift every id.
    shuffled = train(ENGLISH, specials=["<pad>", "<unk>", "<s>", "</s>"])
    report = check_vocab_compatible(english, shuffled)
    assert not report.compatible
    moved = [d for d in report.differences if "tokens have different ids" in d]
    assert moved and "'<unk>' target 0 vs draft 1" in moved[0]
    assert any(d.startswith("pad_token differs") for d in report.differences)
    assert not any("vocabulary size" in d for d in report.differences)


def test_special_tokens_that_differ_are_named(english):
    other = train(ENGLISH, pad_token="</s>")
    report = check_vocab_compatible(english, other)
    assert not report.compatible
    assert report.differences == ["pad_token differs: target '<pad>' (id 3), draft '</s>' (id 2)"]


def test_added_tokens_that_differ_are_named(english):
    other = train(ENGLISH)
    other.add_tokens(["<|tool|>"])
    report = check_vocab_compatible(english, other)
    assert not report.compatible
    assert any("tokens only in the draft" in d and "<|tool|>" in d for d in report.differences)
    assert any(d.startswith("added tokens differ") and "'<|tool|>'" in d and "draft only" in d
               for d in report.differences)


def test_force_warns_instead_of_raising(english, caplog):
    code = train(CODE, vocab_size=100)
    with caplog.at_level(logging.WARNING, logger="cluster.speculative.vocab_check"):
        report = require_vocab_compatible(english, code, force=True)
    assert not report.compatible
    assert "forced despite vocabulary mismatch" in caplog.text
    assert "vocabulary size differs" in caplog.text


def test_same_vocabulary_different_merges_is_named():
    vocab = {"<unk>": 0, "t": 1, "h": 2, "e": 3, "th": 4, "he": 5}

    def build(merges):
        tok = Tokenizer(models.BPE(vocab=dict(vocab), merges=merges, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")

    th_first, he_first = build([("t", "h"), ("h", "e")]), build([("h", "e"), ("t", "h")])
    assert th_first.encode("the", add_special_tokens=False) == [4, 3]
    assert he_first.encode("the", add_special_tokens=False) == [1, 5]
    report = check_vocab_compatible(th_first, he_first)
    assert not report.compatible
    assert len(report.differences) == 1 and "different tokenization" in report.differences[0]
