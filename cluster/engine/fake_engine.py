"""A fake engine implementing ``EngineProtocol`` for fast router, gRPC and deployment tests.

Owns: believable engine behaviour without a model — a byte tokenizer, a deterministic target
(the next token repeats the prompt cyclically, so prompt-lookup drafting hits), a bounded waiting
queue (EngineOverloadedError), stand-in log-probabilities of output and prompt when asked (``fake_logprobs``;
max_tokens 0 answers the prompt's alone), a KV block pool that fills and frees (so cancellation tests can
watch it), readiness after a configurable start delay, and speculation counters per segment.
With a ``proposer`` (e.g. the KVSync ``RemoteProposer``) it really calls ``propose``/``release``
each step, verifies the drafts greedily against its target and, on ``DraftUnavailableError``,
finishes the step without speculation (counting ``draft_fallbacks``) like the real engine.
Without one but with ``config.spec`` it simulates acceptance from ``acceptance_rate_by_segment``:
each verification step accepts round(rate·K) of its K drafts (deterministic; the per-position α
this gives is accepted / (accepted + rejections), e.g. 1 of 4 every step: acceptance_rate 0.25,
α 0.5 — ``cluster.speculative.acceptance``); a key "<segment><class>" (``classed_context``, e.g.
"chat+sampled") sets one acceptance class's rate apart, and each class's α is reported per segment
(``live_alpha_by_class``, lifetime counts); K per request is its segment's policy (a fixed K,
``max_draft_tokens`` for "auto").
Failure injection for service tests: a prompt containing ``FAIL_MARKER`` finishes that request
alone with ``FinishReason.ERROR`` and an ``error`` message after its first tokens (as the real
engine does when one sequence's step fails); one containing ``CRASH_MARKER`` raises an exception
whose text looks like internals (pid, node IP, "Traceback") from the request's output stream;
one containing ``HOLD_MARKER`` emits its first step and then holds its slot (and KV) until it is
cancelled, or ``hold_limit_s`` (default ``HOLD_LIMIT_S``) passes (so a test's in-flight count cannot
drift with timing).
Ignores: real model quality, batching across requests, sampling.
"""
from __future__ import annotations

import asyncio
import math
import os
import time
from typing import AsyncIterator

from cluster.common.acceptance_class import acceptance_class, class_name, classed_context
from cluster.common.config import AUTO_K, EngineConfig
from cluster.common.errors import EngineOverloadedError, InvalidRequestError
from cluster.common.request import (
    FinishReason, GenerationRequest, Logprob, RequestOutput, SpecStats, TokenLogprobs,
)
from cluster.engine.protocol import EngineStats
from cluster.speculative.proposer import RemoteDraft

_OFFSET = 3  # ids 0..2 are reserved (pad, bos, eos); byte b is token b + 3
EOS_ID = 2
FAIL_MARKER = "@@fail-request@@"
FAIL_MESSAGE = "sampling failed for this request (fake engine)"
CRASH_MARKER = "@@crash-engine@@"
CRASH_TEXT = "Traceback (most recent call last): worker pid=4242 node 10.1.2.3 actor ffff0001"
_FAIL_AFTER = 2  # tokens a failing request produces first
HOLD_MARKER = "@@hold@@"
HOLD_LIMIT_S = 120.0  # a held request finishes by itself after this long


