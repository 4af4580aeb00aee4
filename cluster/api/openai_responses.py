"""OpenAI response bodies and Server-Sent Event chunks from engine outputs + the route decision.

Owns: ``chat.completion`` / ``text_completion`` bodies (unary), their ``*.chunk`` stream events
(``data: {json}`` lines, the last ``data: [DONE]``; with ``stream_options.include_usage`` every
chunk carries ``"usage": null`` and one more chunk with empty ``choices`` carries the usage), the
finish-reason mapping (EOS and stop strings are OpenAI's ``stop``, the token budget ``length``),
the choice's ``logprobs`` when asked (chat's ``content`` entries, the completion's legacy
tokens / token_logprobs / top_logprobs / text_offset), a completion's ``echo`` (each choice's text
and logprobs begin with its prompt's; the first token has no log-probability: null), a completion's
batch of prompts (choice ``i * n + j`` is prompt i's choice j, as OpenAI's), ``n`` choices (each with its ``index``;
streamed, each event carries one choice's delta; usage counts the prompt once and every choice's
tokens) and the ``specserve`` object every response carries: the route (path, reason), the ids (the
server's and the client's label) and, once finished, the speculation counters (draft and accepted
tokens, α, mean acceptance length). Ignores: transport, errors (``openai_errors``).
"""
from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.common.request import FinishReason, Logprob, RequestOutput, SpecStats, TokenLogprobs
from cluster.routing.policy import RouteDecision

if TYPE_CHECKING:
    from cluster.api.openai_tools import CallStream, ToolPlan
    from cluster.api.responses import Accumulator

_FINISH = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop", FinishReason.EOS: "stop",
           FinishReason.CANCELLED: "abort"}  # ERROR never reaches a body: it is an error response
DONE = "data: [DONE]\n\n"


class Kind(enum.Enum):
    CHAT = "chat.completion"
    COMPLETION = "text_completion"

    @property
    def id_prefix(self) -> str:
        return "chatcmpl-" if self is Kind.CHAT else "cmpl-"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self is Kind.CHAT else "text_completion"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def spec_dict(spec: SpecStats | None) -> dict | None:
    if spec is None:
        return None
    return {"drafts": spec.drafts, "draft_tokens": spec.draft_tokens, "accepted_tokens": spec.accepted_tokens,
            "rejections": spec.rejections, "alpha": spec.alpha, "acceptance_rate": spec.acceptance_rate,
            "mean_acceptance_length": spec.mean_acceptance_length}


def usage_dict(final: RequestOutput, completion_tokens: int) -> dict:
    """OpenAI's usage; with a prediction, its ``completion_tokens_details`` too."""
    prompt_tokens = final.num_prompt_tokens
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens,
             "prompt_tokens_details": {"cached_tokens": final.num_cached_tokens}}  # from the prefix cache
    if final.accepted_prediction_tokens or final.rejected_prediction_tokens:
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": final.accepted_prediction_tokens,
                                              "rejected_prediction_tokens": final.rejected_prediction_tokens}
    return usage


def _token(lp: Logprob) -> str:
    """A token's text as OpenAI shows it; its ``bytes`` are exact where a token is part of a
    UTF-8 character (the text then has U+FFFD)."""
    return lp.token.decode("utf-8", errors="replace")


def _chat_entry(lp: Logprob) -> dict:
    return {"token": _token(lp), "logprob": lp.logprob, "bytes": list(lp.token)}


def logprob_entries(logprobs: list[TokenLogprobs]) -> list[dict]:
    """One entry per token with its ``top_logprobs``: a chat choice's ``logprobs.content``, a
    Responses ``output_text``'s ``logprobs``."""
    return [{**_chat_entry(t.chosen), "top_logprobs": [_chat_entry(a) for a in t.top]} for t in logprobs]


def answer_logprobs(logprobs: list[TokenLogprobs], last: RequestOutput | None) -> list[TokenLogprobs]:
    """The entries of an answer's text: ``last``, the final output when these are its last tokens —
    an end-of-turn token that ended the answer ends no text, so it has none."""
    if last is not None and last.finish_reason is FinishReason.EOS and logprobs:
        return logprobs[:-1]
    return logprobs


