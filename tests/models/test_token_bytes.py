"""The bytes each token id stands for: exact for the default model's byte-level BPE (an output's
token bytes spell its UTF-8 text, characters split across tokens included), and for a
SentencePiece vocabulary's byte tokens and word-boundary marks."""
from __future__ import annotations

from cluster.models.token_bytes import TokenBytes, byte_level_alphabet
from tests.reference import workload_rows


def test_the_byte_level_alphabet_covers_every_byte_once():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256)) and alphabet["A"] == ord("A") and alphabet["Ġ"] == 32


def test_token_bytes_spell_the_text_of_the_default_tokenizer(default_model):
    tok = default_model.tokenizer
    tb = TokenBytes(tok)
    texts = ["héllo 日本 🙂\tdef f(x):\n    return x", *[r["prompt"] for r in workload_rows(per_segment=1)]]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert b"".join(tb(i) for i in ids) == text.encode("utf-8")
    split = [tb(i) for i in tok("日", add_special_tokens=False)["input_ids"]]
    assert len(split) > 1 and b"".join(split) == "日".encode()  # a character over several tokens
    assert tb(tok.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"  # a special token is its text


class _SentencePiece:
    """A SentencePiece-style vocabulary: ▁ marks a space, <0xNN> a lone byte."""

    all_special_tokens = ["</s>"]
    pieces = {0: "</s>", 1: "▁hello", 2: "<0xE6>", 3: "é"}

    def convert_ids_to_tokens(self, i):
        return self.pieces.get(i)


def test_token_bytes_of_a_sentencepiece_vocabulary():
    tb = TokenBytes(_SentencePiece())
    assert [tb(i) for i in range(4)] == [b"</s>", b" hello", b"\xe6", "é".encode()]
    assert tb(99) == b""  # outside the vocabulary
