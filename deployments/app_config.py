"""The service's user-facing configuration (the ``args`` of the Serve app), validated by pydantic.

Owns: every knob of the app — models, drafter, placement, replicas and resources per deployment,
router thresholds, limits, auth, the HTTP API's served model name, telemetry, and ``engine_impl``
(the engine class to inject; tests use ``cluster.engine.fake_engine:FakeEngine``) — and their conversion into the internal dataclass
configs (``EngineConfig``, ``RouterConfig``, ``Limits``). Unknown keys are errors (extra="forbid").
``proxy_env`` gives the environment Ray Serve's gRPC proxy reads its message cap from.
Ignores: building deployments (``deployments.app``).
"""
from __future__ import annotations

import enum
import importlib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.api.requests import Limits
from cluster.common.config import (
    COLD_SUFFIX, MAX_DRAFT_TOKENS, EngineConfig, SegmentSpeculation, SpecConfig, suffix_corpus_name,
)
from cluster.routing.policy import RouterConfig


class Placement(str, enum.Enum):
    SHARED = "shared"  # draft and target in one SpecEngine replica
    SEPARATE = "separate"  # draft in DraftServer replicas, kept in step over KVSync


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SegmentRouterKnobs(_Strict):
    """One segment's own settings (``specserve map`` writes them); unset: the global one. The
    thresholds and min_alpha steer the Router; ``drafter`` and ``num_draft_tokens`` (fixed K or
    "auto") steer the SpecEngine for this segment's requests."""

    enter_threshold: int | None = Field(None, ge=1)
    exit_threshold: int | None = Field(None, ge=1)
    min_alpha: Annotated[float, Field(ge=0.0, le=1.0)] | Literal["auto"] | None = None
    drafter: str | None = Field(None, min_length=1)  # ngram | suffix | portfolio | self[:L] | a draft model
    num_draft_tokens: Annotated[int, Field(ge=0, le=MAX_DRAFT_TOKENS)] | Literal["auto"] | None = None

    @property
    def engine_settings(self) -> bool:
        return self.drafter is not None or self.num_draft_tokens is not None


class RouterKnobs(_Strict):
    enter_threshold: int = Field(4, ge=1)
    exit_threshold: int = Field(8, ge=1)
    min_alpha: Annotated[float, Field(ge=0.0, le=1.0)] | Literal["auto"] = "auto"
    min_alpha_samples: int = Field(64, ge=0)
    probe_every: int = Field(16, ge=0)  # 1 in N requests of a gated segment still speculates
    balance_overflow: bool = True  # past the exit threshold, still send a request to the
    #                                SpecEngine when it would serve it sooner (measured latency)
    overflow_min_samples: int = Field(8, ge=1)  # completions per path and segment before measured
    #                                latency decides; until then fullness relative to capacity
    plain_when_faster: bool = True  # below the exit threshold, send a request plain when measured
    #                                latency says the BatchEngine serves it faster by the margin
    plain_faster_margin: float = Field(0.05, ge=0.0, lt=1.0)
    segments: dict[str, SegmentRouterKnobs] = Field(default_factory=dict)  # per-segment overrides
    grammar_speculation: bool = True  # constrained requests may speculate (under the grammar)
    # the latency model counts the other path's running requests in a path's service time; auto:
    # when both engines report the same Ray node and do not each hold whole GPUs
    paths_share_hardware: bool | Literal["auto"] = "auto"


class MoeKnobs(_Strict):
    """The live MoE gate (cluster.speculative.moe); dense targets ignore it. While a segment's gate is
    closed, 1 in ``probe_every`` of its requests speculates as a probe (0: the gate never opens
    live); each window of ``min_draft_tokens`` probe draft tokens opens the segment when its α
    reaches ``alpha_threshold`` ("auto": the SpecEngine's break-even from its measured step costs,
    0.5 without adaptive K). ``validated``: open for every segment from the start (an operator
    vouches for a measurement made elsewhere)."""

    probe_every: int = Field(8, ge=0)
    min_draft_tokens: int = Field(256, ge=1)
    alpha_threshold: Annotated[float, Field(ge=0.0, le=1.0)] | Literal["auto"] = "auto"
    validated: bool = False


