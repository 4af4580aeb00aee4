"""Derive smaller models from a local Hugging Face Llama-family directory.

Owns: ``derive_truncated_draft`` — a genuine, independent draft model made from a target by
keeping its first L decoder layers plus the final norm and the (tied) LM head, written as a
normal HF directory (config.json + model.safetensors + tokenizer files), so both our draft-model
path (``--draft DIR``) and Hugging Face's ``generate(assistant_model=...)`` can load it. It shares
the target's tokenizer byte for byte (the vocabulary check passes by construction).
Ignores: training or distillation (the draft is untrained truncation: acceptance is whatever the
first L layers give), and non-Llama layouts.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from cluster.common.errors import ModelLoadError

_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_COPY = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
         "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


def derive_truncated_draft(target_dir: str | Path, num_layers: int, out_dir: str | Path) -> Path:
    """Write the first ``num_layers`` layers of ``target_dir`` (+ final norm + LM head) to
    ``out_dir`` and return it. Idempotent: an existing complete ``out_dir`` derived from the same
    target with the same depth is reused. The write is atomic (temp dir + rename)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    target = Path(target_dir)
    out = Path(out_dir)
    cfg = json.loads((target / "config.json").read_text())
    total = int(cfg.get("num_hidden_layers", 0))
    if not 1 <= num_layers < total:
        raise ModelLoadError(f"a truncated draft needs 1 <= num_layers < {total} (the target's layers), got {num_layers}")
    stamp = {"target": str(target.resolve()), "num_layers": num_layers}
    marker = out / "derived_from.json"
    if marker.is_file() and (out / "model.safetensors").is_file():
        if json.loads(marker.read_text()) == stamp:
            return out
    files = sorted(target.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{target} has no *.safetensors weights to derive a draft from")
    state = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                m = _LAYER_KEY.search(key)
                if m is not None and int(m.group(1)) >= num_layers:
                    continue
                state[key] = sf.get_tensor(key).contiguous()
    if not cfg.get("tie_word_embeddings", False) and not any(k.endswith("lm_head.weight") for k in state):
        raise ModelLoadError(f"{target}: untied model without lm_head.weight")
    cfg["num_hidden_layers"] = num_layers
    for key in ("layer_types", "max_window_layers"):  # per-layer lists must match the new depth
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:num_layers]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        for name in _COPY:
            if (target / name).is_file():
                shutil.copyfile(target / name, tmp / name)
        (tmp / "derived_from.json").write_text(json.dumps(stamp))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
