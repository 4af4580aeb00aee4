"""What the chart renders: the Serve config the RayService carries (parsed by Ray's own
ServeDeploySchema, its args built into the app's AppConfig), the Ray groups per placement, the
pods' environment, probes and the Services."""
from __future__ import annotations

import importlib

import pytest

from .conftest import CHART, NAMESPACE, RELEASE, REPO

SERVICERS = ["cluster.api.stubs.add_GenerationServicer_to_server",
             "cluster.api.stubs.add_HealthServicer_to_server"]


def _app_config_cls():
    """The app's own argument model, the one `deployments.app:build` validates its args with."""
    return importlib.import_module("deployments.app_config").AppConfig


def _assert_subset(rendered, built, path="args"):
    """Every value the chart rendered arrives unchanged in the built config."""
    if isinstance(rendered, dict):
        assert isinstance(built, dict), path
        for key, value in rendered.items():
            assert key in built, f"{path}.{key} dropped by AppConfig"
            _assert_subset(value, built[key], f"{path}.{key}")
    else:
        assert rendered == built, f"{path}: rendered {rendered!r}, AppConfig holds {built!r}"


def _schema_keys(node, prefix=""):
    keys = set()
    for key, sub in node.get("properties", {}).items():
        keys.add(prefix + key)
        keys |= _schema_keys(sub, f"{prefix}{key}.")
    return keys


def _model_keys(cls, prefix=""):
    from pydantic import BaseModel
    keys = set()
    for key, field in cls.model_fields.items():
        keys.add(prefix + key)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys |= _model_keys(ann, f"{prefix}{key}.")
    return keys


def _container(template: dict) -> dict:
    (container,) = template["spec"]["containers"]
    return container


def _env(template: dict) -> dict:
    return {e["name"]: e for e in _container(template)["env"]}


def test_serve_config_is_a_valid_ray_serve_config(rendered):
    schema = pytest.importorskip("ray.serve.schema")
    cfg = schema.ServeDeploySchema.model_validate(rendered.serve_config)
    assert cfg.grpc_options.port == 9000
    assert cfg.http_options.host == "0.0.0.0" and cfg.http_options.port == 8000
    assert cfg.grpc_options.grpc_servicer_functions == SERVICERS
    assert cfg.proxy_location.value == "EveryNode"  # workers answer their own gRPC probes
    (app,) = cfg.applications
    assert (app.name, app.route_prefix, app.import_path) == ("specserve", "/", "deployments.app:build")


def test_app_args_build_app_config(rendered):
    args = rendered.app_args
    config = _app_config_cls().model_validate(args)
    _assert_subset(args, config.model_dump(mode="json"))
    values_app = rendered.values.get("app", {})
    for key in ("model", "drafter", "placement", "num_draft_tokens"):
        if key in values_app:
            assert args[key] == values_app[key]
    secret = rendered.values.get("auth", {})
    with_secret = bool(secret.get("create") or secret.get("existingSecret"))
    # token_env only when a Secret fills the variable: the Router refuses a named, empty one
    assert args["auth"] == {"token_env": "SPECSERVE_AUTH_TOKEN" if with_secret else None}
    assert config.auth.token_env == args["auth"]["token_env"]


# AppConfig knobs the chart deliberately does not expose.
NOT_IN_CHART = {"engine_impl", "engine_impl.cls", "engine_impl.options"}
# ... and the ones the chart derives from other values instead of `app`.
DERIVED = {"auth", "auth.token_env", "telemetry", "telemetry.otlp_endpoint",
           "telemetry.sampling_ratio", "telemetry.service_name", "telemetry.enabled"}


def test_values_schema_covers_app_config_exactly():
    """`app` in values.schema.json and AppConfig name the same knobs: the chart can set every
    knob of the app, and nothing the app would refuse."""
    import json
    schema = json.loads((CHART / "values.schema.json").read_text())
    chart_keys = _schema_keys(schema["properties"]["app"]) | DERIVED
    app_keys = _model_keys(_app_config_cls()) - NOT_IN_CHART
    assert chart_keys - app_keys == set(), "in the chart's schema but not in AppConfig"
    assert app_keys - chart_keys == set(), "AppConfig knobs the chart cannot set"


