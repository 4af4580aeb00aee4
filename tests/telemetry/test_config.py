"""TelemetryConfig precedence: OTEL_SDK_DISABLED > serve config > OTEL_* env > defaults."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.telemetry.config import TelemetryConfig


def test_defaults_are_off_without_an_endpoint():
    cfg = TelemetryConfig.resolve(None, env={})
    assert (cfg.enabled, cfg.otlp_endpoint, cfg.sampling_ratio, cfg.service_name, cfg.parent_based) == \
        (False, None, 1.0, "specserve", True)


def test_env_alone_enables_and_sets_everything():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317", "OTEL_SERVICE_NAME": "svc",
           "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    cfg = TelemetryConfig.resolve({}, env=env)
    assert (cfg.enabled, cfg.otlp_endpoint, cfg.sampling_ratio, cfg.service_name, cfg.parent_based) == \
        (True, "http://jaeger:4317", 0.25, "svc", True)
    assert cfg.use_insecure


def test_traces_endpoint_beats_generic_endpoint():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:4317"}
    assert TelemetryConfig.resolve(None, env=env).otlp_endpoint == "http://b:4317"


def test_serve_config_beats_env():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4317", "OTEL_SERVICE_NAME": "env-name",
           "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"}
    section = {"otlp_endpoint": "https://cfg:4317", "sampling_ratio": 0.1, "service_name": "cfg-name"}
    cfg = TelemetryConfig.resolve(section, env=env)
    assert (cfg.otlp_endpoint, cfg.sampling_ratio, cfg.service_name) == ("https://cfg:4317", 0.1, "cfg-name")
    assert cfg.parent_based is False  # from the env sampler, not overridden by the section
    assert not cfg.use_insecure  # https


def test_null_section_values_fall_through_to_env():
    # A pydantic-like section object whose fields are unset (None) must not mask the env.
    section = SimpleNamespace(otlp_endpoint=None, sampling_ratio=None, service_name=None)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317", "OTEL_SERVICE_NAME": "from-env"}
    cfg = TelemetryConfig.resolve(section, env=env)
    assert (cfg.enabled, cfg.otlp_endpoint, cfg.service_name, cfg.sampling_ratio) == \
        (True, "collector:4317", "from-env", 1.0)
    assert cfg.use_insecure  # no scheme: plaintext unless told otherwise
    env["OTEL_EXPORTER_OTLP_INSECURE"] = "false"
    assert not TelemetryConfig.resolve(section, env=env).use_insecure


def test_sdk_disabled_wins_over_everything():
    section = {"otlp_endpoint": "http://cfg:4317", "enabled": True}
    assert not TelemetryConfig.resolve(section, env={"OTEL_SDK_DISABLED": "true"}).enabled
    assert TelemetryConfig.resolve(section, env={"OTEL_SDK_DISABLED": "false"}).enabled


def test_config_can_switch_off_with_endpoint_present():
    cfg = TelemetryConfig.resolve({"enabled": False}, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317"})
    assert not cfg.enabled


@pytest.mark.parametrize("sampler,expected", [("always_on", (False, 1.0)), ("always_off", (False, 0.0)),
                                              ("parentbased_always_off", (True, 0.0))])
def test_sampler_names(sampler, expected):
    cfg = TelemetryConfig.resolve(None, env={"OTEL_TRACES_SAMPLER": sampler})
    assert (cfg.parent_based, cfg.sampling_ratio) == expected


@pytest.mark.parametrize("section,env,match", [
    ({"sampling_ratio": 1.5, "otlp_endpoint": "http://x:1"}, {}, "sampling_ratio"),
    ({"otlp_endpoint": "ftp://x:1"}, {}, "scheme"),
    ({"enabled": True}, {}, "needs an otlp_endpoint"),
    ({"bogus": 1}, {}, "unknown telemetry keys"),
    (None, {"OTEL_TRACES_SAMPLER": "jaeger_remote"}, "not supported"),
    (None, {"OTEL_SDK_DISABLED": "maybe"}, "boolean"),
])
def test_invalid_values_raise(section, env, match):
    with pytest.raises(ValueError, match=match):
        TelemetryConfig.resolve(section, env=env)
