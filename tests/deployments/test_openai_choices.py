"""OpenAI's ``n`` on the Router side: the choices' engine requests, running them at once (outputs
as they come, a failure failing the request, closing cancelling every choice), their summary,
``best_of``'s ranking of candidates, and a completion's batch of prompts.
End to end through the official client: tests/deployments/test_openai_service.py."""
import asyncio
import dataclasses

import pytest

from cluster.api.requests import Limits, PromptInput, RequestFields, ValidatedRequest
from cluster.api.status import ServiceError
from cluster.common.request import (
    FinishReason, Logprob, RequestOutput, SamplingParams, SpecMode, SpecStats, TokenLogprobs,
)
from deployments.openai_choices import (
    best_choices, best_of_each, choice_outputs, choice_requests, combined_final, prompt_requests,
)


def vreq(seed: int | None) -> ValidatedRequest:
    return ValidatedRequest(request_id="abc", prompt=PromptInput(text="hi"),
                            params=SamplingParams(max_tokens=4, temperature=1.0, seed=seed),
                            mode=SpecMode.AUTO, segment="chat", constrained=False)


def test_choice_requests_ids_and_seeds():
    assert choice_requests(vreq(5), 1) == [vreq(5)]  # one choice: the request itself
    three = choice_requests(vreq(5), 3)
    assert [r.request_id for r in three] == ["abc-0", "abc-1", "abc-2"]
    assert [r.params.seed for r in three] == [5, 6, 7]
    assert [r.params.seed for r in choice_requests(vreq(2**64 - 1), 2)] == [2**64 - 1, 0]  # wraps in range
    assert [r.params.seed for r in choice_requests(vreq(None), 2)] == [None, None]  # unseeded: each its own
    assert all(r.params.max_tokens == 4 and r.segment == "chat" for r in three)


class Stream:
    """A choice's stream: ``tokens`` outputs ``delay`` s apart, then a finished one (or ``fail``)."""

    def __init__(self, rid: str, tokens: int, delay: float = 0.0, fail: Exception | None = None) -> None:
        self.rid, self.tokens, self.delay, self.fail = rid, tokens, delay, fail
        self.closed = False
        self.sent = 0

    async def __call__(self):
        try:
            for t in range(self.tokens):
                await asyncio.sleep(self.delay)
                self.sent += 1
                yield RequestOutput(self.rid, [t], str(t))
            if self.fail is not None:
                raise self.fail
            yield RequestOutput(self.rid, [], "", finished=True, finish_reason=FinishReason.LENGTH,
                                num_output_tokens=self.tokens)
        finally:
            self.closed = True


async def collect(streams) -> list[tuple[int, RequestOutput]]:
    return [item async for item in choice_outputs(streams)]


def test_choice_outputs_interleave_and_end_once_every_choice_finished():
    streams = [Stream("a", 3, 0.01), Stream("b", 1, 0.0), Stream("c", 5, 0.002)]
    got = asyncio.run(collect(streams))
    for i, s in enumerate(streams):
        mine = [out for j, out in got if j == i]
        assert [out.new_token_ids for out in mine] == [[t] for t in range(s.tokens)] + [[]]
        assert mine[-1].finished and all(out.request_id == s.rid for out in mine)
    assert got[-1][0] == 0  # the slowest choice ends the request
    assert [j for j, _ in got].index(0) > [j for j, _ in got].index(1)  # as they come, not choice by choice
    assert all(s.closed for s in streams)


def test_one_choice_is_its_own_stream():
    s = Stream("a", 2)
    assert [(i, out.new_token_ids) for i, out in asyncio.run(collect([s]))] == [(0, [0]), (0, [1]), (0, [])]


def test_a_failing_choice_fails_the_request_and_cancels_the_others():
    slow = Stream("slow", 1000, 0.01)
    bad = Stream("bad", 2, 0.0, fail=ValueError("engine said no"))

    async def run():
        with pytest.raises(ValueError, match="engine said no"):
            await collect([slow, bad])
    asyncio.run(run())
    assert slow.closed and slow.sent < 100  # cancelled (its engine request aborted), not run out


def test_closing_the_outputs_cancels_every_choice():
    streams = [Stream("a", 1000, 0.01), Stream("b", 1000, 0.01)]

    async def run():
        outputs = choice_outputs(streams)
        await outputs.__anext__()  # the client got a first event, then left
        await outputs.aclose()
    asyncio.run(run())
    assert all(s.closed and s.sent < 50 for s in streams)