def test_extra_app_knobs_pass_through(render):
    knobs = {"router": {"min_alpha_samples": 16},
             "spec_engine": {"max_num_seqs": 4, "kv_cache_memory_mb": 1024},
             "draft_server": {"timeout_s": 0.5, "max_sequences": 64, "port": 0},
             "router_deployment": {"num_gpus": 0},
             "moe": {"probe_every": 4, "min_draft_tokens": 128, "alpha_threshold": 0.4, "validated": False}}
    r = render({"app": knobs})
    config = _app_config_cls().model_validate(r.app_args).model_dump(mode="json")
    _assert_subset(knobs, config)


def test_servicer_functions_import_and_match_the_app():
    stubs = importlib.import_module("cluster.api.stubs")
    assert SERVICERS == stubs.GRPC_SERVICER_FUNCTIONS
    for path in SERVICERS:
        module, _, func = path.rpartition(".")
        assert callable(getattr(importlib.import_module(module), func)), path


def test_serve_config_agrees_with_the_apps_own(render):
    """The chart's serve config and deployments/serve_config.yaml (what `serve deploy` runs
    locally) name the same gRPC port, servicers, app and argument keys."""
    import yaml
    own = yaml.safe_load((REPO / "deployments" / "serve_config.yaml").read_text())
    ours = render({}).serve_config
    assert ours["grpc_options"] == own["grpc_options"]
    (own_app,), (our_app,) = own["applications"], ours["applications"]
    assert (our_app["name"], our_app["import_path"]) == (own_app["name"], own_app["import_path"])
    assert set(our_app["args"]) == set(own_app["args"]) - NOT_IN_CHART


def test_default_is_one_small_gpu_node(render):
    r = render({})
    assert list(r.groups()) == ["target"]
    gpus = _container(r.groups()["target"]["template"])["resources"]["limits"]["nvidia.com/gpu"]
    assert gpus == 1
    args = r.app_args
    assert args["placement"] == "shared" and args["model"] == "default"
    assert args["spec_engine"]["num_gpus"] + args["batch_engine"]["num_gpus"] <= gpus
    head = r.rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no replicas on the head
    assert "nvidia.com/gpu" not in _container(head["template"])["resources"].get("limits", {})


def _cpus(quantity) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_replicas_fit_the_workers(rendered):
    """Ray resources the deployments ask for fit in the worker groups (head runs none)."""
    args = rendered.app_args
    deployments = ["router_deployment", "spec_engine", "batch_engine"]
    if args["placement"] == "separate":
        deployments.append("draft_server")
    need_cpu = sum(args[d]["num_replicas"] * args[d]["num_cpus"] for d in deployments)
    need_gpu = sum(args[d]["num_replicas"] * args[d].get("num_gpus", 0) for d in deployments)
    have_cpu = have_gpu = 0.0
    for group in rendered.groups().values():
        limits = _container(group["template"])["resources"]["limits"]
        have_cpu += group["replicas"] * _cpus(limits["cpu"])
        have_gpu += group["replicas"] * float(limits.get("nvidia.com/gpu", 0))
    assert need_cpu <= have_cpu and need_gpu <= have_gpu
    for d in ("spec_engine", "batch_engine"):  # fractional GPUs must pack on one worker's GPUs
        assert args[d]["num_gpus"] <= 1


def test_cpu_example_has_no_gpus(render):
    from .conftest import load_example
    r = render(load_example("values-cpu.yaml"))
    for template in r.templates():
        resources = _container(template)["resources"]
        assert not any("gpu" in k for part in resources.values() for k in part)
        assert "tolerations" not in template["spec"]
    args = r.app_args
    assert args["dtype"] == "float32" and args["model"] == "default" and args["placement"] == "shared"
    assert all(args[d]["num_gpus"] == 0 for d in ("spec_engine", "batch_engine", "draft_server"))


def test_separate_placement_adds_a_draft_group(render):
    from .conftest import load_example
    r = render(load_example("values-separate.yaml"))
    groups = r.groups()
    assert list(groups) == ["target", "draft"]
    assert r.app_args["placement"] == "separate"
    assert _container(groups["draft"]["template"])["resources"]["limits"]["nvidia.com/gpu"] == 1
    # the engines fill the target GPU, so a one-GPU draft server can only land on the draft group
    args = r.app_args
    assert args["spec_engine"]["num_gpus"] + args["batch_engine"]["num_gpus"] == 1
    assert args["draft_server"]["num_gpus"] == 1
    assert list(render({}).groups()) == ["target"]  # shared: no draft group


