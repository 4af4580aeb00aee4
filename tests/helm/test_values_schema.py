"""values.schema.json and lint: Helm's own schema check rejects bad values before anything
reaches the cluster, and the chart lints clean for the shipped values files."""
from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

from .conftest import CHART, SCENARIOS


def test_schema_is_valid_draft7():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    # independent of Helm: the shipped defaults satisfy it
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), schema)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_lint_clean(helm, scenario):
    report = helm.lint(str(CHART), SCENARIOS[scenario](), strict=True, namespace="llm")
    assert report["errors"] == []
    serious = [m for m in report["messages"] if m["severity"] >= 2]
    assert serious == [], serious


def test_chart_metadata(chart):
    meta = chart.metadata
    assert meta["apiVersion"] == "v2" and meta["name"] == "specserve"
    assert meta["version"] and meta["appVersion"]
    assert chart.schema is not None
    names = {t["name"] for t in chart.templates}
    assert {"templates/rayservice.yaml", "templates/service.yaml", "templates/NOTES.txt",
            "templates/_helpers.tpl"} <= names


BAD_VALUES = {
    "placement": {"app": {"placement": "weird"}},
    "dtype": {"app": {"dtype": "float16"}},
    "num_draft_tokens word": {"app": {"num_draft_tokens": "many"}},
    "num_draft_tokens negative": {"app": {"num_draft_tokens": -1}},
    "num_draft_tokens too large": {"app": {"num_draft_tokens": 17}},
    "separate without drafter": {"app": {"placement": "separate", "drafter": "none"}},
    "enter threshold zero": {"app": {"router": {"enter_threshold": 0}}},
    "unknown engine knob": {"app": {"spec_engine": {"gpu_memory_utilization": 0.9}}},
    "unknown app arg": {"app": {"temperature": 0.7}},
    "unknown top-level key": {"replicaCount": 3},
    "sampling ratio": {"tracing": {"samplingRatio": 1.5}},
    "otlp endpoint scheme": {"tracing": {"otlpEndpoint": "collector:4317"}},
    "min_alpha": {"app": {"router": {"min_alpha": 2}}},
    "zero replicas": {"app": {"spec_engine": {"num_replicas": 0}}},
    "negative gpus": {"app": {"batch_engine": {"num_gpus": -1}}},
    "rayStartParams not string": {"head": {"rayStartParams": {"num-cpus": 0}}},
    "group name": {"targetWorkers": {"groupName": "GPU_Workers"}},
    "service port": {"service": {"port": 70000}},
    "pull policy": {"image": {"pullPolicy": "Sometimes"}},
    "servicer path": {"serve": {"grpcServicerFunctions": ["not a path"]}},
    "dashboard host empty": {"head": {"dashboardHost": ""}},
    "expose dashboard not bool": {"head": {"exposeDashboard": "yes"}},
    "network policy peer typo": {"networkPolicy": {"grpc": {"from": [{"podSelectr": {}}]}}},
    "network policy empty peer": {"networkPolicy": {"metrics": {"from": [{}]}}},
    "network policy ipBlock without cidr": {"networkPolicy": {"dashboard": {"from": [{"ipBlock": {}}]}}},
    "moe alpha threshold": {"app": {"moe": {"alpha_threshold": 1.5}}},
    "moe window zero": {"app": {"moe": {"min_draft_tokens": 0}}},
    "network policy unknown key": {"networkPolicy": {"enabled": True, "egress": []}},
}


@pytest.mark.parametrize("values", BAD_VALUES.values(), ids=list(BAD_VALUES))
def test_schema_rejects(helm, chart, values):
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(values)
    with pytest.raises(helm.HelmValuesError):
        chart.render(values, name="specserve", namespace="llm")


BAD_COMBINATIONS = {
    "exit below enter": ({"app": {"router": {"enter_threshold": 9}}}, "exit_threshold"),
    "auth create without token": ({"auth": {"create": True}}, "auth.token"),
    "auth create and existing": ({"auth": {"create": True, "token": "t", "existingSecret": "s"}},
                                 "exclusive"),
    "replicas over max": ({"targetWorkers": {"replicas": 3}}, "maxReplicas"),
    "same group names": ({"draftWorkers": {"groupName": "target"}}, "must differ"),
}


@pytest.mark.parametrize("values,message", BAD_COMBINATIONS.values(), ids=list(BAD_COMBINATIONS))
def test_template_checks_reject(helm, chart, values, message):
    with pytest.raises(helm.HelmRenderError, match=message):
        chart.render(values, name="specserve", namespace="llm")
