"""The bytes each token id stands for: what a token's log-probability is reported with.

Owns: id -> bytes for a Hugging Face tokenizer, exact where a token is part of a UTF-8 character
(a byte-level BPE's tokens are bytes mapped to printable characters; a SentencePiece vocabulary
spells a lone byte ``<0xNN>`` and a space ``▁``), memoised per id. Special tokens are their text.
Ignores: decoding text (``cluster.engine.detokenizer``): the concatenation of an output's token
bytes is its UTF-8 text only up to what decoding normalises (skipped special tokens).
"""
from __future__ import annotations

import json
import re

_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet's character -> the byte it stands for: printable Latin-1 bytes
    stand for themselves, the other 68 bytes for the code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 256
    for b in range(256):
        if b not in chars:
            chars[b] = extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def _decoder_types(tokenizer) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    found = {decoder.get("type", "")}
    found.update(d.get("type", "") for d in decoder.get("decoders", []) or [])
    return found


class TokenBytes:
    """``token_bytes(id) -> bytes`` for one tokenizer (ids outside the vocabulary: b"")."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_level = "ByteLevel" in _decoder_types(tokenizer)
        self._alphabet = byte_level_alphabet() if self._byte_level else {}
        self._special = set(getattr(tokenizer, "all_special_tokens", ()) or ())
        self._memo: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        got = self._memo.get(token_id)
        if got is None:
            got = self._memo[token_id] = self._bytes(token_id)
        return got

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if piece is None:
            return b""
        if piece in self._special:
            return piece.encode("utf-8")
        if self._byte_level:
            return b"".join(bytes([self._alphabet[c]]) if c in self._alphabet else c.encode("utf-8") for c in piece)
        m = _SP_BYTE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")
