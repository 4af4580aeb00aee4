"""Build and load the skinny-GEMM CPU kernel (``skinny_gemm.cpp``).

Owns: compiling the C++ source with the machine's g++ against the installed torch into
``$SPECSERVE_CACHE/kernels`` (once per source / torch / CPU combination; concurrent builders
race harmlessly through an atomic rename), loading it as ``torch.ops.specserve``, and saying
whether it is usable. ``SPECSERVE_GEMM=torch`` turns it off (everything then runs on
``torch.matmul``); a machine without a compiler falls back the same way with one warning.
Ignores: which weights use it (``cluster.models.linear``).

``python -m cluster.kernels.skinny_gemm`` builds it ahead of time (``make setup`` does).
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from cluster.common.cache_dir import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++20", "-shared", "-fPIC", "-w"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_path() -> Path:
    key = hashlib.sha256("\n".join([SOURCE.read_text(), torch.__version__, " ".join(FLAGS),
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"skinny_gemm-{key}.so"


def build(target: Path) -> None:
    from torch.utils.cpp_extension import include_paths, library_paths

    target.parent.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    fd, tmp = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=target.parent)
    os.close(fd)
    cmd = (["g++", *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"] + [f"-I{p}" for p in include_paths()]
           + [str(SOURCE)] + [f"-L{p}" for p in library_paths()] + ["-lc10", "-ltorch_cpu", "-o", tmp])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"g++ failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def available() -> bool:
    """True when ``torch.ops.specserve.skinny_linear`` can be called (built and loaded here)."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok = False
        if os.environ.get("SPECSERVE_GEMM", "auto").lower() == "torch":
            _state["why"] = "SPECSERVE_GEMM=torch"
        else:
            try:
                path = library_path()
                if not path.exists():
                    log.info("building the skinny GEMM kernel into %s (once)", path)
                    build(path)
                torch.ops.load_library(str(path))
                ok = True
            except Exception as exc:  # no compiler, no headers, odd platform: torch.matmul it is
                _state["why"] = str(exc)
                log.warning("skinny GEMM kernel unavailable, using torch.matmul: %s", exc)
        _state["ok"] = ok
        return ok


def unavailable_reason() -> str | None:
    return None if available() else str(_state.get("why"))


def vector_width() -> int:
    """Floats per vector of the loaded build: 16 where the compiler targeted AVX-512, else 8."""
    return int(torch.ops.specserve.skinny_vector_width())


def pack(w_in_out: torch.Tensor) -> torch.Tensor:  # [K, N] -> [ceil(N/64), K, 64]
    return torch.ops.specserve.skinny_pack(w_in_out)


def linear(x: torch.Tensor, packed: torch.Tensor, n_out: int, add: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W [K, N] (+ add [M, N], a broadcast bias allowed) -> [M, N]."""
    return torch.ops.specserve.skinny_linear(x, packed, n_out, add)


def main() -> int:
    ok = available()
    print(f"skinny GEMM kernel: {'ready at ' + str(library_path()) if ok else 'unavailable: ' + str(_state.get('why'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