class LimitsKnobs(_Strict):
    max_tokens: int = Field(1024, ge=1)
    max_prompt_tokens: int = Field(4096, ge=1)
    max_message_bytes: int = Field(1 << 20, ge=64)
    max_queue: int = Field(256, ge=1)
    max_segments: int = Field(32, ge=1)  # distinct segment labels measured per Router replica;
    #                                      further new ones are folded into "other"
    max_stop_strings: int = Field(16, ge=1)  # stop strings per request (each is searched after
    max_stop_chars: int = Field(256, ge=1)  # every token of the shared step), and their length
    max_constraint_chars: int = Field(16384, ge=1)  # json_schema / regex text length
    # the longest run of text a constraint's repetitions demand (regex {n} counts multiplied when
    # nested and added in sequence; minItems, Lark ~ n): forced text (cluster.engine.grammar_size)
    max_constraint_repeat: int = Field(8192, ge=1)
    # CPU seconds an engine may spend checking a new constraint and computing its first mask
    constraint_compile_s: float = Field(2.0, gt=0.0, le=60.0)
    max_choices: int = Field(8, ge=1, le=128)  # OpenAI's n: choices per request (each an engine request)


class AuthKnobs(_Strict):
    token_env: str | None = None  # name of the env var holding the bearer token; None = auth off


class HttpKnobs(_Strict):
    """The OpenAI-compatible HTTP API (served by Ray Serve's HTTP proxy; its host and port are
    the Serve config's ``http_options``, not app args)."""

    served_model_name: str | None = Field(None, min_length=1, max_length=256)  # the ``model`` clients
    #                                   pass and /v1/models lists; None: the ``model`` arg
    # /v1/responses with store (OpenAI's default): the ResponseStore keeps at most this many
    # responses and this many characters of them (their conversations as JSON), least recently
    # used out first; 0 responses: store true is refused (400) and nothing is kept
    stored_responses: int = Field(1000, ge=0)
    stored_response_chars: int = Field(64_000_000, ge=1)


class TelemetryKnobs(_Strict):
    """Unset (None) fields fall back to the OTEL_* environment (cluster.telemetry.config)."""

    otlp_endpoint: str | None = None  # e.g. http://otel-collector:4317; None = OTEL_EXPORTER_OTLP_ENDPOINT
    sampling_ratio: float | None = Field(None, ge=0.0, le=1.0)  # None = OTEL_TRACES_SAMPLER_ARG or 1.0
    service_name: str | None = None  # None = OTEL_SERVICE_NAME or "specserve"
    enabled: bool | None = None  # None = on when an endpoint is known; OTEL_SDK_DISABLED=true wins


BATCHED_TOKENS_DEFAULT = EngineConfig().max_num_batched_tokens  # one default, the engine's


class DeploymentKnobs(_Strict):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(1.0, ge=0.0)
    num_gpus: float = Field(0.0, ge=0.0)  # fractional allowed (shared placement on one GPU)


class EngineKnobs(DeploymentKnobs):
    max_num_seqs: int = Field(8, ge=1)
    kv_cache_memory_mb: int = Field(512, ge=1)
    # tokens one step may feed (running decodes first, then prompt chunks): bounds how long a long
    # prompt's prefill stalls the running decodes (chunked prefill)
    max_num_batched_tokens: int = Field(BATCHED_TOKENS_DEFAULT, ge=1)
    # share the K/V blocks of common prompt prefixes between requests (EngineConfig.prefix_caching)
    prefix_caching: bool = True


class DraftServerKnobs(DeploymentKnobs):
    port: int = Field(0, ge=0, le=65535)  # 0: an ephemeral port, published to the SpecEngine
    host: str | None = None  # bind/advertise address; None: this Ray node's IP (multi-node; under
    #                          Helm the pod IP), reachable by the SpecEngine and so protected by
    #                          auth (+ TLS, + the chart's NetworkPolicy); "127.0.0.1": one node only
    max_sequences: int = Field(4096, ge=1)  # per caller (SpecEngine replica); LRU past it
    timeout_s: float = Field(2.0, gt=0)  # longest a KVSync propose may take (the budget's cap)
    kv_cache_memory_mb: int = Field(512, ge=1)  # the draft model's own KV pool (model drafters)


