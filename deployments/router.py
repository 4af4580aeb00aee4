"""Router: the ingress deployment behind Ray Serve's gRPC proxy and its HTTP proxy.

Owns: the ``specserve.v1.Generation`` methods (Generate, GenerateStream, ModelInfo, Tokenize and
Detokenize — the last two asked of a ready engine replica, where the tokenizer lives) and
``grpc.health.v1.Health/Check`` (Serve routes a gRPC call to the ingress method named like the
RPC); the OpenAI-compatible HTTP API on the same replica (``@serve.ingress``: Serve routes HTTP to
the ASGI app ``__serve_build_asgi_app__`` builds, ``deployments.openai_http``), which goes through
the same ``admit`` (auth, the shared validation, the route decision) and ``forward``;
bearer auth, request validation, the route decision (``cluster.routing.policy``) from its
own in-flight counts, the latency of the requests it saw complete (per path and segment, for
overflow balancing; shown in ModelInfo) and the engines' polled stats (readiness, α per segment, MoE gate),
forwarding to SpecEngine/BatchEngine through streaming handles (unary ``Generate`` asks the engine
for the whole response as one message; ``GenerateStream`` relays every delta), and mapping failures to gRPC
codes via ``grpc_context`` (set code + details, then return an empty message / raise in streams).
Every request gets its own server id (uuid: the engine's request id, the KVSync seq id, the id in
``internal error (id ...)`` messages); the client's ``request_id`` metadata is only a label, echoed
in the response's ``request_id`` and logged/traced beside the server id, so two clients sending the
same label cannot touch each other's requests. Failure hygiene: an engine's ERROR finish is
INTERNAL with the engine's message; a dead engine replica is UNAVAILABLE; any other unexpected
exception is INTERNAL ``internal error (id ...)`` with the detail (traceback, Ray ids) in the log
only. Constraint syntax checks (JSON Schema / regex, size-capped) run in a small thread pool, off
the event loop every request shares.
Every decision is visible: ``route`` in the response, a span attribute, and the
``specserve_route_decisions`` metric. In-flight hysteresis is per Router replica: with R replicas,
divide the thresholds by R. Health checks are exempt from auth (probes send no metadata).
Ignores: tokenization (engine side), engine internals.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import grpc
from ray import serve
from ray.exceptions import RayActorError
from ray.serve import metrics
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from cluster.api import stubs
from cluster.api.auth import check_bearer
from cluster.api.requests import (
    RequestFields, ValidatedRequest, check_constraint, check_known_fields, check_size, fields_from_proto,
    known_request_fields, prompt_input, request_label, validate_fields,
)
from cluster.api.responses import Accumulator, chunk
from cluster.api.status import ENGINE_GONE, EngineFailure, ServiceError, internal_error
from cluster.common.config import SpecConfig
from cluster.common.acceptance_class import acceptance_class
from cluster.common.request import FinishReason, SpecMode
from cluster.common.segments import SegmentLabels
from cluster.routing.load_latency import InFlightMeter
from cluster.routing.policy import EngineView, Path, RequestFeatures, RouteDecision, RouteReason, RouterPolicy
from cluster.telemetry.metrics import SpecserveMetrics
from cluster.telemetry.router_telemetry import API_GRPC, RequestTelemetry
from cluster.telemetry.tracing import configure_from_section
from deployments.app_config import PROXY_MAX_MESSAGE_ENV, AppConfig

log = logging.getLogger("specserve.router")
_POLL_S = 0.5
_CALL_TIMEOUT_S = 5.0
_UNMEASURED = (FinishReason.CANCELLED, FinishReason.ERROR)  # say nothing about a path's speed
_CHECK_THREADS = 2  # constraint checks at once; more wait their turn, the event loop never does
_GONE = (RayActorError, DeploymentUnavailableError)  # the engine replica died or has none ready


def engine_error(message: str | None, request_id: str) -> ServiceError:
    """An engine's ERROR finish: its message (it names what failed) with the id to quote."""
    text = (message or "the engine failed this request").strip()[:512]
    return ServiceError(grpc.StatusCode.INTERNAL, f"{text} (id {request_id})")


