"""Errors that cross layers: bad input, an engine that cannot take or serve a request, and the
errors that reach a user as one clear line (CLI) or a status message (service).

Owns: the exception classes and which of them are user-facing. Ignores: how each front end maps
them to status codes (``cluster.api.status``, ``cluster.api.openai_errors``).
"""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """Bad user input. The message says what is wrong; the service maps it to INVALID_ARGUMENT."""


class EngineOverloadedError(RuntimeError):
    """The bounded waiting queue is full (RESOURCE_EXHAUSTED at the service)."""


class EngineUnavailableError(RuntimeError):
    """The engine cannot serve (its core process failed to start or exited): UNAVAILABLE at the
    service, so clients may retry on a replica Serve has replaced."""


class UserFacingError(Exception):
    """Base for errors whose message is the whole story (no traceback needed)."""


class ModelLoadError(UserFacingError):
    """A model source that cannot be resolved or loaded (missing, malformed, unsupported)."""


class VocabularyMismatchError(UserFacingError):
    """Draft and target tokenizers differ; the message names the differences."""


def is_user_facing(exc: BaseException) -> bool:
    return isinstance(exc, (UserFacingError, InvalidRequestError))
