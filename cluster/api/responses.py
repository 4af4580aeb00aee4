"""Response building: engine deltas + route decision -> ``GenerateResponse`` / stream chunks.

Owns: the mapping of finish reasons, route, speculation counters and log-probabilities (output and prompt) onto the proto, and the
accumulation of a stream of ``RequestOutput`` deltas into one unary response. The ``request_id``
a response carries is the one the caller passes (the client's label, else the server's id), never
the engine's. Ignores: transport.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cluster.api import stubs
from cluster.common.request import FinishReason, RequestOutput, SpecStats, TokenLogprobs
from cluster.routing.policy import Path, RouteDecision

_FINISH = {FinishReason.LENGTH: 1, FinishReason.STOP: 2, FinishReason.EOS: 3,
           FinishReason.CANCELLED: 4, FinishReason.ERROR: 5}
_PATH = {Path.SPECULATIVE: 1, Path.PLAIN: 2}


def route_pb(decision: RouteDecision):
    return stubs.generation_pb2().Route(path=_PATH[decision.path], reason=decision.reason.value)


def spec_pb(spec: SpecStats | None):
    pb2 = stubs.generation_pb2()
    if spec is None:
        return pb2.SpecStats()
    return pb2.SpecStats(drafts=spec.drafts, draft_tokens=spec.draft_tokens,
                         accepted_tokens=spec.accepted_tokens, rejections=spec.rejections, alpha=spec.alpha,
                         acceptance_rate=spec.acceptance_rate,
                         mean_acceptance_length=spec.mean_acceptance_length)


def logprobs_pb(pb2, logprobs: list[TokenLogprobs]) -> list:
    def one(lp):
        return pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, token=lp.token)

    return [pb2.OutputLogprobs(chosen=one(t.chosen), top=[one(a) for a in t.top]) for t in logprobs]


@dataclass(slots=True)
class Accumulator:
    """Collects deltas of one request; ``final`` is the last (finished) output."""

    request_id: str  # what the response echoes
    decision: RouteDecision
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    final: RequestOutput | None = None
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.text_delta)
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.logprobs)
        self.prompt_logprobs.extend(out.prompt_logprobs)
        if out.finished:
            self.final = out

    def response(self):
        pb2 = stubs.generation_pb2()
        f = self.final
        return pb2.GenerateResponse(
            text="".join(self.text), token_ids=self.token_ids,
            finish_reason=_FINISH.get(f.finish_reason, 0) if f else 0,
            usage=usage_pb(pb2, f, len(self.token_ids)),
            route=route_pb(self.decision), spec=spec_pb(f.spec if f else None),
            request_id=self.request_id, logprobs=logprobs_pb(pb2, self.logprobs),
            prompt_logprobs=logprobs_pb(pb2, self.prompt_logprobs[1:]))


def usage_pb(pb2, final: RequestOutput | None, completion_tokens: int):
    if final is None:
        return pb2.Usage(completion_tokens=completion_tokens)
    return pb2.Usage(prompt_tokens=final.num_prompt_tokens, completion_tokens=completion_tokens,
                     accepted_prediction_tokens=final.accepted_prediction_tokens,
                     rejected_prediction_tokens=final.rejected_prediction_tokens,
                     cached_prompt_tokens=final.num_cached_tokens)


def chunk(out: RequestOutput, decision: RouteDecision, first: bool, total_tokens: int, *,
          request_id: str):
    """One stream chunk; the route rides on the first chunk and the last chunk carries the rest."""
    pb2 = stubs.generation_pb2()
    msg = pb2.GenerateStreamChunk(text_delta=out.text_delta, token_ids=out.new_token_ids,
                                  finished=out.finished, request_id=request_id,
                                  logprobs=logprobs_pb(pb2, out.logprobs),
                                  prompt_logprobs=logprobs_pb(pb2, out.prompt_logprobs[1:]))
    if first or out.finished:
        msg.route.CopyFrom(route_pb(decision))
    if out.finished:
        msg.finish_reason = _FINISH.get(out.finish_reason, 0)
        msg.usage.CopyFrom(usage_pb(pb2, out, total_tokens))
        msg.spec.CopyFrom(spec_pb(out.spec))
    return msg
