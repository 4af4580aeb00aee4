"""Segment labels: the traffic label a client puts on a request, bounded to what the service keeps.

Owns: the label of a request or row that names none (``DEFAULT_SEGMENT``), the set of segment
labels this Router has admitted (at most ``max_segments``) and folding every further new label into
``OTHER_SEGMENT``. Why: a segment is a free-form client string
(≤ 64 characters), and everything measured per segment — the SpecEngine's α and adaptive-K
estimates, its stats that the Router polls twice a second, the Router's latency fits — would
otherwise grow by one entry per distinct label; a client labelling each request uniquely (a
request id, a user id) would grow them without bound. The first labels seen are kept (the
workload's own segments arrive first in practice); the rest share one label and one estimate.
Segments the config names (``router.segments``: settings of their own) are always kept, beside
the cap, so their settings apply whatever labels arrived first.
Ignores: validation of the label itself (``cluster.api.requests``) and the metrics' own cap
(``cluster.telemetry.metrics`` keeps a SegmentLabels of its own for its Prometheus series).
"""
from __future__ import annotations

import threading
from collections.abc import Iterable

DEFAULT_SEGMENT = "default"  # the label of a request or prompt row that names no segment
OTHER_SEGMENT = "other"  # the label every segment past the cap shares (Router and metrics alike)


class SegmentLabels:
    def __init__(self, max_segments: int, configured: Iterable[str] = ()) -> None:
        if max_segments < 1:
            raise ValueError(f"max_segments must be >= 1, got {max_segments}")
        self.max_segments = max_segments
        self.configured = frozenset(configured)  # always kept, not counted against the cap
        self._admitted: set[str] = set()
        self._lock = threading.Lock()

    def label(self, segment: str) -> str:
        """``segment`` if configured or admitted (admitting it while there is room), else
        ``OTHER_SEGMENT``."""
        if segment in self.configured:
            return segment
        with self._lock:
            if segment in self._admitted:
                return segment
            if len(self._admitted) < self.max_segments:
                self._admitted.add(segment)
                return segment
            return OTHER_SEGMENT

    def admitted(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._admitted)