def unexpected_error(exc: Exception, request_id: str, label: str) -> ServiceError:
    """An exception nobody turned into a status: a clear code for the client, detail to the log."""
    if isinstance(exc, BackPressureError):
        log.warning("request %s (label %r) refused: %s", request_id, label, exc)
        return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the service is at capacity; retry later")
    if isinstance(exc, _GONE):
        log.warning("request %s (label %r): engine replica unavailable: %s", request_id, label, exc)
        return ServiceError(grpc.StatusCode.UNAVAILABLE, ENGINE_GONE)
    log.error("request %s (label %r) failed", request_id, label, exc_info=exc)
    return internal_error(request_id)


def segment_routing_pb(pb2, policy: RouterPolicy, view: EngineView, spec: SpecConfig | None = None) -> list:
    """ModelInfo's ``segment_routing``: the settings in force for segments with their own — the
    Router's and (``spec``: the SpecEngine's config, None without one) the drafter and K policy."""
    out = []
    for seg, enter, exit_, alpha, auto in policy.segment_settings(view):
        own = spec.segments.get(seg) if spec is not None else None
        engine = (dict(drafter="none", num_draft_tokens="0") if spec is None else
                  dict(drafter=spec.drafter_for(seg), num_draft_tokens=str(spec.k_policy(seg)),
                       own_drafter=own is not None and own.drafter is not None,
                       own_num_draft_tokens=own is not None and own.num_draft_tokens is not None))
        out.append(pb2.SegmentRouting(segment=seg, enter_threshold=enter, exit_threshold=exit_, min_alpha=alpha,
                                      min_alpha_auto=auto, **engine))
    return out