def test_auth_token_from_secret(render):
    r = render({"auth": {"existingSecret": "tokens", "secretKey": "api"}})
    for template in r.templates():
        ref = _env(template)["SPECSERVE_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "tokens", "key": "api"}
    assert not r.of_kind("Secret")
    created = render({"auth": {"create": True, "token": "s3cret"}})
    secret = created.one("Secret")
    assert secret["stringData"] == {"token": "s3cret"}
    ref = _env(created.templates()[0])["SPECSERVE_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"]
    assert all("SPECSERVE_AUTH_TOKEN" not in _env(t) for t in render({}).templates())
    assert r.app_args["auth"] == created.app_args["auth"] == {"token_env": "SPECSERVE_AUTH_TOKEN"}
    assert render({}).app_args["auth"] == {"token_env": None}  # no Secret: auth off in the app too


def _head(r) -> dict:
    return r.rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]


def test_dashboard_and_client_closed_by_default(rendered):
    """The dashboard runs jobs and the Ray client port runs code: by default no Service or named
    port exposes either, and the NetworkPolicy admits only the KubeRay operator (which deploys the
    serve config through the dashboard) and the release's own pods to the dashboard."""
    head = _head(rendered)
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"  # the operator must reach it
    policy = rendered.one("NetworkPolicy", RELEASE)
    (rule,) = _rule_for(policy, 8265)
    # named peers only (the defaults name the operator; the "full" scenario its own namespace)
    assert rule["from"] and all(peer and peer != {"namespaceSelector": {}} for peer in rule["from"])
    assert _rule_for(policy, 10001) == []
    for template in rendered.templates():
        names = {p["containerPort"] for p in _container(template)["ports"]}
        assert not names & {8265, 10001}, template["metadata"]["labels"]["app.kubernetes.io/component"]
    for svc in rendered.of_kind("Service"):
        ports = {p["port"] for p in svc["spec"]["ports"]} | {p.get("targetPort") for p in svc["spec"]["ports"]}
        assert not ports & {8265, 10001, "dashboard", "client"}, svc["metadata"]["name"]
    for group in rendered.groups().values():  # workers run no dashboard of their own
        assert "dashboard-host" not in group["rayStartParams"]


def test_dashboard_on_loopback(render):
    loopback = render({"head": {"dashboardHost": "127.0.0.1"}})
    assert _head(loopback)["rayStartParams"]["dashboard-host"] == "127.0.0.1"


def test_dashboard_opt_in(render):
    opened = render({"head": {"dashboardHost": "0.0.0.0", "exposeDashboard": True, "exposeClient": True}})
    assert _head(opened)["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in _container(_head(opened)["template"])["ports"]}
    assert ports["dashboard"] == 8265 and ports["client"] == 10001
    # the user's own rayStartParams win over the chart's default
    own = render({"head": {"rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"}}})
    assert _head(own)["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert "0.0.0.0" in own.manifests["specserve/templates/NOTES.txt"]


NETPOL_PEERS = {
    "grpc": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
    "http": [{"ipBlock": {"cidr": "10.0.0.0/8"}}],
    "metrics": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                 "podSelector": {"matchLabels": {"app": "prometheus"}}}],
    "dashboard": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay"}}}],
}


def _rule_for(policy: dict, port: int) -> list[dict]:
    return [r for r in policy["spec"]["ingress"] if any(p["port"] == port for p in r.get("ports", []))]


def test_network_policy_can_be_turned_off(render):
    assert render({}).of_kind("NetworkPolicy")
    assert not render({"networkPolicy": {"enabled": False}}).of_kind("NetworkPolicy")


