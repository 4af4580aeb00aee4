"""Errors that reach a user as one clear line (CLI) or a status message (service)."""
from __future__ import annotations

from cluster.engine.request import InvalidRequestError


class UserFacingError(Exception):
    """Base for errors whose message is the whole story (no traceback needed)."""


class ModelLoadError(UserFacingError):
    """A model spec that cannot be resolved or loaded (missing, malformed, unsupported)."""


class VocabularyMismatchError(UserFacingError):
    """Draft and target tokenizers differ; the message names the differences."""


def is_user_facing(exc: BaseException) -> bool:
    return isinstance(exc, (UserFacingError, InvalidRequestError))
