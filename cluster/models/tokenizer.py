"""Tokenizer loading and the facts the engine needs from it (EOS ids, chat template).

Owns: loading the HF tokenizer of a model directory, the set of end-of-sequence ids (tokenizer
and generation config), chat-template application, and the token ids of a prompt row
(``cluster.common.prompt_rows``). Ignores: incremental detokenization.
"""
from __future__ import annotations

import json
from pathlib import Path

from cluster.common.errors import InvalidRequestError


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def eos_token_ids(tokenizer, model_dir: Path) -> frozenset[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


def chat_token_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat with the assistant generation prompt appended."""
    if not messages:
        raise InvalidRequestError("messages must not be empty")
    for m in messages:
        if not isinstance(m, dict) or set(m) - {"role", "content"} or "role" not in m or "content" not in m:
            raise InvalidRequestError(f"each message needs exactly 'role' and 'content', got {m!r}")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise InvalidRequestError(f"unknown message role {m['role']!r}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("this model has no chat template; send a plain prompt")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def row_token_ids(tokenizer, row: dict) -> list[int]:
    """A row's ids where it may carry ``messages`` (``specserve map``'s traffic, ``train-draft
    --prompts``, files of outputs): the chat of its messages, else ``prompt_token_ids``."""
    if "messages" in row:
        return chat_token_ids(tokenizer, row["messages"])
    return prompt_token_ids(tokenizer, row)


def prompt_token_ids(tokenizer, row: dict) -> list[int]:
    """A prompt row's ids: its prompt wrapped in the chat template when ``chat`` is set."""
    if row.get("chat"):
        return chat_token_ids(tokenizer, [{"role": "user", "content": row["prompt"]}])
    return [int(t) for t in tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]]