def test_network_policy_defaults(render):
    r = render({})
    policy = r.one("NetworkPolicy", RELEASE)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    selector = policy["spec"]["podSelector"]["matchLabels"].items()
    for template in r.templates():  # every Ray pod of the release is covered
        assert selector <= template["metadata"]["labels"].items()
    (grpc_rule,) = _rule_for(policy, 9000)
    assert "from" not in grpc_rule  # gRPC from anywhere
    (http_rule,) = _rule_for(policy, 8000)
    assert "from" not in http_rule  # the OpenAI-compatible HTTP API from anywhere
    # Ray between the release's own pods, on every port
    (internal,) = [rule for rule in policy["spec"]["ingress"] if "ports" not in rule]
    (peer,) = internal["from"]
    assert peer["podSelector"]["matchLabels"].items() == selector
    # metrics: nobody outside the release unless named; dashboard: the KubeRay operator only
    assert _rule_for(policy, 8080) == []
    (dashboard,) = _rule_for(policy, 8265)
    assert [p["podSelector"]["matchLabels"] for p in dashboard["from"]] == [
        {"app.kubernetes.io/name": "kuberay-operator"}]
    assert len(policy["spec"]["ingress"]) == 4


def test_network_policy_selectors(render):
    r = render({"networkPolicy": {"enabled": True, **{k: {"from": v} for k, v in NETPOL_PEERS.items()}},
                "serve": {"grpcPort": 9100, "httpPort": 8100}, "metrics": {"port": 9091}})
    policy = r.one("NetworkPolicy", RELEASE)
    for port, key in ((9100, "grpc"), (8100, "http"), (9091, "metrics"), (8265, "dashboard")):
        (rule,) = _rule_for(policy, port)
        assert rule["from"] == NETPOL_PEERS[key], key
    # metrics off: no metrics rule even with peers named
    off = render({"networkPolicy": {"enabled": True, "metrics": {"from": NETPOL_PEERS["metrics"]}},
                  "metrics": {"enabled": False}})
    assert _rule_for(off.one("NetworkPolicy"), 8080) == []


def test_tracing_env_and_args_agree(render):
    r = render({"tracing": {"otlpEndpoint": "http://collector.obs:4317", "samplingRatio": 0.25,
                            "serviceName": "llm"}})
    assert r.app_args["telemetry"] == {"otlp_endpoint": "http://collector.obs:4317",
                                       "sampling_ratio": 0.25, "service_name": "llm", "enabled": True}
    for template in r.templates():
        env = _env(template)
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://collector.obs:4317"
        assert env["OTEL_TRACES_SAMPLER"]["value"] == "parentbased_traceidratio"
        assert env["OTEL_TRACES_SAMPLER_ARG"]["value"] == "0.25"
        assert env["OTEL_SERVICE_NAME"]["value"] == "llm"
    off = render({})
    assert off.app_args["telemetry"]["otlp_endpoint"] is None
    # tracing on without an endpoint: unset, i.e. off (the app refuses enabled=true without one)
    assert off.app_args["telemetry"]["enabled"] is None
    assert render({"tracing": {"enabled": False}}).app_args["telemetry"]["enabled"] is False
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in _env(off.templates()[0])


