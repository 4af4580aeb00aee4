"""Request-level types shared by the engine, the speculative core and the service glue.

Owns: sampling parameters and their validation, finish reasons, the per-step output a caller
iterates (with its tokens' log-probabilities when asked), speculation counters, and the limits a request is checked against. Ignores:
tokenization, transport, and the errors themselves (``cluster.common.errors``).
"""
from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import operator
from dataclasses import dataclass, field

from cluster.common.errors import InvalidRequestError
from cluster.common.segments import DEFAULT_SEGMENT


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    EOS = "eos"
    CANCELLED = "cancelled"
    ERROR = "error"


class SpecMode(enum.Enum):
    """Per-request speculation wish; the engine/router decide within it."""

    AUTO = "auto"
    SPECULATIVE = "speculative"
    PLAIN = "plain"


# Temperatures below this act as greedy (argmax). Why: logits / T overflows float32 to inf (then
# NaN probabilities) once T < |logit| / 3.4e38, e.g. T = 1e-44; and long before that the
# distribution is numerically one-hot: at T = 1e-5 a logit gap of 1e-3 already weighs
# exp(-100) ~ 4e-44. So below the epsilon sampling differs from argmax only between tokens whose
# logits lie within ~1e-4 of each other, and greedy is the limit the user asked for.
GREEDY_TEMPERATURE_EPS = 1e-5

# most alternatives a request may ask per output token (``SamplingParams.logprobs``), as OpenAI's
# ``top_logprobs``: each is a top-k over the vocabulary and travels in every delta
MAX_LOGPROBS = 20
# most tokens a request's logit_bias may name (OpenAI's cap), and the bias and penalty ranges (OpenAI's)
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = 100.0
PENALTY_RANGE = 2.0
REPETITION_PENALTY_MAX = 10.0  # repetition_penalty lies in (0, this]
# most token ids a request may stop on (``SamplingParams.stop_token_ids``; each is checked per token)
MAX_STOP_TOKEN_IDS = 64


