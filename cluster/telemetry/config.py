"""Telemetry configuration: one validated dataclass resolved from the serve config and ``OTEL_*``.

Owns: which values win when the serve-config ``telemetry:`` section and the standard OpenTelemetry
environment variables disagree, and their validation. Ignores: building providers/exporters
(``tracing``) and metrics (``metrics``).

Precedence, highest first:

1. ``OTEL_SDK_DISABLED=true`` in the environment turns tracing off, whatever the config says
   (the OpenTelemetry kill switch; an operator must be able to silence a replica without
   redeploying its config).
2. A value set explicitly in the serve-config ``telemetry:`` section (``otlp_endpoint``,
   ``sampling_ratio``, ``service_name``, ``enabled``). ``null``/absent means "not set here".
3. The standard environment variables:
   ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` then ``OTEL_EXPORTER_OTLP_ENDPOINT``;
   ``OTEL_SERVICE_NAME``; ``OTEL_TRACES_SAMPLER`` (+ ``OTEL_TRACES_SAMPLER_ARG``);
   ``OTEL_EXPORTER_OTLP_INSECURE`` (only for endpoints without a scheme).
4. Built-in defaults: no endpoint (tracing off), sampling ratio 1.0 parent-based,
   service name ``specserve``.

Tracing is enabled when an endpoint is known and nothing above disabled it: there is no implicit
``localhost:4317`` — a replica without a collector must not spend time retrying exports.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import urlparse

DEFAULT_SERVICE_NAME = "specserve"

# OTEL_TRACES_SAMPLER values we honour -> (parent_based, fixed ratio or None = use the _ARG).
_SAMPLERS: dict[str, tuple[bool, float | None]] = {
    "always_on": (False, 1.0),
    "always_off": (False, 0.0),
    "traceidratio": (False, None),
    "parentbased_always_on": (True, 1.0),
    "parentbased_always_off": (True, 0.0),
    "parentbased_traceidratio": (True, None),
}

_SECTION_KEYS = {"otlp_endpoint", "sampling_ratio", "service_name", "enabled", "parent_based",
                 "insecure", "max_step_events"}


def _env_bool(value: str | None) -> bool | None:
    if value is None or value.strip() == "":
        return None
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


@dataclass(slots=True)
class TelemetryConfig:
    """Resolved tracing settings for one process.

    enabled: export spans at all. otlp_endpoint: OTLP/gRPC collector (``http://host:4317``,
    ``https://...`` or ``host:4317``). sampling_ratio: fraction of new traces kept (a sampled
    parent from the client's ``traceparent`` is always followed when parent_based).
    insecure: plaintext gRPC to the collector; None = derive from the endpoint scheme.
    max_step_events: per-step speculative events kept on one decode span (the full per-step K and
    accepted arrays are attributes regardless).
    """

    enabled: bool = False
    otlp_endpoint: str | None = None
    sampling_ratio: float = 1.0
    service_name: str = DEFAULT_SERVICE_NAME
    parent_based: bool = True
    insecure: bool | None = None
    max_step_events: int = 128

    def __post_init__(self) -> None:
        if not isinstance(self.sampling_ratio, (int, float)) or not 0.0 <= float(self.sampling_ratio) <= 1.0:
            raise ValueError(f"telemetry.sampling_ratio must be in [0, 1], got {self.sampling_ratio!r}")
        self.sampling_ratio = float(self.sampling_ratio)
        if not self.service_name or not isinstance(self.service_name, str):
            raise ValueError("telemetry.service_name must be a non-empty string")
        if self.otlp_endpoint is not None:
            if not isinstance(self.otlp_endpoint, str) or not self.otlp_endpoint.strip():
                raise ValueError("telemetry.otlp_endpoint must be a non-empty string or null")
            self.otlp_endpoint = self.otlp_endpoint.strip()
            scheme = urlparse(self.otlp_endpoint).scheme if "://" in self.otlp_endpoint else ""
            if scheme not in ("", "http", "https"):
                raise ValueError(f"telemetry.otlp_endpoint scheme must be http, https or none, "
                                 f"got {self.otlp_endpoint!r}")
        if self.enabled and self.otlp_endpoint is None:
            raise ValueError("telemetry.enabled needs an otlp_endpoint (config or OTEL_EXPORTER_OTLP_ENDPOINT)")
        if not isinstance(self.max_step_events, int) or self.max_step_events < 0:
            raise ValueError(f"telemetry.max_step_events must be an integer >= 0, got {self.max_step_events!r}")

    @property
    def use_insecure(self) -> bool:
        """Plaintext gRPC: http:// yes, https:// no, no scheme -> ``insecure`` (default yes)."""
        assert self.otlp_endpoint is not None
        if self.otlp_endpoint.startswith("https://"):
            return False
        if self.otlp_endpoint.startswith("http://"):
            return True
        return True if self.insecure is None else self.insecure

    @classmethod
    def disabled(cls) -> "TelemetryConfig":
        return cls(enabled=False)

    @classmethod
    def resolve(cls, section: Mapping[str, Any] | Any | None = None,
                env: Mapping[str, str] | None = None) -> "TelemetryConfig":
        """Merge a serve-config ``telemetry`` section (a mapping or an object with those attributes,
        e.g. the pydantic AppConfig model) with the environment, by the precedence above."""
        env = os.environ if env is None else env
        sec = _section_to_dict(section)

        def pick(key: str) -> Any:
            return sec.get(key)

        # Environment layer.
        env_endpoint = (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                        or None)
        env_service = env.get("OTEL_SERVICE_NAME") or None
        env_parent_based, env_ratio = True, None
        sampler = (env.get("OTEL_TRACES_SAMPLER") or "").strip().lower()
        if sampler:
            if sampler not in _SAMPLERS:
                raise ValueError(f"OTEL_TRACES_SAMPLER={sampler!r} is not supported; use one of {sorted(_SAMPLERS)}")
            env_parent_based, env_ratio = _SAMPLERS[sampler]
            if env_ratio is None:
                arg = env.get("OTEL_TRACES_SAMPLER_ARG")
                env_ratio = float(arg) if arg not in (None, "") else 1.0
        env_insecure = _env_bool(env.get("OTEL_EXPORTER_OTLP_INSECURE"))

        endpoint = pick("otlp_endpoint") or env_endpoint
        ratio = pick("sampling_ratio")
        ratio = ratio if ratio is not None else (env_ratio if env_ratio is not None else 1.0)
        parent_based = pick("parent_based")
        parent_based = parent_based if parent_based is not None else env_parent_based
        service = pick("service_name") or env_service or DEFAULT_SERVICE_NAME
        insecure = pick("insecure")
        insecure = insecure if insecure is not None else env_insecure
        max_events = pick("max_step_events")
        max_events = 128 if max_events is None else max_events

        enabled_cfg = pick("enabled")
        enabled = endpoint is not None if enabled_cfg is None else bool(enabled_cfg)
        if _env_bool(env.get("OTEL_SDK_DISABLED")):
            enabled = False
        return cls(enabled=enabled, otlp_endpoint=endpoint, sampling_ratio=ratio, service_name=service,
                   parent_based=parent_based, insecure=insecure, max_step_events=max_events)


def _section_to_dict(section: Any) -> dict[str, Any]:
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        # A validated config object (e.g. the pydantic AppConfig section): take the known fields.
        return {k: getattr(section, k) for k in _SECTION_KEYS if hasattr(section, k)}
    d = dict(section)
    unknown = set(d) - _SECTION_KEYS
    if unknown:
        raise ValueError(f"unknown telemetry keys {sorted(unknown)}; allowed: {sorted(_SECTION_KEYS)}")
    return d
