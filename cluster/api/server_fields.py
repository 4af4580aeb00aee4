"""What a running server implements of ``GenerateRequest``, asked before a client relies on it.

Owns: the client's check that every field a request sets is one the server says it implements
(``ModelInfoResponse.request_fields``). A server refuses a field number its proto lacks, but one
older than that refusal (and than the list) parses past a newer client's field and ignores it —
``draft_scope`` sent to such a server would answer as if unscoped. Such a server lists nothing; it
is taken to implement the fields every released server had (``FIELDS_OF_EVERY_SERVER``) and no
other, so the client refuses to send the rest rather than have them ignored.
Ignores: transport (the caller's stub), validation of values (the server's).
"""
from __future__ import annotations

# GenerateRequest's fields since the first release; later ones (draft_scope, 15; prediction, 16;
# logprobs, 17; presence_penalty, frequency_penalty, logit_bias, 18-20; stop_token_ids, min_tokens,
# 21-22; prompt_logprobs, 23; grammar, 24; repetition_penalty, min_p, 25-26) only where listed
FIELDS_OF_EVERY_SERVER = frozenset({
    "prompt", "messages", "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed",
    "stop", "mode", "segment", "json_schema", "regex", "ignore_eos",
})


class UnsupportedField(ValueError):
    """The request sets a field the server would ignore."""


def implemented_fields(info) -> frozenset[str]:
    """A ``ModelInfoResponse``'s ``request_fields``, or the first release's fields where it lists none."""
    return frozenset(info.request_fields) or FIELDS_OF_EVERY_SERVER


def check_request_fields(request, info) -> None:
    """Raise ``UnsupportedField`` naming every field ``request`` sets (a ``GenerateRequest``) that
    the server answering ``info`` does not implement."""
    known = implemented_fields(info)
    missing = [fd.name for fd, _ in request.ListFields() if fd.name not in known]
    if missing:
        why = ("it predates ModelInfo.request_fields and ignores fields it does not know"
               if not info.request_fields else "its ModelInfo.request_fields leaves them out")
        raise UnsupportedField(f"the server does not implement {', '.join(missing)} ({why}): the "
                               f"request would be answered as if {'it were' if len(missing) == 1 else 'they were'} "
                               f"not set — upgrade the server or leave {'it' if len(missing) == 1 else 'them'} out")