def _finite_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # below GREEDY_TEMPERATURE_EPS means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # a token that ends the output (kept in it, as EOS is)
    ignore_eos: bool = False
    # no stop condition but the budget before this many output tokens: EOS and stop_token_ids are
    # masked from the rows below it, stop strings ending before it do not count (vLLM's)
    min_tokens: int = 0
    # None: no log-probabilities; n >= 0: each output token's log-probability under the target's
    # raw distribution (before logit_bias and the penalties) and its n most likely alternatives (``cluster.sampling.logprobs``)
    logprobs: int | None = None
    # None: none; n >= 0: each prompt token after the first gets its log-probability under the
    # target's raw distribution given the tokens before it, and its n most likely alternatives,
    # computed from the prefill's rows (``RequestOutput.prompt_logprobs``). With it max_tokens may
    # be 0: a scoring request, the prompt prefilled and nothing generated.
    prompt_logprobs: int | None = None
    # the target's logits as the request shapes them (``cluster.sampling.penalties``): added per
    # token id, and subtracted per token the output holds (presence: once; frequency: per time)
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's and HF's: every token the prompt or the output holds has its logit divided by it where
    # positive, multiplied where negative (> 1 discourages repeats); applied first, on the raw logits
    repetition_penalty: float = 1.0
    # vLLM's and HF's: after temperature, top-k and top-p, tokens less likely than min_p times the
    # most likely token are cut (``cluster.sampling.sampler.filtered_logits``); 0: no cut
    min_p: float = 0.0

    def __post_init__(self) -> None:
        self.stop = tuple(self.stop)
        try:
            self.stop_token_ids = tuple(operator.index(t) for t in self.stop_token_ids)
        except TypeError:
            raise InvalidRequestError(f"stop_token_ids must be integers, got {self.stop_token_ids!r}") from None
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"stop_token_ids has {len(self.stop_token_ids)} ids, limit is {MAX_STOP_TOKEN_IDS}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be token ids (>= 0), got {self.stop_token_ids!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise InvalidRequestError("max_tokens must be a positive integer, got 0 (0 only scores the prompt: "
                                      "it needs prompt_logprobs)")
        if (isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int)
                or not 0 <= self.min_tokens <= self.max_tokens):
            raise InvalidRequestError(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], "
                                      f"got {self.min_tokens!r}")
        self.temperature = _finite_number("temperature", self.temperature)
        if self.temperature < 0.0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        self.top_p = _finite_number("top_p", self.top_p)
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _finite_number(name, getattr(self, name))
            if not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise InvalidRequestError(f"{name} must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], got {value!r}")
            setattr(self, name, value)
        self.repetition_penalty = _finite_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= REPETITION_PENALTY_MAX:
            raise InvalidRequestError(f"repetition_penalty must be in (0, {REPETITION_PENALTY_MAX:g}] (1 = none), "
                                      f"got {self.repetition_penalty!r}")
        self.min_p = _finite_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1] (0 = none), got {self.min_p!r}")
        self.logit_bias = self._checked_bias(self.logit_bias)

    @staticmethod
    def _checked_bias(pairs) -> tuple[tuple[int, float], ...]:
        """(token id, bias) pairs, each id once, sorted; ids are checked against the vocabulary
        by ``ModelLimits``."""
        pairs = dict(pairs).items() if isinstance(pairs, dict) else tuple(pairs)
        if len(pairs) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias names {len(pairs)} tokens, limit is {MAX_LOGIT_BIAS}")
        out: dict[int, float] = {}
        for token, bias in pairs:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if token in out:
                raise InvalidRequestError(f"logit_bias names token {token} twice")
            bias = _finite_number(f"logit_bias[{token}]", bias)
            if not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
                raise InvalidRequestError(f"logit_bias[{token}] must be in [-{LOGIT_BIAS_RANGE:g}, "
                                          f"{LOGIT_BIAS_RANGE:g}], got {bias!r}")
            out[token] = bias
        return tuple(sorted(out.items()))

    @property
    def shapes_logits(self) -> bool:
        """Logit bias or a penalty: the target's rows are shaped before sampling (``penalize``)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    def holds_ends(self, num_output: int) -> bool:
        """Under ``min_tokens`` after ``num_output`` output tokens: the rows from here on have the
        tokens that end the output masked until it is reached (``penalize``)."""
        return self.min_tokens > num_output

    @property
    def scores_only(self) -> bool:
        """max_tokens 0: the prompt's log-probabilities and no output (the engine samples nothing)."""
        return self.max_tokens == 0

    @property
    def greedy(self) -> bool:
        """Argmax decoding: what the sampler, the rejection sampler and the drafters all test."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def coupled(self) -> bool:
        """Seeded sampling: each token is Gumbel-max with noise from (seed, position)
        (``cluster.sampling.sampler``), so the output is the same on every path and K."""
        return self.seed is not None and not self.greedy


@dataclass(slots=True)
class SpecStats:
    """Speculation counters for one request or one segment (vocabulary: arXiv 2211.17192).

    drafts: verification steps that carried at least one draft token.
    draft_tokens: tokens proposed by the drafter. accepted_tokens: draft tokens the target kept.
    rejections: verification steps that rejected a draft token (accepted < K).
    alpha α = accepted_tokens / (accepted_tokens + rejections): the per-position acceptance
    probability, the unit of the cost model and of every gate (``cluster.speculative.acceptance``).
    acceptance_rate = accepted_tokens / draft_tokens: the share of drafted tokens kept
    (descriptive; biased low as an estimate of α).
    mean_acceptance_length = tokens committed per verification step (accepted + the one
    recovered or bonus token) = (accepted_tokens + drafts) / drafts.
    """

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rejections: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    steps_by_num_draft_tokens: list[int] = field(default_factory=list)  # histogram: steps_by_num_draft_tokens[k] = steps with K=k
    # draft tokens the grammar forced (its only legal continuation, proposed without a drafter;
    # counted in draft_tokens / accepted_tokens too): α without them is
    # (accepted_tokens - forced_tokens) / (draft_tokens - forced_tokens)
    forced_tokens: int = 0

    def record(self, k: int, num_accepted: int, forced: int = 0) -> None:
        self.forced_tokens += min(forced, num_accepted)
        while len(self.steps_by_num_draft_tokens) <= k:
            self.steps_by_num_draft_tokens.append(0)
        self.steps_by_num_draft_tokens[k] += 1
        if k == 0:
            return
        self.drafts += 1
        self.draft_tokens += k
        self.accepted_tokens += num_accepted
        self.rejections += 1 if num_accepted < k else 0
        while len(self.drafted_per_position) < k:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(k):
            self.drafted_per_position[i] += 1
            if i < num_accepted:
                self.accepted_per_position[i] += 1

    def merge(self, other: "SpecStats") -> None:
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.rejections += other.rejections
        self.forced_tokens += other.forced_tokens
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.drafted_per_position, other.drafted_per_position),
                             (self.steps_by_num_draft_tokens, other.steps_by_num_draft_tokens)):
            while len(mine) < len(theirs):
                mine.append(0)
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def alpha(self) -> float:
        trials = self.accepted_tokens + self.rejections
        return self.accepted_tokens / trials if trials else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return (self.accepted_tokens + self.drafts) / self.drafts if self.drafts else 0.0

    def to_dict(self) -> dict:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "rejections": self.rejections,
            "alpha": self.alpha,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "steps_by_num_draft_tokens": list(self.steps_by_num_draft_tokens),
            "forced_tokens": self.forced_tokens,
        }


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    GRAMMAR = "grammar"  # a context-free grammar in llguidance's Lark dialect


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's structured-output constraint (``cluster.engine.grammar`` enforces it)."""

    kind: ConstraintKind
    text: str


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    segment: str = DEFAULT_SEGMENT
    mode: SpecMode = SpecMode.AUTO
    arrival_time: float = 0.0
    # W3C trace context from the Router (cluster.telemetry): parent of this request's engine spans.
    trace_carrier: dict[str, str] = field(default_factory=dict)
    constraint: Constraint | None = None  # json_schema / regex / grammar the output must match
    # a drafter that learns from traffic (suffix, portfolio) drafts this request only from answers
    # of requests with the same segment and draft_scope ("": the shared scope)
    draft_scope: str = ""
    # the output the client expects (its tokens): the speculative path drafts from it where the
    # output lines up with it (cluster.speculative.prediction); () without one
    prediction_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log-probability. ``token`` is the token's bytes, filled in next to the tokenizer
    (``cluster.models.token_bytes``); the engine leaves it empty."""

    token_id: int
    logprob: float | None  # None only for a prompt's first token: nothing comes before it
    token: bytes = b""


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """An output token's log-probability and the ``SamplingParams.logprobs`` most likely tokens at
    its position (most likely first; the output token is among them only if it ranks there)."""

    chosen: Logprob
    top: tuple[Logprob, ...] = ()


@dataclass(slots=True)
class RequestOutput:
    """One delta of a running request. The last one has ``finished=True`` and a finish reason."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache, not prefilled
    spec: SpecStats | None = None
    # one per new_token_ids entry when the request asked for logprobs (SamplingParams.logprobs), else []
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # when the request asked for prompt_logprobs, on its first output (the one that ends the
    # prefill): one per prompt token, in order — the first's has logprob None and no alternatives
    # (nothing comes before it; it carries the token's bytes like the rest) — else []
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # with a prediction, on the final output: its tokens that appear in the output in order, and
    # the rest (``cluster.speculative.prediction.prediction_overlap``)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    error: str | None = None
    # Timing (seconds, monotonic clock): set on the final output.
    queue_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None  # arrival -> this final output

    def __post_init__(self) -> None:
        if self.finish_reason is FinishReason.ERROR and not self.error:
            self.error = "internal error"  # an ERROR finish always says something (gRPC INTERNAL)


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one (the later one's status and counters)."""
    return dataclasses.replace(later, new_token_ids=earlier.new_token_ids + later.new_token_ids,
                               text_delta=earlier.text_delta + later.text_delta,
                               logprobs=earlier.logprobs + later.logprobs,
                               prompt_logprobs=earlier.prompt_logprobs + later.prompt_logprobs)


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What a request may ask of this engine; checkable away from the model (another process)."""

    vocab_size: int
    max_model_len: int
    kv_capacity: int  # tokens the whole KV pool holds

    def check(self, request: GenerationRequest) -> None:
        ids = request.prompt_token_ids
        if not ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]!r} outside the vocabulary [0, {vocab})")
        biased = [t for t, _ in request.params.logit_bias if t >= vocab]
        if biased:
            raise InvalidRequestError(f"logit_bias token id {biased[0]} outside the vocabulary [0, {vocab})")
        stops = [t for t in request.params.stop_token_ids if t >= vocab]
        if stops:
            raise InvalidRequestError(f"stop_token_ids token id {stops[0]} outside the vocabulary [0, {vocab})")
        if request.params.min_tokens and request.constraint is not None:
            raise InvalidRequestError("min_tokens cannot be combined with json_schema / regex: the grammar "
                                      "decides where the output may end")
        total = len(ids) + request.params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({request.params.max_tokens}) = {total} "
                f"exceeds the context length {self.max_model_len}")
        if total > self.kv_capacity:
            raise InvalidRequestError(
                f"prompt + max_tokens = {total} tokens exceeds the KV cache capacity {self.kv_capacity}")
