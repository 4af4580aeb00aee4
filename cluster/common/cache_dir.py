"""Where specserve keeps what it builds once per machine: converted models, derived drafts and
compiled kernels (``$SPECSERVE_CACHE``, default ``~/.cache/specserve``).

Owns: the cache root. Ignores: what goes under it (``cluster.models.loader``,
``cluster.kernels.native``, ``cluster.bench``).
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE", Path.home() / ".cache" / "specserve"))
