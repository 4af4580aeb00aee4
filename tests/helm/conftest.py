"""Fixtures for the Helm chart tests: the chart rendered by the real Helm engine.

Helm runs in-process through `helm-python-sdk` (a ctypes binding to libhelm_c, Helm's Go SDK
built as a shared library): rendering, values.schema.json validation and lint are Helm's own.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "specserve"
EXAMPLES = CHART / "examples"
DATA = Path(__file__).resolve().parent / "data"
RELEASE = "specserve"
NAMESPACE = "llm"

# Everything optional switched on at once, so every template renders at least once.
FULL_VALUES = {
    "auth": {"create": True, "token": "s3cret"},
    "jaeger": {"enabled": True},
    "metrics": {"service": {"enabled": True}},
    "probes": {"liveness": {"enabled": True}},
    "modelCache": {"existingClaim": "models"},
    "extraEnv": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
    "extraVolumes": [{"name": "scratch", "emptyDir": {}}],
    "extraVolumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
    "imagePullSecrets": [{"name": "regcred"}],
    "podLabels": {"team": "llm"},
    "podAnnotations": {"example.com/owner": "llm"},
    "service": {"type": "LoadBalancer", "annotations": {"example.com/lb": "internal"}},
    "serviceAccountName": "specserve",
    "head": {"nodeSelector": {"pool": "cpu"}},
    "targetWorkers": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "gpu", "operator": "In", "values": ["l4", "a10"]}]}]}}}},
    "app": {"placement": "separate", "drafter": "/models/draft", "num_draft_tokens": 5},
    "networkPolicy": {"enabled": True,
                      "grpc": {"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}]},
                      "metrics": {"from": [{"namespaceSelector": {"matchLabels": {"team": "obs"}},
                                            "podSelector": {"matchExpressions": [
                                                {"key": "app", "operator": "In", "values": ["prometheus"]}]}}]},
                      "dashboard": {"from": [{"namespaceSelector": {"matchLabels": {"name": "kuberay"}}}]}},
}


def load_example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


SCENARIOS = {
    "default": lambda: {},
    "cpu": lambda: load_example("values-cpu.yaml"),
    "separate": lambda: load_example("values-separate.yaml"),
    "full": lambda: FULL_VALUES,
}


@pytest.fixture(scope="session")
def helm():
    return pytest.importorskip("helm_python", reason="helm-python-sdk (the dev extra) is not installed")


@pytest.fixture(scope="session")
def chart(helm):
    with helm.Chart.load(str(CHART)) as c:
        yield c


class Rendered:
    """One render: the manifests by template and the parsed objects."""

    def __init__(self, manifests: dict[str, str], values: dict):
        self.manifests = manifests
        self.values = values
        self.objects = [doc for name, text in manifests.items() if name.endswith(".yaml")
                        for doc in yaml.safe_load_all(text) if doc]

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict:
        found = [o for o in self.of_kind(kind) if name is None or o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
        return found[0]

    @property
    def rayservice(self) -> dict:
        return self.one("RayService")

    @property
    def serve_config(self) -> dict:
        return yaml.safe_load(self.rayservice["spec"]["serveConfigV2"])

    @property
    def app_args(self) -> dict:
        return self.serve_config["applications"][0]["args"]

    def groups(self) -> dict[str, dict]:
        return {g["groupName"]: g for g in self.rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]}

    def templates(self) -> list[dict]:
        rc = self.rayservice["spec"]["rayClusterConfig"]
        return [rc["headGroupSpec"]["template"]] + [g["template"] for g in rc["workerGroupSpecs"]]


@pytest.fixture(scope="session", params=sorted(SCENARIOS))
def rendered(request, chart) -> Rendered:
    values = SCENARIOS[request.param]()
    return Rendered(chart.render(values, name=RELEASE, namespace=NAMESPACE), values)


@pytest.fixture(scope="session")
def render(chart):
    def _render(values: dict) -> Rendered:
        return Rendered(chart.render(values, name=RELEASE, namespace=NAMESPACE), values)
    return _render