def test_combined_final_sums_the_choices():
    a, b = SpecStats(), SpecStats()
    a.record(4, 2)
    b.record(4, 4)
    finals = [RequestOutput("x-0", [1], "t", finished=True, finish_reason=FinishReason.STOP, num_prompt_tokens=9,
                            num_output_tokens=5, spec=a, accepted_prediction_tokens=2, rejected_prediction_tokens=1),
              RequestOutput("x-1", [2], "u", finished=True, finish_reason=FinishReason.LENGTH, num_prompt_tokens=9,
                            num_output_tokens=7, spec=b, accepted_prediction_tokens=3)]
    c = combined_final(finals)
    assert c.finished and c.num_prompt_tokens == 9 and c.num_output_tokens == 12  # the prompt once
    assert (c.accepted_prediction_tokens, c.rejected_prediction_tokens) == (5, 1)
    assert (c.spec.draft_tokens, c.spec.accepted_tokens, c.spec.rejections) == (8, 6, 1)
    assert c.new_token_ids == [] and c.text_delta == ""  # a summary, not a delta
    assert combined_final(finals[:1]) is finals[0]
    other = dataclasses.replace(finals[1], num_prompt_tokens=4)  # a batch of two prompts, one choice each
    assert combined_final([finals[0], other], per_prompt=1).num_prompt_tokens == 13
    assert combined_final([finals[0], finals[1], other, other], per_prompt=2).num_prompt_tokens == 13
    assert combined_final([RequestOutput("p", [], "", finished=True, num_output_tokens=1)] * 2).spec is None


def test_ranked_candidates_report_logprobs_and_the_best_per_token_win():
    """best_of's candidates each report their tokens' log-probabilities (0 alternatives unless the
    client asked for more); the n best by log-probability per token are answered, best first —
    a long candidate with a better mean beats a short one with a better sum."""
    ranked = choice_requests(vreq(5), 3, ranked=True)
    assert [r.params.logprobs for r in ranked] == [0, 0, 0] and [r.params.seed for r in ranked] == [5, 6, 7]
    assert choice_requests(vreq(5), 3)[0].params.logprobs is None  # n alone asks for none

    def lps(*values):
        return [TokenLogprobs(Logprob(1, v)) for v in values]

    candidates = [lps(-0.5), lps(-0.3, -0.3, -0.3, -0.3), lps(-3.0), lps()]
    assert best_choices(candidates, 1) == [1]  # mean -0.3 beats -0.5, though its sum (-1.2) is lower
    assert best_choices(candidates, 3) == [1, 0, 2]
    assert best_choices(candidates, 4)[-1] == 3  # no tokens: last
    assert best_choices([lps(-0.5), lps(-0.5)], 2) == [0, 1]  # a tie keeps the candidates' order


def test_a_batch_of_prompts_is_one_request_per_prompt_checked_by_the_shared_rules():
    one = vreq(5)
    limits = Limits()
    assert prompt_requests(one, [RequestFields(size=10, prompt="hi")], limits) == [one]  # a batch of one: itself
    batch = prompt_requests(one, [RequestFields(size=10, prompt="hi"), RequestFields(size=10, token_ids=(7, 8))], limits)
    assert [r.request_id for r in batch] == ["abc-0", "abc-1"]
    assert [r.prompt for r in batch] == [PromptInput(text="hi"), PromptInput(token_ids=(7, 8))]
    assert all(r.params == one.params and r.segment == one.segment for r in batch)
    assert [r.request_id for p in batch for r in choice_requests(p, 2)] == ["abc-0-0", "abc-0-1", "abc-1-0", "abc-1-1"]
    with pytest.raises(ServiceError, match="prompt is empty"):
        prompt_requests(one, [RequestFields(size=10, prompt="hi"), RequestFields(size=10, prompt="  ")], limits)


def test_best_of_each_prompt_ranks_its_own_candidates():
    def lps(v):
        return [TokenLogprobs(Logprob(1, v))]

    # two prompts, three candidates each; one answered per prompt
    assert best_of_each([lps(-2), lps(-1), lps(-3), lps(-0.5), lps(-4), lps(-0.1)], 3, 1) == [1, 5]
    assert best_of_each([lps(-2), lps(-1), lps(-3), lps(-0.5)], 2, 2) == [1, 0, 3, 2]
