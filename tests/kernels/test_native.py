"""The native kernels' builder: one library from every source, rebuilt when a source changes, and
an off switch that turns every kernel off (torch's operators then)."""
import os
import subprocess
import sys

import pytest

from cluster.kernels import native


def test_the_library_is_named_by_every_source():
    names = {s.name for s in native.SOURCES}
    assert names == {"skinny_gemm.cpp", "rms_norm.cpp", "rope_cache.cpp", "paged_attention.cpp"}
    assert all(s.exists() for s in native.SOURCES)
    assert native.library_path().name.startswith("specserve_kernels-")


def test_the_off_switch_turns_every_kernel_off():
    code = ("from cluster.kernels import native, rms_norm, paged_attention; import torch;"
            "x = torch.randn(2, 8); print(native.available(), native.unavailable_reason(),"
            " rms_norm.applies(x, torch.ones(8)), paged_attention.applies(torch.randn(1, 2, 8), torch.randn(4, 2, 8)))")
    for var in native.OFF_SWITCHES:
        env = {k: v for k, v in os.environ.items() if k not in native.OFF_SWITCHES} | {var: "torch"}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["False", f"{var}=torch", "False", "False"]


def test_torch_row_ops_switches_the_row_kernels_off_for_a_while():
    import torch

    from cluster.kernels import paged_attention, rms_norm, rope_cache

    if not native.available():
        pytest.skip(f"native kernels unavailable here ({native.unavailable_reason()}): nothing to switch")
    x, w = torch.randn(2, 8), torch.ones(8)
    q, kc = torch.randn(1, 2, 8), torch.randn(4, 2, 8)
    assert native.row_ops() and rms_norm.applies(x, w) and paged_attention.applies(q, kc) and rope_cache.applies(x, kc)
    with native.torch_row_ops():
        with native.torch_row_ops():  # nests
            assert not native.row_ops()
        assert not (rms_norm.applies(x, w) or paged_attention.applies(q, kc) or rope_cache.applies(x, kc))
    assert native.row_ops() and rms_norm.applies(x, w)


def test_a_wheel_carries_every_file_the_build_reads():
    """Installed from a wheel (not editable), the kernels build from the package's own files."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["cluster"]
    for f in native.SOURCES + native.HEADERS:
        rel = f.relative_to(root / "cluster").as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), f"{rel} is not in cluster's package-data"
    assert {f.name for f in (root / "cluster" / "kernels").glob("*.[ch]*") if f.suffix in (".cpp", ".h")} == \
        {f.name for f in native.SOURCES + native.HEADERS}, "a kernel file the builder does not compile"