def test_jaeger_toggle(render):
    r = render({"jaeger": {"enabled": True}})
    deployment = r.one("Deployment")
    service = r.one("Service", f"{RELEASE}-jaeger")
    assert {p["port"] for p in service["spec"]["ports"]} == {16686, 4317, 4318}
    jaeger_env = {e["name"]: e["value"] for e in _container(deployment["spec"]["template"])["env"]}
    assert jaeger_env["COLLECTOR_OTLP_ENABLED"] == "true"
    endpoint = f"http://{RELEASE}-jaeger.{NAMESPACE}.svc:4317"
    assert r.app_args["telemetry"]["otlp_endpoint"] == endpoint
    assert _env(r.templates()[1])["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == endpoint
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    # an explicit endpoint wins over the bundled Jaeger
    both = render({"jaeger": {"enabled": True}, "tracing": {"otlpEndpoint": "http://c:4317"}})
    assert both.app_args["telemetry"]["otlp_endpoint"] == "http://c:4317"
    assert not render({}).of_kind("Deployment")


def test_probes_reflect_engine_health(rendered):
    rc = rendered.rayservice["spec"]["rayClusterConfig"]
    head = _container(rc["headGroupSpec"]["template"])
    # KubeRay deploys the app only once the head is Ready: its probes stay KubeRay's own
    assert "readinessProbe" not in head and "livenessProbe" not in head
    liveness = rendered.values.get("probes", {}).get("liveness", {}).get("enabled", False)
    for group in rc["workerGroupSpecs"]:
        worker = _container(group["template"])
        assert worker["readinessProbe"]["grpc"] == {"port": 9000, "service": ""}
        assert ("livenessProbe" in worker) == liveness
        if liveness:
            assert worker["livenessProbe"]["grpc"]["port"] == 9000
            assert worker["startupProbe"]["grpc"]["port"] == 9000
        ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
        assert ports["grpc"] == 9000


def test_grpc_service_selects_worker_pods(rendered):
    svc = rendered.one("Service", RELEASE)
    grpc_port, http_port = svc["spec"]["ports"]
    assert (grpc_port["port"], grpc_port["targetPort"], grpc_port["appProtocol"]) == (9000, "grpc", "grpc")
    # the OpenAI-compatible HTTP API: the Serve HTTP proxy of the same worker pods
    assert (http_port["port"], http_port["targetPort"], http_port["appProtocol"]) == (8000, "http", "http")
    selector = svc["spec"]["selector"].items()
    rc = rendered.rayservice["spec"]["rayClusterConfig"]
    assert rendered.serve_config["http_options"]["port"] == 8000
    for group in rc["workerGroupSpecs"]:
        assert selector <= group["template"]["metadata"]["labels"].items()
        ports = {p["name"]: p["containerPort"] for p in _container(group["template"])["ports"]}
        assert ports["http"] == 8000  # the Service's targetPort "http" names the Serve HTTP port
    assert not selector <= rc["headGroupSpec"]["template"]["metadata"]["labels"].items()
    head_ports = {p["name"]: p["containerPort"] for p in _container(rc["headGroupSpec"]["template"])["ports"]}
    assert head_ports["serve"] == 8000  # KubeRay's serve-svc and proxy health check need it


def test_metrics_service(render):
    r = render({"metrics": {"service": {"enabled": True}}})
    svc = r.one("Service", f"{RELEASE}-metrics")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["ports"][0]["port"] == 8080
    for template in r.templates():
        assert svc["spec"]["selector"].items() <= template["metadata"]["labels"].items()
        assert {"name": "metrics", "containerPort": 8080} in _container(template)["ports"]
    assert r.rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"][
        "metrics-export-port"] == "8080"
    off = render({"metrics": {"enabled": False}})
    assert not any(p["name"] == "metrics" for t in off.templates() for p in _container(t)["ports"])


def test_image_and_placement_knobs(render):
    r = render({"image": {"repository": "registry.local/specserve", "tag": "1.2.3", "pullPolicy": "Always"},
                "targetWorkers": {"nodeSelector": {"gpu": "l4"}}})
    for template in r.templates():
        c = _container(template)
        assert c["image"] == "registry.local/specserve:1.2.3" and c["imagePullPolicy"] == "Always"
    assert r.groups()["target"]["template"]["spec"]["nodeSelector"] == {"gpu": "l4"}
    default = render({})
    assert _container(default.templates()[0])["image"] == "specserve:0.1.0"


def test_notes_tell_how_to_call(rendered):
    notes = rendered.manifests["specserve/templates/NOTES.txt"]
    assert 'specserve client --addr' in notes
    assert f"{RELEASE}.{NAMESPACE}.svc:9000" in notes


def test_proxy_message_cap_matches_the_app(rendered):
    """Ray Serve's gRPC proxy reads up to 2 GiB by default: every Ray pod caps it at what the app
    computes from its own limits."""
    from deployments.app_config import PROXY_MAX_MESSAGE_ENV, AppConfig

    want = str(AppConfig(**rendered.app_args).proxy_max_message_bytes())
    for template in rendered.templates():
        assert _env(template)[PROXY_MAX_MESSAGE_ENV]["value"] == want


def test_proxy_gets_the_local_services_time_to_start(rendered):
    """Every Ray pod gives Serve's proxy the readiness time ``specserve serve`` gives it locally."""
    from deployments.local import SLOW_START_ENV

    for template in rendered.templates():
        env = _env(template)
        for key, value in SLOW_START_ENV.items():
            assert env[key]["value"] == value
