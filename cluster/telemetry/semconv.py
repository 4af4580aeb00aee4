"""Span names and attribute keys, named once.

Owns: the GenAI semantic-convention keys we emit (https://opentelemetry.io/docs/specs/semconv/gen-ai/),
the gRPC RPC keys, and the ``specserve.*`` namespace (route decision, speculation vocabulary of
arXiv 2211.17192: draft / accepted tokens, K, acceptance rate α). Ignores: how spans are made.
"""
from __future__ import annotations

# --- GenAI semantic conventions -------------------------------------------------------------
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"  # "text_completion" | "chat"
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ERROR_TYPE = "error.type"

OP_TEXT_COMPLETION = "text_completion"
OP_CHAT = "chat"
SYSTEM_NAME = "specserve"

# --- RPC (gRPC) semantic conventions --------------------------------------------------------
RPC_SYSTEM = "rpc.system"
RPC_SERVICE = "rpc.service"
RPC_METHOD = "rpc.method"
RPC_GRPC_STATUS_CODE = "rpc.grpc.status_code"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
NETWORK_PEER_ADDRESS = "network.peer.address"

# --- specserve namespace --------------------------------------------------------------------
ROUTE_PATH = "specserve.route.path"  # "speculative" | "plain"
ROUTE_REASON = "specserve.route.reason"
INFLIGHT = "specserve.inflight"
SEGMENT = "specserve.segment"
DRAFT_SCOPE = "specserve.draft_scope"  # the request's draft scope, when it sent one
REQUEST_ID = "specserve.request_id"
MODE = "specserve.mode"
TTFT_MS = "specserve.ttft_ms"
STREAM = "specserve.stream"
API = "specserve.api"  # the front end: "grpc" | "openai" (the OpenAI-compatible HTTP API)

ENGINE_KIND = "specserve.engine"  # "spec" | "batch"
PROMPT_TOKENS = "specserve.prompt_tokens"
OUTPUT_TOKENS = "specserve.output_tokens"
FINISH_REASON = "specserve.finish_reason"
PREEMPTIONS = "specserve.preemptions"

SPEC_DRAFTER = "specserve.spec.drafter"
SPEC_STEP = "specserve.spec.step"
SPEC_NUM_DRAFT_TOKENS = "specserve.spec.num_draft_tokens"
SPEC_ACCEPTED = "specserve.spec.accepted"
SPEC_STEPS = "specserve.spec.steps"
SPEC_DRAFT_TOKENS = "specserve.spec.draft_tokens"
SPEC_ACCEPTED_TOKENS = "specserve.spec.accepted_tokens"
SPEC_ALPHA = "specserve.spec.alpha"  # per position: accepted / (accepted + rejections)
SPEC_ACCEPTANCE_RATE = "specserve.spec.acceptance_rate"  # accepted / drafted
SPEC_MEAN_ACCEPTANCE_LENGTH = "specserve.spec.mean_acceptance_length"
SPEC_NUM_DRAFT_TOKENS_PER_STEP = "specserve.spec.num_draft_tokens_per_step"
SPEC_ACCEPTED_PER_STEP = "specserve.spec.accepted_per_step"
SPEC_EVENTS_DROPPED = "specserve.spec.step_events_dropped"
SPEC_FALLBACKS = "specserve.spec.fallbacks"
SPEC_RESYNCS = "specserve.spec.resyncs"
DRAFT_REASON = "specserve.draft.reason"
DRAFT_NUM_TOKENS = "specserve.draft.num_tokens"
KVSYNC_SAMPLED_REQUESTS = "specserve.kvsync.sampled_requests"  # traced requests this RPC served

# --- span and event names (low cardinality) -------------------------------------------------
SPAN_ENGINE = "specserve.engine.generate"
SPAN_QUEUE_WAIT = "specserve.queue_wait"
SPAN_PREFILL = "specserve.prefill"
SPAN_DECODE = "specserve.decode"
SPAN_SPEC_DECODE = "specserve.speculative_decode"
EVENT_SPEC_STEP = "spec.step"
EVENT_DRAFT_FALLBACK = "draft.fallback"
EVENT_DRAFT_RESYNC = "draft.resync"
EVENT_FIRST_TOKEN = "first_token"
EVENT_PREEMPTED = "preempted"
EVENT_ROUTE = "route.decided"
