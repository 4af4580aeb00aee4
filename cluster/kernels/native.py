"""Build and load specserve's native CPU kernels (the ``*.cpp`` files of this folder).

Owns: compiling the sources (``skinny_gemm.cpp``, ``rms_norm.cpp``, ``rope_cache.cpp``,
``paged_attention.cpp``; one g++ per source, side by side) against the installed torch and linking
them into one library under ``$SPECSERVE_CACHE/kernels`` (once per sources / torch / CPU
combination; concurrent builders race harmlessly through an atomic rename), loading it as
``torch.ops.specserve``, and saying whether it is usable.
``SPECSERVE_KERNELS=torch`` (or the older ``SPECSERVE_GEMM=torch``) turns it off: everything then
runs on torch's own operators; a machine without a compiler falls back the same way with one warning.
``torch_row_ops()`` switches the per-row kernels off for a while (a side-by-side measurement).
Ignores: what each kernel computes (``skinny_gemm``, ``rms_norm``, ``rope_cache``,
``paged_attention``) and who calls them (``cluster.models``).

``python -m cluster.kernels.native`` builds it ahead of time (``make setup`` does).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import torch

from cluster.common.cache_dir import cache_root

log = logging.getLogger(__name__)

HEADERS = tuple(Path(__file__).with_name(n) for n in ("vec8.h",))
SOURCES = tuple(Path(__file__).with_name(n) for n in ("skinny_gemm.cpp", "rms_norm.cpp", "rope_cache.cpp",
                                                          "paged_attention.cpp"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++20", "-shared", "-fPIC", "-w"]
OFF_SWITCHES = ("SPECSERVE_KERNELS", "SPECSERVE_GEMM")  # =torch: use torch's operators

_lock = threading.Lock()
_state: dict[str, object] = {}
_row_ops_off = 0  # > 0 inside ``torch_row_ops()``


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_path() -> Path:
    key = hashlib.sha256("\n".join([*(s.read_text() for s in SOURCES + HEADERS), torch.__version__, " ".join(FLAGS),
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"specserve_kernels-{key}.so"


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"g++ failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")


def build(target: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from torch.utils.cpp_extension import include_paths, library_paths

    target.parent.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    with tempfile.TemporaryDirectory(prefix=target.name, dir=target.parent) as tmp_dir:
        tmp = Path(tmp_dir)
        compile_flags = [*FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}"] + [f"-I{p}" for p in include_paths()]
        objects = [tmp / f"{s.stem}.o" for s in SOURCES]
        with ThreadPoolExecutor(max_workers=max(1, min(len(SOURCES), os.cpu_count() or 1))) as pool:
            list(pool.map(_run, [["g++", *compile_flags, "-c", str(s), "-o", str(o)] for s, o in zip(SOURCES, objects)]))
        lib = tmp / target.name
        _run(["g++", *FLAGS, *map(str, objects)] + [f"-L{p}" for p in library_paths()]
             + ["-lc10", "-ltorch_cpu", "-o", str(lib)])
        os.replace(lib, target)


def available() -> bool:
    """True when the ``torch.ops.specserve`` kernels can be called (built and loaded here)."""
    decided = _state.get("ok")  # asked per layer by the row kernels' ``applies``: no lock once known
    if decided is not None:
        return bool(decided)
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok = False
        off = [v for v in OFF_SWITCHES if os.environ.get(v, "auto").lower() == "torch"]
        if off:
            _state["why"] = f"{off[0]}=torch"
        else:
            try:
                path = library_path()
                if not path.exists():
                    log.info("building the native CPU kernels into %s (once)", path)
                    build(path)
                torch.ops.load_library(str(path))
                ok = True
            except Exception as exc:  # noqa: BLE001 (no compiler, no headers, odd platform: torch's operators it is)
                _state["why"] = str(exc)
                log.warning("native CPU kernels unavailable, using torch's operators: %s", exc)
        _state["ok"] = ok
        return ok


def row_ops() -> bool:
    """Whether the per-row kernels (RMSNorm, rotary + cache write, paged attention) are to be used:
    built here and not switched off by ``torch_row_ops``. The skinny GEMM is chosen per weight at
    load (``cluster.models.linear``) and is not affected."""
    return _row_ops_off == 0 and available()


@contextlib.contextmanager
def torch_row_ops() -> Iterator[None]:
    """Inside, the forward runs RMSNorm, the rotary embedding and attention on torch's operators
    (``bench decode`` times both paths side by side in one process)."""
    global _row_ops_off
    _row_ops_off += 1
    try:
        yield
    finally:
        _row_ops_off -= 1


def unavailable_reason() -> str | None:
    return None if available() else str(_state.get("why"))


def main() -> int:
    ok = available()
    print(f"native CPU kernels: {'ready at ' + str(library_path()) if ok else 'unavailable: ' + str(_state.get('why'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
