"""Where metric instruments live: Ray Serve metrics inside Ray, prometheus_client elsewhere.

Owns: a uniform ``inc / set / observe(value, tags)`` surface over two backends:

- ``RayBackend``: ``ray.serve.metrics`` (inside a replica: ``deployment``/``replica``/``application``
  tags added automatically) or ``ray.util.metrics`` (other Ray workers). Scraped from Ray's
  Prometheus endpoint on every node (``ray start --metrics-export-port``), names prefixed
  ``ray_`` by Ray, counters suffixed ``_total``.
- ``PrometheusBackend``: a private ``prometheus_client.CollectorRegistry``; ``serve(port)`` starts
  a real HTTP ``/metrics`` endpoint (CLI runs without Ray, tests); counters get ``_total``.

``backend="auto"`` picks Ray when this process is a connected Ray worker, else Prometheus.
Ignores: which metrics exist (``metrics``). Ray is imported only when it is already loaded.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence


class _PromInstrument:
    __slots__ = ("_metric", "_labelled")

    def __init__(self, metric: Any, labelled: bool) -> None:
        self._metric = metric
        self._labelled = labelled

    def _child(self, tags: dict[str, str] | None) -> Any:
        return self._metric.labels(**tags) if self._labelled else self._metric

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        if value > 0:
            self._child(tags).inc(value)

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._child(tags).set(value)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._child(tags).observe(value)


class PrometheusBackend:
    name = "prometheus"

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=True)
        self._server: Any = None
        self._thread: Any = None

    def counter(self, name: str, doc: str, labels: Sequence[str]) -> _PromInstrument:
        from prometheus_client import Counter

        return _PromInstrument(Counter(name, doc, list(labels), registry=self.registry), bool(labels))

    def gauge(self, name: str, doc: str, labels: Sequence[str]) -> _PromInstrument:
        from prometheus_client import Gauge

        return _PromInstrument(Gauge(name, doc, list(labels), registry=self.registry), bool(labels))

    def histogram(self, name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]) -> _PromInstrument:
        from prometheus_client import Histogram

        return _PromInstrument(Histogram(name, doc, list(labels), buckets=list(buckets), registry=self.registry),
                               bool(labels))

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Start ``/metrics`` over HTTP (port 0: a free port); returns the bound port."""
        from prometheus_client import start_http_server

        if self._server is None:
            self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        return self._server.server_address[1]

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = self._thread = None

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class _RayInstrument:
    __slots__ = ("_metric",)

    def __init__(self, metric: Any) -> None:
        self._metric = metric

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        if value > 0:  # Ray rejects non-positive increments
            self._metric.inc(value, tags=tags)

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._metric.set(value, tags=tags)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._metric.observe(value, tags=tags)


class RayBackend:
    name = "ray"

    def __init__(self) -> None:
        from ray.serve import context as serve_context

        if serve_context._get_internal_replica_context() is not None:
            from ray.serve import metrics as m
        else:
            from ray.util import metrics as m
        self._m = m

    def counter(self, name: str, doc: str, labels: Sequence[str]) -> _RayInstrument:
        return _RayInstrument(self._m.Counter(name, description=doc, tag_keys=tuple(labels)))

    def gauge(self, name: str, doc: str, labels: Sequence[str]) -> _RayInstrument:
        return _RayInstrument(self._m.Gauge(name, description=doc, tag_keys=tuple(labels)))

    def histogram(self, name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]) -> _RayInstrument:
        return _RayInstrument(self._m.Histogram(name, description=doc, boundaries=list(buckets),
                                                tag_keys=tuple(labels)))


def in_ray_worker() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def make_backend(kind: str = "auto") -> PrometheusBackend | RayBackend:
    if kind not in ("auto", "ray", "prometheus"):
        raise ValueError(f"metrics backend must be auto, ray or prometheus, got {kind!r}")
    if kind == "ray" or (kind == "auto" and in_ray_worker()):
        return RayBackend()
    return PrometheusBackend()