def chat_logprobs(logprobs: list[TokenLogprobs]) -> dict:
    """A chat choice's ``logprobs``: ``content``, one entry per token with its ``top_logprobs``."""
    return {"content": logprob_entries(logprobs), "refusal": None}


def completion_logprobs(logprobs: list[TokenLogprobs], offset: int) -> dict:
    """A completion choice's ``logprobs`` (the legacy shape): tokens, their log-probabilities, each
    position's most likely tokens with the chosen one among them (up to n + 1, as OpenAI), and each
    token's character offset in the completion's text from ``offset`` on."""
    tokens = [_token(t.chosen) for t in logprobs]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": [t.chosen.logprob for t in logprobs],
            "top_logprobs": [None if t.chosen.logprob is None else {_token(a): a.logprob for a in (*t.top, t.chosen)}
                             for t in logprobs],  # a prompt's first token has neither (echo)
            "text_offset": offsets}


def spelled(entries: list[TokenLogprobs]) -> str:
    """The text of tokens from their entries' bytes (an echoed prompt sent as token ids)."""
    return b"".join(t.chosen.token for t in entries).decode("utf-8", errors="replace")


@dataclass(slots=True)
class Responder:
    """Everything one response repeats: kind, ids, model, creation time, route."""

    kind: Kind
    request_id: str  # the server's id
    label: str  # the client's x-request-id, "" when none
    model: str
    decision: RouteDecision
    include_usage: bool = False
    logprobs: bool = False  # the request asked for log-probabilities
    tools: "ToolPlan | None" = None  # the output is a tool call (``cluster.api.openai_tools``)
    # a completion's echo: each choice's text (and logprobs) start with its prompt's — per prompt of
    # the batch, this text, or for a prompt of token ids ("") the text its entries spell
    # (``openai_schemas.echoed_prompts``); choices are prompt-major, ``per_prompt`` to a prompt
    echo: tuple[str, ...] | None = None
    per_prompt: int = 1
    created: int = field(default_factory=lambda: int(time.time()))
    # a streamed completion's characters so far, per choice (its logprobs' text_offset)
    _text_offset: dict[int, int] = field(default_factory=dict)
    _calls: "dict[int, CallStream]" = field(default_factory=dict)  # a streamed choice's calls (not named)

    @property
    def id(self) -> str:
        return self.kind.id_prefix + self.request_id

    def specserve(self, final: RequestOutput | None) -> dict:
        d = {"route": {"path": self.decision.path.value, "reason": self.decision.reason.value},
             "request_id": self.request_id}
        if self.label:
            d["label"] = self.label
        if final is not None:
            d["spec"] = spec_dict(final.spec)
        return d

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _echoed(self, prompt: list[TokenLogprobs], index: int) -> str:
        """The prompt text choice ``index`` starts with (echo; "" without it); its output's
        text_offset starts after it."""
        if self.echo is None:
            return ""
        text = self.echo[index // self.per_prompt] or spelled(prompt)
        self._text_offset[index] = len(text)
        return text

    def _logprobs(self, logprobs: list[TokenLogprobs], last: RequestOutput | None, index: int,
                  prompt: list[TokenLogprobs] = ()) -> dict | None:
        """Choice ``index``'s ``logprobs`` (None when not asked); ``last``: the final output when
        these are its last tokens — a chat's end-of-turn token ends no text, so it has no entry (a
        completion's legacy logprobs keep it, as OpenAI's and vLLM's do: an evaluation harness
        that asks for one token past an echoed prompt drops the last entry, whatever it is);
        ``prompt``: an echoed prompt's entries, first (their offsets from 0)."""
        if not self.logprobs:
            return None
        if self.kind is Kind.CHAT:
            return chat_logprobs(answer_logprobs(logprobs, last))
        offset = self._text_offset.get(index, 0)
        body = completion_logprobs(logprobs, offset)
        self._text_offset[index] = offset + sum(map(len, body["tokens"]))
        if self.echo is not None and prompt:
            head = completion_logprobs(list(prompt), 0)
            body = {key: head[key] + body[key] for key in body}
        return body

    def _choice(self, index: int, text: str, finish: str | None, delta: bool, first: bool = False,
                logprobs: dict | None = None) -> dict:
        if self.kind is Kind.COMPLETION:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if self.tools is not None:
            return self._tool_choice(index, text, finish, delta, first, logprobs)
        if not delta:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": finish}
        body = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish}

    def _tool_choice(self, index: int, text: str, finish: str | None, delta: bool, first: bool,
                     logprobs: dict | None) -> dict:
        """A chat choice of a request with tools: ``message.tool_calls`` and content (or, streamed,
        a named function's arguments as they come; other calls each once whole — the name is known
        only then — and an answer as it comes once it cannot be a call)."""
        from cluster.api.openai_tools import CallStream

        plan, call_id = self.tools, f"call_{self.request_id}_{index}"
        if not delta:
            content, calls = plan.message(text, call_id)
            message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            return {"index": index, "message": message, "logprobs": logprobs,
                    "finish_reason": plan.finish_reason(finish, bool(calls))}
        body: dict = {"role": "assistant", "content": None} if first else {}
        if plan.function is not None:
            call = ({"index": 0, "id": f"{call_id}_0", "type": "function",
                     "function": {"name": plan.function, "arguments": text}} if first
                    else {"index": 0, "function": {"arguments": text}})
            if first or text:
                body["tool_calls"] = [call]
            return {"index": index, "delta": body, "logprobs": logprobs,
                    "finish_reason": plan.finish_reason(finish, True)}
        stream = self._calls.setdefault(index, CallStream(call_id))
        content, calls = stream.feed(text, finish is not None)
        if content:
            body["content"] = content
        if calls:
            body["tool_calls"] = [{"index": stream.calls - len(calls) + k, **c} for k, c in enumerate(calls)]
        return {"index": index, "delta": body, "logprobs": logprobs,
                "finish_reason": plan.finish_reason(finish, stream.calls > 0)}

    # -- unary -----------------------------------------------------------------------------
    def body(self, choices: "list[Accumulator]", final: RequestOutput, completion_tokens: int | None = None) -> dict:
        """The whole response: one choice per accumulated request, in order; ``final`` stands for
        all of them (``deployments.openai_choices.combined_final``: usage and counters);
        ``completion_tokens``: every candidate's where more ran than are answered (best_of)."""
        out = []
        for i, a in enumerate(choices):
            text = self._echoed(a.prompt_logprobs, i) + "".join(a.text)
            out.append(self._choice(i, text, _FINISH.get(a.final.finish_reason), delta=False,
                                    logprobs=self._logprobs(a.logprobs, a.final, i, a.prompt_logprobs)))
        return {**self._head(self.kind.value), "choices": out,
                "usage": usage_dict(final, sum(len(a.token_ids) for a in choices)
                                    if completion_tokens is None else completion_tokens),
                "specserve": self.specserve(final)}

    # -- stream ----------------------------------------------------------------------------
    def chunk(self, out: RequestOutput, first: bool, index: int = 0) -> str | None:
        """One engine delta of choice ``index`` as one event (None: nothing to say yet — a tool
        call's text is held until it is whole); the route rides on each choice's
        first, its counters on its last."""
        finish = _FINISH.get(out.finish_reason) if out.finished else None
        echoed = self._echoed(out.prompt_logprobs, index) if first else ""
        logprobs = self._logprobs(out.logprobs, out if out.finished else None, index,
                                  out.prompt_logprobs if first else ())
        choice = self._choice(index, echoed + out.text_delta, finish, delta=True, first=first, logprobs=logprobs)
        if self.tools is not None and not (first or out.finished or choice["delta"] or logprobs):
            return None
        obj = {**self._head(self.kind.chunk_object), "choices": [choice]}
        if self.include_usage:
            obj["usage"] = None
        if first or out.finished:
            obj["specserve"] = self.specserve(out if out.finished else None)
        return sse(obj)

    def usage_chunk(self, final: RequestOutput, completion_tokens: int) -> str:
        return sse({**self._head(self.kind.chunk_object), "choices": [],
                    "usage": usage_dict(final, completion_tokens)})
