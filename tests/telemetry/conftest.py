"""Fixtures: one real OTLP receiver per session, tracing configured to export to it."""
from __future__ import annotations

import pytest

from cluster.telemetry import tracing
from cluster.telemetry.config import TelemetryConfig
from tests.telemetry.otlp_receiver import OtlpReceiver


@pytest.fixture(scope="session")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.fixture
def traced(receiver):
    """Tracing on, exporting over OTLP/gRPC to the test receiver, sampling everything."""
    receiver.clear()
    assert tracing.configure_tracing(TelemetryConfig.resolve(
        {"otlp_endpoint": receiver.endpoint, "sampling_ratio": 1.0, "service_name": "specserve-test"}, env={}))
    yield receiver
    tracing.shutdown_tracing()
