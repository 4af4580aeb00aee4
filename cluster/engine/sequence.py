"""One request's state inside the engine.

Owns: the token list (prompt + output), how many tokens the target KV holds (committed length in
KV), status, detokenizer, the log-probabilities of output (and prompt) not yet reported, error message, finish
reason, timings and speculation counters, and
appending committed tokens with the stop conditions (EOS, stop token ids, stop strings,
max_tokens, a complete grammar) and feeding them to the sequence's grammar matcher. Ignores: scheduling and model execution.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from cluster.common.request import FinishReason, GenerationRequest, SpecStats
from cluster.engine.detokenizer import Detokenizer
from cluster.telemetry.engine_spans import NOOP_TRACE


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    request: GenerationRequest
    detok: Detokenizer
    eos_token_ids: frozenset[int]
    speculate: bool  # may this request use the speculative path at all
    token_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V the target holds
    num_prompt_cached: int = 0  # prompt tokens its first admission found in the prefix cache (not prefilled)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None  # why it finished with FinishReason.ERROR (the client's message)
    spec: SpecStats = field(default_factory=SpecStats)
    pending_ids: list[int] = field(default_factory=list)  # new output ids not yet reported
    pending_text: str = ""
    pending_logprobs: list = field(default_factory=list)  # TokenLogprobs of pending_ids (logprobs asked)
    # prompt_logprobs asked: TokenLogprobs of prompt tokens 0..num_prompt_scored not yet reported
    # (RequestOutput.prompt_logprobs), and how many prompt tokens after the first have theirs (the
    # prefill's rows give them once: a preempted sequence's recompute does not again)
    pending_prompt_logprobs: list = field(default_factory=list)
    num_prompt_scored: int = 0
    arrival: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    num_preemptions: int = 0
    trace: object = NOOP_TRACE  # cluster.telemetry.engine_spans.RequestTrace (no-op when not traced)
    # cluster.engine.grammar.GrammarMatcher of a constrained request: the grammar state after the
    # committed output (it follows token_ids, not the KV, so preemption leaves it valid)
    grammar: object = None
    # cluster.sampling.penalties.SeenTokens of a request with a repetition penalty: its prompt's and
    # output's distinct tokens, kept up to date step by step (set on its first shaped step)
    seen_tokens: object = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_token_ids)

    @property
    def seq_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    def prompt_rows(self, start: int, end: int) -> range:
        """Positions in [start, end) whose target rows give prompt log-probabilities still owed
        (the row at position p is the distribution of prompt token p + 1); empty when the request
        did not ask for them."""
        if self.request.params.prompt_logprobs is None:
            return range(0)
        return range(max(start, self.num_prompt_scored), min(end, self.prompt_len - 1))

    @property
    def num_pending_tokens(self) -> int:
        """Tokens known but not yet in the KV cache (a prefill remainder, or the last sampled)."""
        return len(self.token_ids) - self.num_cached

    @property
    def remaining_budget(self) -> int:
        return self.request.params.max_tokens - self.num_output

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def append_committed(self, tokens: list[int], logprobs: list | None = None) -> int:
        """Append tokens in order until a stop condition; returns how many were kept (and as many
        of ``logprobs``, the tokens' ``TokenLogprobs`` when the request asked for them). A
        constrained sequence feeds each token to its grammar first (a token the grammar forbids
        raises GrammarError before it is appended), ends on EOS (the mask allowed it only where
        the output can end) and finishes STOP once the grammar is complete. Under ``min_tokens``
        no stop condition but the budget ends the output (EOS and stop token ids are masked from
        the target's rows there: ``cluster.sampling.penalties``)."""
        p = self.request.params
        kept = 0
        for i, t in enumerate(tokens):
            is_eos = t in self.eos_token_ids
            if self.grammar is not None and not is_eos:
                self.grammar.accept(t)
            self.token_ids.append(t)
            self.pending_ids.append(t)
            if logprobs is not None:
                self.pending_logprobs.append(logprobs[i])
            kept += 1
            if self.first_token_at is None:
                self.first_token_at = time.monotonic()
            armed = self.num_output >= p.min_tokens
            if is_eos and armed and (not p.ignore_eos or self.grammar is not None):
                self.finish(FinishReason.EOS)
                break
            text, hit = self.detok.add(t, check_stop=armed)
            self.pending_text += text
            if hit:
                self.finish(FinishReason.STOP)
                break
            if armed and t in p.stop_token_ids:
                self.finish(FinishReason.STOP)
                break
            if self.grammar is not None and self.grammar.complete:
                self.finish(FinishReason.STOP)
                break
            if self.num_output >= p.max_tokens:
                self.finish(FinishReason.LENGTH)
                break
        return kept

    def finish(self, reason: FinishReason) -> None:
        if self.status is SeqStatus.FINISHED:
            return
        self.grammar = None  # free the matcher
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
        self.pending_text += self.detok.flush()

    def fail(self, message: str) -> None:
        """Finish with FinishReason.ERROR (even if a stop condition finished it a moment before
        the fault), keeping what the detokenizer still holds if it can."""
        self.status = SeqStatus.FINISHED
        self.grammar = None
        self.finish_reason = FinishReason.ERROR
        self.error = message
        try:
            self.pending_text += self.detok.flush()
        except Exception:  # noqa: BLE001 (the detokenizer may be what failed)
            pass
