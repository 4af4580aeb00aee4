"""Rendered objects against the schemas the API server would use.

The RayService against KubeRay's RayService CRD (tests/helm/data, reduced structural schema, see
its header) with unknown fields rejected, as server-side strict field validation does; its pod
templates and every core object against the core Kubernetes schemas (kubernetes-validate, strict:
unknown fields are errors), for the oldest and newest Kubernetes versions we claim.
"""
from __future__ import annotations

import copy

import jsonschema
import pytest
import yaml

from .conftest import DATA

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the dev extra) is not installed")

KUBE_VERSIONS = ("1.27.0", "1.37.0")  # gRPC probes are GA from 1.27; newest the package knows


def _crd() -> dict:
    return yaml.safe_load((DATA / "ray.io_rayservices.reduced.yaml").read_text())


def _strict(schema: dict) -> dict:
    """An openAPIV3Schema as JSON Schema that rejects fields the structural schema would prune."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (node.get("type") == "object" and "properties" in node
                    and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def _rayservice_schema() -> dict:
    (v1,) = [v for v in _crd()["spec"]["versions"] if v["name"] == "v1"]
    return _strict(v1["schema"]["openAPIV3Schema"])


def _validate_core(obj: dict) -> None:
    for version in KUBE_VERSIONS:
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as exc:  # the message names the path and the rule
            pytest.fail(f"{obj['kind']} {obj.get('metadata', {}).get('name')} invalid for "
                        f"Kubernetes {version}: {exc}")


def test_vendored_crd_is_a_valid_crd():
    crd = _crd()
    _validate_core(crd)
    assert crd["spec"]["group"] == "ray.io" and crd["spec"]["names"]["kind"] == "RayService"
    jsonschema.Draft7Validator.check_schema(_rayservice_schema())


def test_rayservice_matches_crd(rendered):
    rs = rendered.rayservice
    assert rs["apiVersion"] == "ray.io/v1"
    jsonschema.validate(rs, _rayservice_schema())


def test_crd_check_is_not_vacuous(rendered):
    """The CRD check rejects what the API server would: wrong types, missing fields, typos."""
    schema = _rayservice_schema()
    bad = copy.deepcopy(rendered.rayservice)
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    bad = copy.deepcopy(rendered.rayservice)
    del bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    bad = copy.deepcopy(rendered.rayservice)
    bad["spec"]["serveConfig"] = bad["spec"].pop("serveConfigV2")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_pod_templates_match_core_schema(rendered):
    for template in rendered.templates():
        _validate_core({"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": "ray-node"}, "template": template})


def test_core_objects_match_core_schema(rendered):
    core = [o for o in rendered.objects if o["kind"] != "RayService"]
    assert core, "expected at least the gRPC Service"
    for obj in core:
        _validate_core(obj)


def test_core_check_is_not_vacuous(rendered):
    template = copy.deepcopy(rendered.templates()[-1])
    template["spec"]["containers"][0]["readinessProbe"] = {"grpc": {"port": "grpc"}}  # must be int
    with pytest.raises(kv.ValidationError):
        kv.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
                     "template": template}, KUBE_VERSIONS[-1], strict=True)
