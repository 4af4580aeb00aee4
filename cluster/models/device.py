"""Which torch device a model runs on, from what an operator typed.

Owns: the names accepted (``auto``, ``cpu``, ``cuda``, ``cuda:N``), what ``auto`` means (the first
CUDA device where torch sees one, else the CPU), and refusing a device this machine does not have
with a message that says what it has.
Ignores: moving tensors (``cluster.models.llama`` places the weights and KV storage, the runner its
batches) and which commands offer a device (``specserve train-draft``).
"""
from __future__ import annotations

import torch

from cluster.common.errors import InvalidRequestError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def resolve_device(name: str) -> torch.device:
    """``auto`` -> ``cuda:0`` where torch sees a CUDA device, else ``cpu``; ``cpu``, ``cuda``,
    ``cuda:N`` -> that device, refused where it is not present."""
    name = name.strip().lower()
    if name == "auto":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InvalidRequestError(f"device {name!r} is not one of {DEVICE_CHOICES}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise InvalidRequestError(f"device {name!r} is not one of {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        raise InvalidRequestError(f"device {name!r}: torch sees no CUDA device on this machine "
                                  f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                                  "use --device cpu or auto")
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise InvalidRequestError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)
