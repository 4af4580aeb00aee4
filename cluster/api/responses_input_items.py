"""A stored response's input items: ``GET /v1/responses/{id}/input_items``.

Owns: the items a Responses request sent as its ``input``, in OpenAI's shape with an ``id`` each
(``input_items``, kept with the stored response): a string input one ``user`` message; a message
item its role with ``input_text`` parts (an ``assistant`` message OpenAI's output message, with
``output_text`` parts); ``function_call`` and ``function_call_output`` items as sent. An item sent
back with its ``id`` keeps it; the others get ``msg_`` / ``fc_`` / ``fco_`` ids made of the
response's id and ``in`` with the item's place (an output item's id has no ``in``). And the page of them a
list request asks for (``item_page``):
``order`` (``desc``, OpenAI's default, or ``asc``), ``after`` (an item id: the items after it in
that order), ``limit`` (1 to 100, default 20), OpenAI's list object (``data``, ``first_id``,
``last_id``, ``has_more``). Only this response's own input is listed: a continuation's earlier
turns are the earlier responses' input items and outputs.
Ignores: storing (``deployments.response_store``), transport and auth (``deployments.responses_http``),
what the input means to the model (``cluster.api.responses_api``).
"""
from __future__ import annotations

from cluster.api.responses_api import ContentPart, ResponseRequest
from cluster.api.status import invalid

MAX_LIMIT = 100
DEFAULT_LIMIT = 20
_QUERY = ("after", "limit", "order", "include")


def _parts(content: str | list[ContentPart] | None, kind: str) -> list[dict]:
    if content is None or isinstance(content, str):
        texts = [content or ""]
    else:
        texts = [part.text or "" for part in content]
    if kind == "output_text":
        return [{"type": kind, "text": t, "annotations": []} for t in texts]
    return [{"type": kind, "text": t} for t in texts]


def input_items(body: ResponseRequest, response_id: str) -> list[dict]:
    """The body's ``input`` as OpenAI's input items, each with an id (the body was validated:
    ``chat_body`` refused what it cannot take)."""
    base = response_id.removeprefix("resp_")
    if isinstance(body.input, str):
        return [{"id": f"msg_{base}_in0", "type": "message", "role": "user", "status": "completed",
                 "content": _parts(body.input, "input_text")}]
    out = []
    for i, item in enumerate(body.input):
        if item.type == "message":
            kind = "output_text" if item.role == "assistant" else "input_text"
            out.append({"id": item.id or f"msg_{base}_in{i}", "type": "message", "role": item.role,
                        "status": "completed", "content": _parts(item.content, kind)})
        elif item.type == "function_call":
            out.append({"id": item.id or f"fc_{base}_in{i}", "type": "function_call", "status": "completed",
                        "call_id": item.call_id, "name": item.name, "arguments": item.arguments})
        else:  # function_call_output
            out.append({"id": item.id or f"fco_{base}_in{i}", "type": "function_call_output", "status": "completed",
                        "call_id": item.call_id, "output": item.output})
    return out


def item_page(items: list[dict], query: dict[str, str]) -> dict:
    """The list object a ``GET …/input_items`` with these query parameters answers; 400 for a
    parameter it does not know, a bad value, or an ``after`` that names no item."""
    unknown = sorted(set(query) - set(_QUERY))
    if unknown:
        raise invalid(f"unknown query parameter {unknown[0]!r}: input_items takes {', '.join(_QUERY)}", unknown[0])
    if query.get("include"):
        raise invalid("include is not supported (no reasoning, search or logprob items here)", "include")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid(f"order must be 'asc' or 'desc', got {order!r}", "order")
    try:
        limit = int(query.get("limit", DEFAULT_LIMIT))
    except ValueError:
        raise invalid(f"limit must be an integer in [1, {MAX_LIMIT}], got {query['limit']!r}", "limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise invalid(f"limit must be in [1, {MAX_LIMIT}], got {limit}", "limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if "after" in query:
        ids = [item["id"] for item in ordered]
        if query["after"] not in ids:
            raise invalid(f"after {query['after']!r} is not an input item of this response", "after")
        start = ids.index(query["after"]) + 1
    data = ordered[start : start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(ordered)}