@serve.deployment(name="Router", max_ongoing_requests=2048)
@serve.ingress()  # HTTP: the app __serve_build_asgi_app__ builds; gRPC: the methods below
class Router:
    async def __init__(self, spec_engine, batch_engine, config: dict, response_store=None) -> None:
        self.cfg = AppConfig(**config)  # not ``self.app``: the ASGI wrapper's property (the HTTP app)
        self.policy = RouterPolicy(self.cfg.router_config())
        self.limits = self.cfg.limits_config()
        self.segments = SegmentLabels(self.cfg.limits.max_segments, configured=self.cfg.router.segments)
        self.token = None
        if self.cfg.auth.token_env:
            self.token = os.environ.get(self.cfg.auth.token_env) or None
            if self.token is None:
                raise ValueError(f"auth.token_env={self.cfg.auth.token_env!r} is configured but that "
                                 "environment variable is empty in the Router replica")
        self.spec_engine, self.batch = spec_engine, batch_engine  # spec_engine is None without a drafter
        self.response_store = response_store  # /v1/responses' stored responses (None: store refused)
        # sequences each engine side runs at once, for overflow balancing (policy rule 8); in-flight
        # counts are per Router replica, so each replica plans with its share of the slots
        share = self.cfg.router_deployment.num_replicas
        spec, batch = self.cfg.spec_engine, self.cfg.batch_engine
        # requests forwarded, not yet done, per path (and how many ran beside each)
        self.load = InFlightMeter({
            Path.SPECULATIVE: max(1, round(spec.max_num_seqs * spec.num_replicas / share)),
            Path.PLAIN: max(1, round(batch.max_num_seqs * batch.num_replicas / share))})
        self._spec_stats: dict = {}
        self._batch_stats: dict = {}
        configure_from_section(self.cfg.telemetry)
        self.metrics = SpecserveMetrics()  # specserve_* via Ray Serve metrics
        self._routes = metrics.Counter("specserve_route_decisions",
                                       description="Router decisions by path and reason",
                                       tag_keys=("path", "reason"))
        self._checker = ThreadPoolExecutor(_CHECK_THREADS, thread_name_prefix="constraint-check")
        if not os.environ.get(PROXY_MAX_MESSAGE_ENV):  # `serve deploy` on a cluster started without it
            log.warning("%s is unset on this node: Ray Serve's gRPC proxy reads messages up to 2 GiB before "
                        "this Router refuses them over %d bytes; set it to %d where Ray starts",
                        PROXY_MAX_MESSAGE_ENV, self.limits.max_message_bytes, self.cfg.proxy_max_message_bytes())
        self._poll_task = asyncio.create_task(self._poll_loop())

    def __serve_build_asgi_app__(self):  # noqa: PLW3201 (Ray Serve's late-bound ASGI hook)
        from deployments.openai_http import build_openai_app

        return build_openai_app(self)

    @property
    def served_model(self) -> str:
        """The model name HTTP clients pass (``model``) and ``/v1/models`` lists."""
        return self.cfg.http.served_model_name or self.cfg.model

    # -- engine view -----------------------------------------------------------------------
    async def _stats(self, handle) -> dict:
        if handle is None:
            return {}
        try:
            return await asyncio.wait_for(handle.stats.remote(), timeout=_CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 (replica down or restarting: not ready)
            log.warning("stats call failed: %r", exc)
            return {"ready": False}

    async def _refresh(self) -> None:
        self._spec_stats, self._batch_stats = await asyncio.gather(self._stats(self.spec_engine),
                                                                   self._stats(self.batch))

    async def _poll_loop(self) -> None:
        while True:
            await self._refresh()
            await asyncio.sleep(_POLL_S)

    @property
    def spec_ready(self) -> bool:
        return bool(self._spec_stats.get("ready"))

    @property
    def batch_ready(self) -> bool:
        return bool(self._batch_stats.get("ready"))

    def _view(self) -> EngineView:
        s = self._spec_stats
        return EngineView.from_spec_by_segment(
            s.get("spec_by_segment", {}), spec_available=self.spec_engine is not None and self.spec_ready,
            spec_in_flight=self.spec_in_flight, plain_in_flight=self.load.count(Path.PLAIN),
            spec_capacity=self.load.capacities[Path.SPECULATIVE],
            plain_capacity=self.load.capacities[Path.PLAIN],
            moe=bool(s.get("moe", False)),
            moe_gate_open=bool(s.get("moe_gate_open", True)), break_even_alpha=s.get("break_even_alpha"),
            paths_shared=self.paths_share_hardware)

    @property
    def paths_share_hardware(self) -> bool:
        """Do the two engines compete for the same hardware? Configured, or ("auto") both report
        the same Ray node and do not each hold whole GPUs of their own."""
        mode = self.cfg.router.paths_share_hardware
        if mode != "auto":
            return bool(mode)
        spec_node, batch_node = self._spec_stats.get("node_id"), self._batch_stats.get("node_id")
        own_gpus = self.cfg.spec_engine.num_gpus >= 1 and self.cfg.batch_engine.num_gpus >= 1
        return bool(spec_node) and spec_node == batch_node and not own_gpus

    # -- request path ----------------------------------------------------------------------
    async def admit(self, metadata, request_id: str,
                    read: Callable[[], RequestFields]) -> tuple[ValidatedRequest, RouteDecision]:
        """Auth, then ``read()`` (the front end's wire -> ``RequestFields``), the shared validation
        and the route decision; ``metadata``: (key, value) pairs (gRPC metadata, HTTP headers)."""
        check_bearer(metadata, self.token)
        fields = read()
        vreq = validate_fields(fields, request_id, self.limits, label=request_label(metadata, self.limits),
                               constraints=False)
        if vreq.constrained:
            await asyncio.get_running_loop().run_in_executor(self._checker, check_constraint,
                                                             fields.json_schema, fields.regex, fields.grammar)
        segment = self.segments.label(vreq.segment)
        if segment != vreq.segment:  # past limits.max_segments distinct labels
            vreq = dataclasses.replace(vreq, segment=segment)
        decision = self.policy.decide(
            RequestFeatures(mode=vreq.mode, constrained=vreq.constrained, segment=vreq.segment,
                            predicted=bool(vreq.prediction), scoring=vreq.params.scores_only,
                            acceptance_class=acceptance_class(vreq.params)),
            self._view())
        ready = self.spec_ready if decision.path is Path.SPECULATIVE else self.batch_ready
        if not ready:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"the {decision.path.value} engine is not ready yet; retry later")
        self._routes.inc(tags={"path": decision.path.value, "reason": decision.reason.value})
        if decision.reason is RouteReason.PROBE_MOE_UNVALIDATED:  # the mark the SpecEngine drafts on
            vreq = dataclasses.replace(vreq, mode=SpecMode.SPECULATIVE)
        log.debug("request %s (label %r) -> %s (%s)", vreq.request_id, vreq.label, decision.path.value,
                  decision.reason.value)
        return vreq, decision

    @property
    def spec_in_flight(self) -> int:
        return self.load.count(Path.SPECULATIVE)

    async def forward(self, vreq: ValidatedRequest, decision: RouteDecision, carrier: dict[str, str],
                      whole: bool = False):
        handle = self.spec_engine if decision.path is Path.SPECULATIVE else self.batch
        mark = self.load.enter(decision.path)
        self.metrics.set_inflight(decision.path, self.load.count(decision.path))
        done = False
        gen = handle.options(stream=True).generate.remote(vreq, carrier, whole)  # trace context rides along
        try:
            async for item in gen:
                if isinstance(item, EngineFailure):
                    done = True
                    raise item.to_service_error()
                done = item.finished
                if done and item.finish_reason is FinishReason.ERROR:  # this request failed, alone
                    raise engine_error(item.error, vreq.request_id)
                if done and item.finish_reason not in _UNMEASURED:  # latency under load (rule 8)
                    seen = self.load.served(mark, item.queue_time)
                    self.policy.observe(decision.path, vreq.segment, seen.running, seen.service_s,
                                        item.num_output_tokens, seen.beside if self.paths_share_hardware else 0.0)
                yield item
        finally:
            self.load.leave(mark)
            self.metrics.set_inflight(decision.path, self.load.count(decision.path))
            if not done:  # client cancelled / deadline: stop the engine-side request
                gen.cancel()

    @staticmethod
    def _fail(grpc_context, exc: ServiceError) -> None:
        grpc_context.set_code(exc.code)
        grpc_context.set_details(exc.message)

    def _label(self, metadata) -> str:
        """The client's label for logs, before (or whether or not) the request validates."""
        cap = self.limits.max_label_chars
        return next((str(v)[:cap] for k, v in metadata if k == "request_id"), "")

    def failure(self, exc: Exception, request_id: str, metadata, tel: RequestTelemetry) -> ServiceError:
        """Any failure of a request as the ``ServiceError`` the client gets, traced."""
        err = exc if isinstance(exc, ServiceError) else unexpected_error(exc, request_id, self._label(metadata))
        tel.error(err.message, err.code.name)
        return err

    def _failed(self, exc: Exception, request_id: str, grpc_context, tel: RequestTelemetry) -> ServiceError:
        """``failure`` set on the gRPC context."""
        err = self.failure(exc, request_id, grpc_context.invocation_metadata(), tel)
        self._fail(grpc_context, err)
        return err

    def _grpc_fields(self, request) -> Callable[[], RequestFields]:
        return lambda: fields_from_proto(request, self.limits)

    # -- gRPC methods ----------------------------------------------------------------------
    async def Generate(self, request, grpc_context):  # noqa: N802 (gRPC naming)
        request_id = uuid.uuid4().hex
        metadata = grpc_context.invocation_metadata()
        with RequestTelemetry(self.metrics, model=self.cfg.model, metadata=metadata, api=API_GRPC) as tel:
            try:
                vreq, decision = await self.admit(metadata, request_id, self._grpc_fields(request))
                tel.routed(vreq, decision, inflight=self.spec_in_flight)
                acc = Accumulator(vreq.echo_id, decision)
                async for out in self.forward(vreq, decision, tel.carrier(), whole=True):
                    tel.output(out)
                    acc.add(out)
                return acc.response()
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                self._failed(exc, request_id, grpc_context, tel)
                return stubs.generation_pb2().GenerateResponse()

    async def GenerateStream(self, request, grpc_context):  # noqa: N802
        request_id = uuid.uuid4().hex
        metadata = grpc_context.invocation_metadata()
        with RequestTelemetry(self.metrics, model=self.cfg.model, stream=True, metadata=metadata,
                              api=API_GRPC) as tel:
            try:
                vreq, decision = await self.admit(metadata, request_id, self._grpc_fields(request))
                tel.routed(vreq, decision, inflight=self.spec_in_flight)
                first, total = True, 0
                async for out in self.forward(vreq, decision, tel.carrier()):
                    tel.output(out)
                    total += len(out.new_token_ids)
                    yield chunk(out, decision, first, total, request_id=vreq.echo_id)
                    first = False
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                # A stream carries its status only through an exception once the code is set; the
                # code's details, not the exception's text, are what the client sees.
                raise self._failed(exc, request_id, grpc_context, tel) from None

    async def ModelInfo(self, request, grpc_context):  # noqa: N802
        pb2 = stubs.generation_pb2()

        async def answer():
            check_bearer(grpc_context.invocation_metadata(), self.token)
            return await self._model_info(pb2)

        return await self._answer(grpc_context, answer, pb2.ModelInfoResponse())

    async def Tokenize(self, request, grpc_context):  # noqa: N802
        pb2 = stubs.generation_pb2()

        def read():
            check_known_fields(request)
            return request.prompt, [(m.role, m.content) for m in request.messages]

        async def answer():
            out = await self.tokenize(grpc_context.invocation_metadata(), read, request.ByteSize())
            return pb2.TokenizeResponse(token_ids=out["token_ids"], count=len(out["token_ids"]),
                                        max_model_len=out["max_model_len"],
                                        max_prompt_tokens=self.limits.max_prompt_tokens)

        return await self._answer(grpc_context, answer, pb2.TokenizeResponse())

    async def Detokenize(self, request, grpc_context):  # noqa: N802
        pb2 = stubs.generation_pb2()

        def read():
            check_known_fields(request)
            return list(request.token_ids)

        async def answer():
            text = await self.detokenize(grpc_context.invocation_metadata(), read, request.ByteSize())
            return pb2.DetokenizeResponse(text=text)

        return await self._answer(grpc_context, answer, pb2.DetokenizeResponse())

    async def _answer(self, grpc_context, answer, empty):
        """A unary method outside generation: ``await answer()``, or ``empty`` with the failure's
        status set (an unexpected failure's detail logged, the client told its id only)."""
        try:
            return await answer()
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            self._fail(grpc_context, self.plain_failure(exc, grpc_context.invocation_metadata()))
        return empty

    def plain_failure(self, exc: Exception, metadata) -> ServiceError:
        """A failure outside a generation request (no telemetry of its own) as a ``ServiceError``."""
        return exc if isinstance(exc, ServiceError) else unexpected_error(exc, uuid.uuid4().hex, self._label(metadata))

    async def tokenize(self, metadata, read: Callable[[], tuple[str, list[tuple[str, str]]]], size: int) -> dict:
        """The ids Generate would feed the model for a prompt or chat, from an engine replica
        (the tokenizer lives next to the model): {"token_ids", "max_model_len"}. Auth first, then
        the size cap, ``read()`` (the front end's wire -> (prompt, messages)) and the prompt rules:
        the generation request's own."""
        check_bearer(metadata, self.token)
        check_size(size, self.limits)
        prompt, messages = read()
        prompt_in = prompt_input(RequestFields(size=size, prompt=prompt or None, messages=tuple(messages) or None))
        return await self._engine_call("tokenize", prompt_in)

    async def detokenize(self, metadata, read: Callable[[], list[int]], size: int) -> str:
        """The text token ids stand for, from an engine replica (``read()``: the ids off the wire)."""
        check_bearer(metadata, self.token)
        check_size(size, self.limits)
        return await self._engine_call("detokenize", read())

    async def _engine_call(self, method: str, *args):
        """``method`` of a ready engine replica (the BatchEngine's, else the SpecEngine's); its
        ``EngineFailure`` as the ``ServiceError`` it maps to."""
        handle = (self.batch if self.batch_ready else self.spec_engine if self.spec_ready else None)
        if handle is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no engine is ready yet; retry later")
        out = await asyncio.wait_for(getattr(handle, method).remote(*args), timeout=_CALL_TIMEOUT_S)
        if isinstance(out, EngineFailure):
            raise out.to_service_error()
        return out

    async def _model_info(self, pb2):
        info: dict = {}
        for handle in (self.batch, self.spec_engine):
            if handle is not None and not info:
                try:
                    info = await asyncio.wait_for(handle.model_info.remote(), timeout=_CALL_TIMEOUT_S)
                except Exception:  # noqa: BLE001 (a replica down: ask the next, else answer from the config)
                    info = {}
        a, r = self.cfg, self.cfg.router
        return pb2.ModelInfoResponse(
            model=str(info.get("name") or a.model), architecture=str(info.get("architecture") or ""),
            vocab_size=int(info.get("vocab_size") or 0), max_model_len=int(info.get("max_model_len") or 0),
            dtype=a.dtype, moe=bool(info.get("moe", False)), drafter=a.drafter,
            num_draft_tokens=str(a.num_draft_tokens), placement=a.placement.value,
            max_tokens=self.limits.max_tokens, max_prompt_tokens=self.limits.max_prompt_tokens,
            enter_threshold=r.enter_threshold, exit_threshold=r.exit_threshold,
            min_alpha=self.policy.min_alpha(self._view()), min_alpha_auto=r.min_alpha == "auto",
            spec_ready=self.spec_ready, batch_ready=self.batch_ready, spec_in_flight=self.spec_in_flight,
            plain_in_flight=self.load.count(Path.PLAIN), path_latency=self._path_latency_pb(pb2),
            segment_routing=segment_routing_pb(pb2, self.policy, self._view(), a.spec_config()),
            paths_share_hardware=self.paths_share_hardware, request_fields=known_request_fields(pb2))

    def _path_latency_pb(self, pb2) -> list:
        paths = {Path.SPECULATIVE: pb2.PATH_SPECULATIVE, Path.PLAIN: pb2.PATH_PLAIN}
        return [pb2.PathLatency(segment=segment, path=paths[path], samples=int(fit["samples"]),
                                base_s=fit["a"], per_running_s=fit["s"], per_beside_s=fit["t"],
                                capacity=self.load.capacities[path])
                for segment, by_path in self.policy.latency.snapshot().items()
                for path, fit in by_path.items()]

    async def serving(self) -> bool:
        """Every engine ready, asked now (a probe wants the truth, not the last poll)."""
        await self._refresh()
        return self.batch_ready and (self.spec_engine is None or self.spec_ready)

    async def Check(self, request, grpc_context):  # noqa: N802 (grpc.health.v1)
        from grpc_health.v1 import health_pb2

        known = ("", "specserve.v1.Generation")
        if request.service not in known:
            self._fail(grpc_context, ServiceError(grpc.StatusCode.NOT_FOUND,
                                                  f"unknown service {request.service!r}"))
            return health_pb2.HealthCheckResponse()
        ok = await self.serving()
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)