class KVSyncKnobs(_Strict):
    """KVSync between the SpecEngine and the DraftServer (placement ``separate``). Auth: every call
    carries the ``auth`` section's bearer token when it is configured. TLS: on when a certificate
    and key are given (the SpecEngine trusts ``tls_ca_file``, default the certificate itself);
    ``tls_mutual`` makes it mutual (the SpecEngine presents a certificate the DraftServer checks)."""

    tls_cert_file: str | None = None  # DraftServer certificate chain (PEM)
    tls_key_file: str | None = None  # its private key (PEM)
    tls_ca_file: str | None = None  # CA bundle the SpecEngine verifies it with; None: the cert itself
    tls_server_name: str | None = None  # name expected in the certificate (the server is dialled by IP)
    tls_mutual: bool = False  # mutual TLS: the DraftServer demands a trusted client certificate
    tls_client_cert_file: str | None = None  # SpecEngine certificate; None: tls_cert_file (one identity)
    tls_client_key_file: str | None = None  # its key; None: tls_key_file
    tls_client_ca_file: str | None = None  # CA the DraftServer trusts clients by; None: tls_ca_file / the cert
    budget_factor: float = Field(4.0, gt=0)  # a propose may take this × the median target step...
    budget_floor_ms: float = Field(20.0, gt=0)  # ...but never less; draft_server.timeout_s caps it
    max_callers: int = Field(16, ge=1)  # SpecEngine replicas whose sequences a DraftServer holds

    @model_validator(mode="after")
    def _check(self) -> "KVSyncKnobs":
        self.tls()  # both-or-neither etc. (raises ValueError -> ValidationError)
        return self

    def tls(self):
        from cluster.kvsync.tls import KVSyncTLS

        return KVSyncTLS(cert_file=self.tls_cert_file, key_file=self.tls_key_file,
                         ca_file=self.tls_ca_file, server_name=self.tls_server_name,
                         mutual=self.tls_mutual, client_cert_file=self.tls_client_cert_file,
                         client_key_file=self.tls_client_key_file, client_ca_file=self.tls_client_ca_file)

    def budget(self, cap_s: float):
        from cluster.kvsync.budget import DraftBudget

        floor = min(self.budget_floor_ms / 1000, cap_s)
        return DraftBudget(factor=self.budget_factor, floor_s=floor, cap_s=cap_s)


class EngineImpl(_Strict):
    cls: str = "cluster.engine.process_engine:ProcessEngine"
    options: dict[str, Any] = Field(default_factory=dict)  # extra constructor keywords

    def load(self):
        module, _, name = self.cls.partition(":")
        if not name:
            raise ValueError(f"engine_impl.cls must be 'module:Class', got {self.cls!r}")
        return getattr(importlib.import_module(module), name)


