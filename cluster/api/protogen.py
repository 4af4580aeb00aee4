"""Generate Python gRPC stubs from ``protos/`` into ``cluster/api/gen/`` (gitignored).

Owns: running ``grpc_tools.protoc`` and rewriting the generated absolute imports
(``from specserve.v1 import ...``) so the modules import as
``cluster.api.gen.specserve.v1.generation_pb2``. Generation goes to a temporary directory that is
renamed into place under a file lock, so several processes (Serve proxy, replicas) racing on a
fresh install never see half-written stubs. Ignores: loading the stubs (``cluster.api.stubs``).

Run: ``python -m cluster.api.protogen`` (``make protos``).
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
GEN_DIR = PACKAGE_DIR / "gen"
# protos/ sits at the repository root (editable installs and checkouts).
PROTO_ROOT = Path(os.environ.get("SPECSERVE_PROTO_ROOT", PACKAGE_DIR.parents[1] / "protos"))
PROTO_FILES = ("specserve/v1/generation.proto", "specserve/v1/kvsync.proto")
GEN_PACKAGE = "cluster.api.gen"

_IMPORT_RE = re.compile(r"^from specserve\.v1 import ", re.MULTILINE)
# The module name baked into generated message classes (``__module__``): pickling a message (Ray
# Serve's proxy pickles the request) must find it under the package path.
_MODULE_RE = re.compile(r"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, )'specserve\.v1\.")


def stubs_present(gen_dir: Path = GEN_DIR) -> bool:
    base = gen_dir / "specserve" / "v1"
    return all((base / f"{Path(p).stem}_pb2{suffix}.py").exists()
               for p in PROTO_FILES for suffix in ("", "_grpc"))


def _fix_imports(path: Path) -> None:
    text = path.read_text()
    fixed = _IMPORT_RE.sub(f"from {GEN_PACKAGE}.specserve.v1 import ", text)
    fixed = _MODULE_RE.sub(rf"\1'{GEN_PACKAGE}.specserve.v1.", fixed)
    if fixed != text:
        path.write_text(fixed)


def generate(gen_dir: Path = GEN_DIR, proto_root: Path = PROTO_ROOT, force: bool = True) -> Path:
    """Generate the stubs; returns the gen directory. ``force=False`` keeps existing stubs."""
    from grpc_tools import protoc  # build-time dependency (grpcio-tools)
    import grpc_tools

    gen_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = gen_dir.parent / ".protogen.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and stubs_present(gen_dir):
            return gen_dir
        missing = [p for p in PROTO_FILES if not (proto_root / p).exists()]
        if missing:
            raise FileNotFoundError(f"proto sources not found under {proto_root}: {missing}")
        tmp = Path(tempfile.mkdtemp(prefix=".gen-", dir=gen_dir.parent))
        try:
            well_known = Path(grpc_tools.__file__).parent / "_proto"
            args = ["grpc_tools.protoc", f"-I{proto_root}", f"-I{well_known}",
                    f"--python_out={tmp}", f"--grpc_python_out={tmp}", f"--pyi_out={tmp}",
                    *PROTO_FILES]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed for {PROTO_FILES} under {proto_root}")
            for d in (tmp, tmp / "specserve", tmp / "specserve" / "v1"):
                (d / "__init__.py").touch()
            for py in (tmp / "specserve" / "v1").glob("*.py*"):
                _fix_imports(py)
            if gen_dir.exists():
                shutil.rmtree(gen_dir)
            os.replace(tmp, gen_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return gen_dir


def main() -> int:
    out = generate()
    print(f"generated gRPC stubs for {', '.join(PROTO_FILES)} in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