class FakeEngine:
    def __init__(self, config: EngineConfig, proposer=None, *, token_delay_s: float = 0.002,
                 start_delay_s: float = 0.0, acceptance_rate_by_segment: dict[str, float] | None = None,
                 default_acceptance_rate: float = 0.75, moe: bool = False, vocab_size: int = 259,
                 max_model_len: int = 2048, hold_limit_s: float = HOLD_LIMIT_S) -> None:
        self.config = config
        self.hold_limit_s = hold_limit_s
        self.proposer = proposer
        self.token_delay_s = token_delay_s
        self.start_delay_s = start_delay_s
        self.acceptance_rate_by_segment = dict(acceptance_rate_by_segment or {})
        self.default_acceptance_rate = default_acceptance_rate
        self.moe = moe
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_kv_blocks = config.num_kv_blocks or 256
        self._ready = False
        self._start_task: asyncio.Future | None = None
        self._running: dict[str, int] = {}  # request id -> KV blocks held
        self._waiting = 0
        self._slots: asyncio.Semaphore | None = None
        self._spec_by_segment: dict[str, SpecStats] = {}
        self._spec_by_class: dict[tuple[str, str], SpecStats] = {}  # (segment, acceptance class name)
        self._fallbacks = 0

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self._start_task is None:
            self._start_task = asyncio.ensure_future(self._start())
        await asyncio.shield(self._start_task)

    async def _start(self) -> None:
        await asyncio.sleep(self.start_delay_s)
        self._slots = asyncio.Semaphore(self.config.max_num_seqs)
        self._ready = True

    def ready(self) -> bool:
        return self._ready

    @property
    def pid(self) -> int:
        return os.getpid()

    async def shutdown(self) -> None:
        self._ready = False

    # -- tokenizer -------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return [b + _OFFSET for b in text.encode("utf-8")]

    def detokenize(self, ids: list[int]) -> str:
        return bytes(t - _OFFSET for t in ids if t >= _OFFSET).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id - _OFFSET]) if _OFFSET <= token_id < _OFFSET + 256 else f"<{token_id}>".encode()

    def fake_logprobs(self, tokens: list[int], num_top: int | None) -> list[TokenLogprobs]:
        """Deterministic stand-ins for a request that asked for logprobs: the token at -0.25 and
        its next ids below it (the real engine's come from the target, ``cluster.sampling.logprobs``)."""
        if num_top is None:
            return []
        return [TokenLogprobs(Logprob(t, -0.25), tuple(Logprob((t + j) % self.vocab_size, -0.25 - j)
                                                        for j in range(num_top))) for t in tokens]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self.tokenize(text)

    def target_token(self, prompt: list[int], i: int) -> int:
        """The fake target's greedy token at output position i."""
        return prompt[i % len(prompt)]

    # -- generation ------------------------------------------------------------------------
    @property
    def spec_enabled(self) -> bool:
        return self.config.spec is not None or self.proposer is not None

    def _k(self, segment: str) -> int:
        """K for a request of ``segment``: its policy's fixed K, max_draft_tokens for "auto" (4 without a config)."""
        spec = self.config.spec
        if spec is None:
            return 4
        k = spec.k_policy(segment)
        return spec.max_draft_tokens if k == AUTO_K else int(k)

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if not self._ready:
            raise RuntimeError("engine not started")
        n = len(request.prompt_token_ids)
        if n + request.params.max_tokens > self.max_model_len:
            raise InvalidRequestError(f"prompt ({n}) + max_tokens ({request.params.max_tokens}) "
                                      f"exceeds max_model_len {self.max_model_len}")
        if self._waiting >= self.config.max_queue:
            raise EngineOverloadedError(f"waiting queue is full ({self.config.max_queue} requests)")
        self._waiting += 1
        return self._run(request)

    async def _run(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        assert self._slots is not None
        arrival = time.monotonic()
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        queued = time.monotonic() - arrival
        rid, prompt = req.request_id, list(req.prompt_token_ids)
        blocks = math.ceil((len(prompt) + req.params.max_tokens) / self.config.block_size)
        self._running[rid] = blocks
        stats = SpecStats()
        out: list[int] = []
        finish = FinishReason.CANCELLED
        first_at = None
        text_prompt = self.detokenize(prompt)
        fail, crash = FAIL_MARKER in text_prompt, CRASH_MARKER in text_prompt
        hold = HOLD_MARKER in text_prompt
        prompt_lp = [] if req.params.prompt_logprobs is None else (  # on the first output
            [TokenLogprobs(Logprob(prompt[0], None))] + self.fake_logprobs(prompt[1:], req.params.prompt_logprobs))
        try:
            if req.params.scores_only:
                await asyncio.sleep(self.token_delay_s)
                yield RequestOutput(rid, [], "", finished=True, finish_reason=FinishReason.LENGTH,
                                    prompt_logprobs=prompt_lp, num_prompt_tokens=len(prompt),
                                    queue_time=queued, finish_time=time.monotonic() - arrival)
            while len(out) < req.params.max_tokens:
                if (fail or crash) and len(out) >= _FAIL_AFTER:
                    if crash:
                        raise RuntimeError(CRASH_TEXT)
                    yield RequestOutput(rid, [], "", finished=True, finish_reason=FinishReason.ERROR,
                                        num_prompt_tokens=len(prompt), num_output_tokens=len(out),
                                        error=FAIL_MESSAGE)
                    return
                await asyncio.sleep(self.token_delay_s)
                if hold and out:
                    await asyncio.sleep(self.hold_limit_s)
                    hold = False
                new = await self._step(req, prompt, out, stats)
                new = new[: req.params.max_tokens - len(out)]
                out.extend(new)
                if first_at is None and new:
                    first_at = time.monotonic()
                done = len(out) >= req.params.max_tokens
                text = self.detokenize(new)
                if done:
                    finish = FinishReason.LENGTH
                    self._record(req.segment, acceptance_class(req.params), stats)
                yield RequestOutput(rid, new, text, finished=done,
                                    finish_reason=finish if done else None,
                                    logprobs=self.fake_logprobs(new, req.params.logprobs),
                                    prompt_logprobs=[] if len(out) > len(new) else prompt_lp,
                                    num_prompt_tokens=len(prompt), num_output_tokens=len(out),
                                    spec=stats if done and self.spec_enabled and req.mode.value != "plain" else None,
                                    queue_time=queued if done else 0.0,
                                    first_token_time=first_at - arrival if done and first_at else None,
                                    finish_time=time.monotonic() - arrival if done else None)
        finally:
            self._running.pop(rid, None)
            self._slots.release()
            if self.proposer is not None:
                await asyncio.to_thread(self.proposer.release, rid)

    async def _step(self, req, prompt, out, stats) -> list[int]:
        pos = len(out)
        target = lambda i: self.target_token(prompt, i)  # noqa: E731
        if not self.spec_enabled or req.mode.value == "plain":
            return [target(pos)]
        k = self._k(req.segment)
        if self.proposer is None:  # simulated acceptance: the segment's accepted share, deterministic
            rates = self.acceptance_rate_by_segment
            rate = rates.get(classed_context(req.segment, acceptance_class(req.params)),
                             rates.get(req.segment, self.default_acceptance_rate))
            accepted = min(k, int(rate * k + 0.5))
            stats.record(k, accepted)
            return [target(pos + i) for i in range(accepted + 1)]
        from cluster.speculative.types import DraftUnavailableError, ProposeInput

        inp = ProposeInput(seq_id=req.request_id, token_ids=prompt + out, num_draft_tokens=k,
                           params=req.params)
        try:
            proposal = await asyncio.to_thread(self.proposer.propose, [inp])
        except DraftUnavailableError:
            self._fallbacks += 1
            stats.record(0, 0)
            return [target(pos)]
        draft = proposal.draft_token_ids[0]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == target(pos + accepted):
            accepted += 1
        stats.record(len(draft), accepted)
        return [target(pos + i) for i in range(accepted + 1)]

    def _record(self, segment: str, tag: str, stats: SpecStats) -> None:
        self._spec_by_segment.setdefault(segment, SpecStats()).merge(stats)
        self._spec_by_class.setdefault((segment, class_name(tag)), SpecStats()).merge(stats)

    def _by_segment(self) -> dict[str, dict]:
        out = {s: st.to_dict() for s, st in self._spec_by_segment.items()}
        for (segment, name), st in self._spec_by_class.items():
            out[segment].setdefault("live_alpha_by_class", {})[name] = {
                "live_alpha": st.alpha, "live_draft_tokens": st.draft_tokens}
        return out

    async def abort(self, request_id: str) -> None:
        # Generators own their cleanup; closing them frees the blocks. Nothing else to do here.
        self._running.pop(request_id, None)

    def stats(self) -> EngineStats:
        used = sum(self._running.values())
        return EngineStats(
            num_running=len(self._running), num_waiting=self._waiting,
            kv_blocks_total=self.num_kv_blocks, kv_blocks_free=max(0, self.num_kv_blocks - used),
            spec_enabled=self.spec_enabled,
            drafter=(self.config.spec.drafter if self.config.spec else None),
            moe=self.moe, moe_gate_open=(not self.moe) or bool(self.config.spec and self.config.spec.moe_validated),
            draft_fallbacks=self._fallbacks,
            draft_resyncs=self.proposer.num_resyncs if isinstance(self.proposer, RemoteDraft) else 0,
            spec_by_segment=self._by_segment())

    def model_info(self) -> dict:
        spec = self.config.spec
        return {"name": f"fake:{self.config.model}", "architecture": "FakeByteLM",
                "vocab_size": self.vocab_size, "max_model_len": self.max_model_len,
                "dtype": self.config.dtype.value, "moe": self.moe,
                "drafter": spec.drafter if spec else None,
                "num_draft_tokens": str(spec.num_draft_tokens) if spec else None}
