"""OpenAI's Responses API output: the ``response`` object and, streamed, its typed events.

Owns: turning one engine request's outputs into a Responses ``response`` — ``output`` items (a
``message`` with one ``output_text`` part; ``function_call`` items, one per call, from the same
tool plan the chat endpoint decodes under: ``cluster.api.openai_tools``), ``status``
(``completed``; ``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens`` when the
budget ended it), the answer's ``logprobs`` when ``include`` asks for them (every token's entry
with its ``top_logprobs``, as the chat endpoint's; streamed, each text delta carries its
tokens'), ``usage`` (``input_tokens`` / ``output_tokens`` / ``total_tokens``), the request's
settings echoed, and the ``specserve`` extension (route, speculation counters) — and, streamed
(``ResponseEvents``), OpenAI's event sequence: ``response.created``, ``response.in_progress``, per
item ``response.output_item.added`` … ``response.output_item.done`` (text as
``response.output_text.delta`` once it cannot be a call; a named function's arguments as
``response.function_call_arguments.delta``; other calls whole), then ``response.completed`` or
``response.incomplete`` with the whole response; every event numbered (``sequence_number``).
Ignores: the request's validation (``cluster.api.responses_api``), storing, transport.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.api.openai_responses import answer_logprobs, logprob_entries, spec_dict
from cluster.common.request import FinishReason, RequestOutput, TokenLogprobs
from cluster.routing.policy import RouteDecision

if TYPE_CHECKING:
    from cluster.api.openai_tools import ToolPlan
    from cluster.api.responses_api import ResponseRequest


def event(obj: dict) -> str:
    """One Server-Sent Event of the Responses stream (its ``event:`` line names the type)."""
    return f"event: {obj['type']}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n"


@dataclass(slots=True)
class ResponseShape:
    """What every response of one request repeats: ids, the request's settings, the route."""

    request_id: str
    body: "ResponseRequest"
    model: str
    decision: RouteDecision
    tools: "ToolPlan | None"
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return f"resp_{self.request_id}"

    @property
    def call_id(self) -> str:
        return f"call_{self.request_id}_0"

    def message_item(self, text: str, status: str, logprobs: list[dict] | None = None) -> dict:
        """The answer's message; ``logprobs``: its text's entries (``include`` asked for them)."""
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
        return {"type": "message", "id": f"msg_{self.request_id}", "status": status, "role": "assistant",
                "content": [part] if text or status != "in_progress" else []}

    def call_item(self, k: int, call: dict, status: str) -> dict:
        return {"type": "function_call", "id": f"fc_{self.request_id}_{k}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}

    def output(self, text: str, finish: FinishReason | None, logprobs: list[dict] | None = None) -> list[dict]:
        """The output items of a whole output ``text``: an answer's message (with its ``logprobs``
        entries), or the calls (then what followed them, a call cut short, as a message)."""
        status = "incomplete" if finish is FinishReason.LENGTH else "completed"
        if self.tools is None:
            return [self.message_item(text, status, logprobs)]
        content, calls = self.tools.message(text, self.call_id)
        items = [self.call_item(k, c, status) for k, c in enumerate(calls)]
        if content or not calls:
            items.append(self.message_item(content or "", status))
        return items

    def response(self, status: str, output: list[dict], final: RequestOutput | None) -> dict:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else {"type": "text"}
        tools = [t.model_dump(exclude_none=True) for t in b.tools or ()]
        choice = b.tool_choice.model_dump() if hasattr(b.tool_choice, "model_dump") else (b.tool_choice or "auto")
        out = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if final is not None and final.finish_reason is FinishReason.LENGTH else None),
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": b.stored, "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": fmt}, "tool_choice": choice, "tools": tools,
            "top_p": 1.0 if b.top_p is None else b.top_p, "top_logprobs": b.top_logprobs or 0,
            "truncation": "disabled", "usage": None,
            "user": b.user, "metadata": b.metadata or {},
            "specserve": {"route": {"path": self.decision.path.value, "reason": self.decision.reason.value},
                          "request_id": self.request_id},
        }
        if final is not None:
            n = final.num_output_tokens
            out["usage"] = {"input_tokens": final.num_prompt_tokens,
                            "input_tokens_details": {"cached_tokens": final.num_cached_tokens},  # prefix cache
                            "output_tokens": n,
                            "output_tokens_details": {"reasoning_tokens": 0},  # the model does not reason
                            "total_tokens": final.num_prompt_tokens + n}
            out["specserve"]["spec"] = spec_dict(final.spec)
        return out

    def whole(self, text: str, final: RequestOutput, logprobs: list[TokenLogprobs] = ()) -> dict:
        """The unary response; ``logprobs``: every output token's (when ``include`` asked for them)."""
        status = "incomplete" if final.finish_reason is FinishReason.LENGTH else "completed"
        entries = logprob_entries(answer_logprobs(list(logprobs), final)) if self.body.wants_logprobs else None
        return self.response(status, self.output(text, final.finish_reason, entries), final)


