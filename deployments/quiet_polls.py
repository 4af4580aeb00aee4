"""Quiet polls: Ray Serve writes an access-log line for every handle call a replica serves; the
calls other deployments make on a timer (the Router asks each engine for ``stats`` twice a second,
the SpecEngine asks the DraftServer for its ``address``) would bury the lines for requests.

Owns: a logging filter on Serve's replica logger that drops the successful access-log lines of the
named methods. Requests are still logged, and so is a poll that fails or is cancelled.
Ignores: Serve's other logging (``logging_config`` in the Serve config sets levels and formats).
"""
from __future__ import annotations

import logging

SERVE_LOGGER = "ray.serve"


class QuietPolls(logging.Filter):
    def __init__(self, methods: tuple[str, ...]) -> None:
        super().__init__()
        self.methods = frozenset(methods)

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "serve_access_log", False):
            return True
        words = record.getMessage().split()  # "[client] CALL <method> <status> <latency>ms"
        return not any(w in self.methods and status == "OK" for w, status in zip(words, words[1:]))


def quiet_polls(*methods: str) -> None:
    """Drop this replica's successful access-log lines for ``methods`` (idempotent per set)."""
    logger = logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(f, QuietPolls) and f.methods == frozenset(methods) for f in logger.filters):
        logger.addFilter(QuietPolls(methods))
