"""Draft-head formats: which one a directory holds, and loading it as our ``EagleHead``.

Owns: ``HeadFormat`` (ours: ``eagle_config.json`` + ``eagle_head.safetensors``, what
``train-draft`` writes; ``speculators``: vLLM's; ``eagle3``: the original EAGLE-3 / SpecForge
layout, what SGLang reads), ``detect_format`` (from the files and the config's own keys, never from
the directory's name) and ``load_any_head`` (``--draft eagle:DIR``: the head in DIR for a loaded
target, refused with ``EagleTargetMismatch`` naming the field when it was made for another target,
``HeadFormatError`` when the config is malformed or tensors are missing or left over).
Ignores: each format's details (one module per format: ``speculators``, ``eagle3``; ours is
``cluster.speculative.eagle_head``), drafting (``cluster.speculative.eagle``).
"""
from __future__ import annotations

import enum
from pathlib import Path

from cluster.speculative.eagle_head import CONFIG_FILE, EagleHead, load_head
from cluster.speculative.head_formats.common import HeadFormatError, read_json


class HeadFormat(str, enum.Enum):
    SPECSERVE = "specserve"
    SPECULATORS = "speculators"
    EAGLE3 = "eagle3"


def detect_format(head_dir: Path) -> HeadFormat:
    from cluster.speculative.head_formats.eagle3 import is_eagle3_config
    from cluster.speculative.head_formats.speculators import is_speculators_config

    head_dir = Path(head_dir)
    if not head_dir.is_dir():
        raise HeadFormatError(f"{head_dir} is not a directory")
    if (head_dir / CONFIG_FILE).is_file():
        return HeadFormat.SPECSERVE
    if not (head_dir / "config.json").is_file():
        raise HeadFormatError(f"{head_dir} is not an EAGLE head directory (neither {CONFIG_FILE} nor config.json); "
                              "make one with `specserve train-draft`")
    cfg = read_json(head_dir / "config.json")
    if is_speculators_config(cfg):
        return HeadFormat.SPECULATORS
    if is_eagle3_config(cfg):
        return HeadFormat.EAGLE3
    raise HeadFormatError(f"{head_dir}/config.json is neither a speculators head (speculators_model_type) nor an "
                          "EAGLE-3 / SpecForge head (draft_vocab_size, or an *Eagle3 architecture)")


def load_any_head(head_dir, target) -> EagleHead:
    """The head in ``head_dir`` for ``target`` (a loaded ``LlamaModel``), whatever its format."""
    head_dir = Path(head_dir)
    fmt = detect_format(head_dir)
    if fmt is HeadFormat.SPECSERVE:
        return load_head(head_dir, target)
    if fmt is HeadFormat.SPECULATORS:
        from cluster.speculative.head_formats.speculators import read_speculators_head

        return read_speculators_head(head_dir, target)
    from cluster.speculative.head_formats.eagle3 import read_eagle3_head

    return read_eagle3_head(head_dir, target)