class ResponseEvents:
    """The streamed response: ``start()``, then ``feed(out)`` per engine delta, each returning the
    events it makes (as SSE text); the last delta's events end with the whole response (then also
    ``response``, the record a stored stream keeps: what the client was sent, not a second assembly)."""

    def __init__(self, shape: ResponseShape) -> None:
        from cluster.api.openai_tools import CallStream

        self.shape = shape
        self.seq = 0
        self.items: list[dict] = []  # output items so far, in order (open ones as they stand)
        self.text = ""  # the open message's text
        self.message_at: int | None = None  # the open message's output index
        self.named_at: int | None = None  # a named function's call: its output index
        self.calls = CallStream(shape.call_id) if shape.tools is not None and shape.tools.function is None else None
        self.response: dict | None = None  # the whole response, once the last delta was fed
        self.logprobs: list[dict] = []  # the answer's entries so far (include asked for them) ...
        self.pending: list[dict] = []  # ... of which these wait for text to ride on (held-back bytes)

    def _emit(self, type_: str, **fields) -> str:
        self.seq += 1
        return event({"type": type_, "sequence_number": self.seq - 1, **fields})

    def start(self) -> list[str]:
        r = self.shape.response("in_progress", [], None)
        return [self._emit("response.created", response=r), self._emit("response.in_progress", response=r)]

    def _text(self, delta: str) -> list[str]:
        out = []
        if self.message_at is None:
            self.message_at = len(self.items)
            self.items.append(self.shape.message_item("", "in_progress"))
            item_id = self.items[-1]["id"]
            out += [self._emit("response.output_item.added", output_index=self.message_at, item=self.items[-1]),
                    self._emit("response.content_part.added", item_id=item_id, output_index=self.message_at,
                               content_index=0,
                               part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]
        self.text += delta
        riding, self.pending = self.pending, []
        self.logprobs += riding
        out.append(self._emit("response.output_text.delta", item_id=self.items[self.message_at]["id"],
                              output_index=self.message_at, content_index=0, delta=delta, logprobs=riding))
        return out

    def _call(self, call: dict, status: str) -> list[str]:
        k = sum(1 for i in self.items if i["type"] == "function_call")
        at = len(self.items)
        item = self.shape.call_item(k, call, status)
        self.items.append(item)
        opened = {**item, "arguments": "", "status": "in_progress"}
        return [self._emit("response.output_item.added", output_index=at, item=opened),
                self._emit("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                           delta=item["arguments"]),
                self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                           arguments=item["arguments"]),
                self._emit("response.output_item.done", output_index=at, item=item)]

    def feed(self, out: RequestOutput) -> list[str]:
        plan, events = self.shape.tools, []
        if plan is None:
            if self.shape.body.wants_logprobs:
                self.pending += logprob_entries(answer_logprobs(out.logprobs, out if out.finished else None))
            if out.text_delta or (out.finished and self.pending):  # the last entries ride on an empty delta
                events += self._text(out.text_delta)
        elif plan.function is not None:
            if self.named_at is None:
                self.named_at = len(self.items)
                self.items.append(self.shape.call_item(0, {"id": f"{self.shape.call_id}_0", "function": {
                    "name": plan.function, "arguments": ""}}, "in_progress"))
                events.append(self._emit("response.output_item.added", output_index=self.named_at,
                                         item=self.items[-1]))
            if out.text_delta:
                self.items[self.named_at]["arguments"] += out.text_delta
                events.append(self._emit("response.function_call_arguments.delta", item_id=self.items[self.named_at]["id"],
                                         output_index=self.named_at, delta=out.text_delta))
        else:
            content, calls = self.calls.feed(out.text_delta, out.finished)
            for call in calls:
                events += self._call(call, "incomplete" if out.finish_reason is FinishReason.LENGTH else "completed")
            if content:
                events += self._text(content)
        if out.finished:
            events += self._finish(out)
        return events

    def _finish(self, final: RequestOutput) -> list[str]:
        status = "incomplete" if final.finish_reason is FinishReason.LENGTH else "completed"
        events = []
        if self.named_at is not None:
            item = self.items[self.named_at]
            item["status"] = status
            events += [self._emit("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=self.named_at, arguments=item["arguments"]),
                       self._emit("response.output_item.done", output_index=self.named_at, item=item)]
        if self.message_at is None and not self.items:  # nothing at all was said: an empty message
            events += self._text("")
        if self.message_at is not None:
            item = self.items[self.message_at] = self.shape.message_item(self.text, status, self.logprobs)
            part = item["content"][0]
            events += [self._emit("response.output_text.done", item_id=item["id"], output_index=self.message_at,
                                  content_index=0, text=self.text, logprobs=self.logprobs),
                       self._emit("response.content_part.done", item_id=item["id"], output_index=self.message_at,
                                  content_index=0, part=part),
                       self._emit("response.output_item.done", output_index=self.message_at, item=item)]
        self.response = self.shape.response(status, self.items, final)
        events.append(self._emit(f"response.{status}", response=self.response))
        return events

    def error(self, code: str, message: str, param: str | None) -> str:
        """A failure after the stream started: OpenAI's ``error`` event (the stream then ends)."""
        return self._emit("error", code=code, message=message, param=param)
