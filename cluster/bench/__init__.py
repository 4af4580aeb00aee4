"""Benchmarks (the workload mapper): each prints a table and writes JSON; none is a test.

``specserve bench {decode,spec,serve}`` wires up ``decode``, ``spec`` and ``serve``; the tracing
benchmarks (``tracing_hooks``, ``tracing_service``) run as ``.venv/bin/python -m cluster.bench.<name>``
from the repository root, because they reuse helpers of the test tree (an OTLP receiver, the Serve
app harness) that are not installed with the package."""
from __future__ import annotations


def from_test_tree(module: str, name: str, bench: str):
    """``name`` from the test-tree ``module``; a clear exit naming how to run ``bench`` (its module)
    when the test tree is not importable (not run from the repository root)."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if not (exc.name and f"{module}.".startswith(f"{exc.name}.")):
            raise  # something the helper itself imports is missing: not a wrong directory
        raise SystemExit(f"{module} not found: run from the repository root, "
                         f"e.g. .venv/bin/python -m {bench}") from None