class AppConfig(_Strict):
    model: str = "default"
    dtype: Literal["float32", "bfloat16"] = "float32"
    # ngram | suffix | portfolio | self | self:L | eagle | eagle:DIR | a draft model source | none;
    # portfolio: per sequence and step the best of n-gram, suffix (+ corpus) and, on the default
    # model, its shipped EAGLE head (docs/service.md#drafters: measured against n-gram)
    drafter: str = "portfolio"
    num_draft_tokens: int | Literal["auto"] = "auto"
    # the corpus of ``suffix`` and of the portfolio's suffix member: a file made by ``specserve
    # suffix-corpus`` (placement shared), "cold" for none; unset: the one shipped for the default model
    suffix_corpus: str | None = Field(None, min_length=1)
    force_vocab_mismatch: bool = False  # run a draft model whose tokenizer differs (α ~ 0; testing)
    placement: Placement = Placement.SHARED
    torch_threads: int = Field(1, ge=1)
    router: RouterKnobs = RouterKnobs()
    moe: MoeKnobs = MoeKnobs()
    limits: LimitsKnobs = LimitsKnobs()
    auth: AuthKnobs = AuthKnobs()
    http: HttpKnobs = HttpKnobs()
    telemetry: TelemetryKnobs = TelemetryKnobs()
    router_deployment: DeploymentKnobs = DeploymentKnobs(num_cpus=0.25)
    spec_engine: EngineKnobs = EngineKnobs(max_num_seqs=8)
    batch_engine: EngineKnobs = EngineKnobs(max_num_seqs=64)
    draft_server: DraftServerKnobs = DraftServerKnobs()
    kvsync: KVSyncKnobs = KVSyncKnobs()
    engine_impl: EngineImpl = EngineImpl()

    @model_validator(mode="after")
    def _check(self) -> "AppConfig":
        self.router_config()  # hysteresis ordering etc. (raises ValueError -> ValidationError)
        self.spec_config()
        if self.placement is Placement.SEPARATE and not self.speculative:
            raise ValueError("placement 'separate' needs a drafter (got drafter='none')")
        if self.placement is Placement.SEPARATE and self.drafter.strip().lower().startswith("portfolio:"):
            raise ValueError(f"drafter {self.drafter!r}: a portfolio holding an EAGLE head drafts beside the "
                             "target (placement 'shared'); the DraftServer of placement 'separate' serves the "
                             "model-free 'portfolio' or the head alone ('eagle:DIR')")
        from cluster.speculative.proposer import parse_drafter_choice

        choice = parse_drafter_choice(self.drafter)
        if self.placement is Placement.SEPARATE and choice is not None and choice.names_suffix_corpus:
            raise ValueError(f"drafter {self.drafter!r}: a suffix corpus is checked against the target that "
                             "wrote it, which the DraftServer of placement 'separate' does not load; use it "
                             "in placement 'shared', or 'suffix' (traffic only there)")
        if self.suffix_corpus is not None and not self.speculative:
            raise ValueError(f"suffix_corpus {self.suffix_corpus!r}: no SpecEngine runs (drafter 'none'), so no "
                             "suffix drafter would read it")
        if self.placement is Placement.SEPARATE and self.names_suffix_corpus_file:
            raise ValueError(f"suffix_corpus {self.suffix_corpus!r}: a suffix corpus is checked against the target "
                             "that wrote it, which the DraftServer of placement 'separate' does not load; use it "
                             "in placement 'shared' (the DraftServer's suffix drafter learns from traffic only)")
        self._check_segment_engine_settings()
        return self

    def _check_segment_engine_settings(self) -> None:
        """A segment's drafter / K must be able to take effect: a SpecEngine exists, the drafter
        string parses, and under placement ``separate`` (one DraftServer serving one drafter over
        KVSync) the drafter is the global one."""
        from cluster.speculative.proposer import parse_drafter_choice

        for name, own in self.router.segments.items():
            where = f"router.segments.{name}"
            if own.engine_settings and not self.speculative:
                raise ValueError(f"{where}: drafter / num_draft_tokens need a SpecEngine, but the global "
                                 "drafter is 'none' (no SpecEngine runs)")
            if own.drafter is None:
                continue
            try:
                parse_drafter_choice(own.drafter)
            except ValueError as exc:
                raise ValueError(f"{where}.drafter: {exc}") from None
            if self.placement is Placement.SEPARATE and own.drafter.strip() != self.drafter.strip():
                raise ValueError(
                    f"{where}.drafter {own.drafter!r}: placement 'separate' drafts in one DraftServer "
                    f"over KVSync, which serves the global drafter {self.drafter!r} only; use placement "
                    "'shared' for per-segment drafters, or drop this segment's drafter (its "
                    "num_draft_tokens still applies)")

    @property
    def names_suffix_corpus_file(self) -> bool:
        """``suffix_corpus`` names a file (checked against the target that wrote it)."""
        return self.suffix_corpus is not None and suffix_corpus_name(self.suffix_corpus) != COLD_SUFFIX

    @property
    def speculative(self) -> bool:
        return self.drafter.strip().lower() not in ("", "none")

    def router_config(self) -> RouterConfig:
        knobs = self.router.model_dump(exclude={"segments"})
        segments = {name: own.model_dump(exclude={"drafter", "num_draft_tokens"})
                    for name, own in self.router.segments.items()}
        return RouterConfig(**knobs, segments=segments, moe_probe_every=self.moe.probe_every)

    def limits_config(self) -> Limits:
        return Limits(max_tokens=self.limits.max_tokens,
                      default_max_tokens=min(128, self.limits.max_tokens),
                      max_prompt_tokens=self.limits.max_prompt_tokens,
                      max_message_bytes=self.limits.max_message_bytes,
                      max_stop_strings=self.limits.max_stop_strings,
                      max_stop_chars=self.limits.max_stop_chars,
                      max_constraint_chars=self.limits.max_constraint_chars,
                      max_constraint_repeat=self.limits.max_constraint_repeat,
                      max_choices=self.limits.max_choices)

    def proxy_max_message_bytes(self) -> int:
        """The gRPC proxy's own message cap (it reads requests before the Router sees them; it
        also caps what it sends): the request limit, or the largest unary response this app can
        produce if that is bigger (max_tokens x a generous 64 bytes per token, plus slack)."""
        return max(self.limits.max_message_bytes, self.limits.max_tokens * 64 + (64 << 10))

    def spec_config(self) -> SpecConfig | None:
        if not self.speculative:
            return None
        return SpecConfig(drafter=self.drafter, num_draft_tokens=self.num_draft_tokens,
                          suffix_corpus=self.suffix_corpus, force_vocab_mismatch=self.force_vocab_mismatch,
                          moe_validated=self.moe.validated,
                          moe_min_draft_tokens=self.moe.min_draft_tokens,
                          moe_alpha_threshold=self.moe.alpha_threshold,
                          segments={name: SegmentSpeculation(own.drafter, own.num_draft_tokens)
                                    for name, own in self.router.segments.items() if own.engine_settings})

    def kvsync_limits(self, vocab_size: int = 0):
        """What a DraftServer accepts from one SpecEngine: K up to the engine's max_draft_tokens, its batch,
        its context (prompt + output limits), ``draft_server.max_sequences`` per caller."""
        from cluster.kvsync.limits import KVSyncLimits

        spec = self.spec_config()
        return KVSyncLimits(max_draft_tokens=spec.max_draft_tokens if spec is not None else 1,
                            max_batch=self.spec_engine.max_num_seqs,
                            max_seq_tokens=self.limits.max_prompt_tokens + self.limits.max_tokens,
                            max_sequences=self.draft_server.max_sequences,
                            max_callers=self.kvsync.max_callers, vocab_size=vocab_size)

    def engine_config(self, speculative: bool) -> EngineConfig:
        knobs = self.spec_engine if speculative else self.batch_engine
        return EngineConfig(model=self.model, dtype=self.dtype, max_num_seqs=knobs.max_num_seqs,
                            kv_cache_memory_mb=knobs.kv_cache_memory_mb, max_queue=self.limits.max_queue,
                            max_num_batched_tokens=knobs.max_num_batched_tokens,
                            prefix_caching=knobs.prefix_caching, torch_threads=self.torch_threads,
                            grammar_compile_s=self.limits.constraint_compile_s,
                            spec=self.spec_config() if speculative else None)


# Ray Serve's gRPC proxy reads its max send/receive message size from this variable when the proxy
# process starts (default: 2 GiB): it must be in the environment of the process that starts Ray.
PROXY_MAX_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"


def proxy_env(apps: list[dict]) -> dict[str, str]:
    """Environment for the Ray node(s) serving ``apps`` (AppConfig args): the proxy refuses a
    message over the largest app's limit (RESOURCE_EXHAUSTED) without reading it into memory."""
    return {PROXY_MAX_MESSAGE_ENV: str(max(AppConfig(**a).proxy_max_message_bytes() for a in apps))}
