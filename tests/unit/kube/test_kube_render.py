"""Every rendered manifest is valid Kubernetes, hardened, and wired to the others (issue 12 items 1, 3);
TLS and tokens on every hop (issue 28 item 3): tests/unit/kube/test_kube_security.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kube_schemas import validate
from modelyard.config import validate_config
from modelyard.kube.render import render, template_names
from modelyard.kube.values import load_values, quantity

DEPLOY = Path(__file__).parents[3] / "deploy"
KUBERNETES = ("1.28.0", kubernetes_validate.latest_version())  # the oldest we support, the newest


def rendered(*files: str, tmp_path: Path | None = None, extra: str | None = None) -> list[dict[str, Any]]:
    paths = [DEPLOY / f for f in files]
    if extra is not None:
        assert tmp_path is not None
        paths.append(tmp_path / "extra.yaml")
        paths[-1].write_text(extra)
    return render(load_values(paths))


VALUES = {"defaults": ("values.yaml",), "production": ("values-production.yaml",)}


@pytest.fixture(params=sorted(VALUES))
def manifests(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return rendered(*VALUES[request.param])


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pods(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return list(doc["spec"]["template"]["spec"]["containers"])


@pytest.mark.parametrize("version", KUBERNETES)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(manifests, version):
    """Kubernetes' kinds strictly (no unknown field), cert-manager's against its v1 API."""
    for doc in manifests:
        validate(doc, version)


def test_every_role_is_there(manifests):
    kinds = {(d["kind"], d["metadata"]["name"]) for d in manifests}
    assert {
        ("Deployment", "modelyard-gateway"),
        ("Service", "modelyard-gateway"),
        ("ConfigMap", "modelyard-gateway"),
        ("HorizontalPodAutoscaler", "modelyard-gateway"),
        ("PodDisruptionBudget", "modelyard-gateway"),
        ("StatefulSet", "modelyard-scheduler"),
        ("Service", "modelyard-scheduler"),
    } <= kinds
    servers = [
        d for d in pods(manifests) if d["metadata"]["labels"]["app.kubernetes.io/component"] == "server"
    ]
    assert servers, "an inference server with its agent"
    for server in servers:  # each with the headless Service its StatefulSet names
        service = find(manifests, "Service", server["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None"


def test_every_container_is_non_root_read_only_bounded_and_probed(manifests):
    for doc in pods(manifests):
        pod = doc["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, doc["metadata"]["name"]
        assert pod["securityContext"]["runAsUser"] > 0
        assert pod["automountServiceAccountToken"] is False
        for container in containers(doc):
            where = f"{doc['metadata']['name']}/{container['name']}"
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["capabilities"] == {"drop": ["ALL"]}, where
            assert set(container["resources"]) == {"requests", "limits"}, where
            assert {"cpu", "memory"} <= set(container["resources"]["limits"]), where
            assert "readinessProbe" in container and "livenessProbe" in container, where


def probe_paths(doc: dict[str, Any]) -> set[tuple[str, str]]:
    found = set()
    for container in containers(doc):
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            get = container.get(kind, {}).get("httpGet")
            if get is not None:
                found.add((container["name"], get["path"]))
    return found


def test_probes_are_on_the_paths_each_role_serves(manifests):
    """The paths themselves are exercised against running servers in tests/integration/test_deploy.py."""
    assert probe_paths(find(manifests, "Deployment", "modelyard-gateway")) == {
        ("gateway", "/readyz"),
        ("gateway", "/healthz"),
    }
    assert probe_paths(find(manifests, "StatefulSet", "modelyard-scheduler")) == {
        ("scheduler", "/readyz"),
        ("scheduler", "/healthz"),
    }
    for server in [
        d for d in pods(manifests) if d["metadata"]["labels"]["app.kubernetes.io/component"] == "server"
    ]:
        assert probe_paths(server) == {
            ("mlserver", "/v2/health/ready"),
            ("mlserver", "/v2/health/live"),
            ("agent", "/agent/readyz"),
            ("agent", "/agent/livez"),
        }


def named_ports(doc: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in containers(doc) for p in c.get("ports", [])}


def service_port(docs: list[dict[str, Any]], address: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Service and the pods behind `[scheme://]host:port`, as cluster DNS and kube-proxy find them."""
    host, port = address.split("://")[-1].rsplit(":", 1)
    service = find(docs, "Service", host)
    (entry,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    selector = service["spec"]["selector"]
    (backing,) = [
        d for d in pods(docs) if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    target = entry["targetPort"]
    assert (target if isinstance(target, int) else named_ports(backing)[target]) in named_ports(
        backing
    ).values(), f"{address}: the Service's targetPort {target} is no container port"
    return service, backing


def gateway_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(
        find(docs, "ConfigMap", "modelyard-gateway")["data"]["gateway.yaml"]
    )
    return data


def test_the_gateway_reaches_redis_and_the_scheduler_through_services_the_render_creates():
    docs = rendered("values.yaml")
    config = gateway_config(docs)
    validate_config(config, "configmap")  # what the pod will load is a valid gateway config
    redis = config["state"]["url"].removeprefix("redis://").split("/")[0]
    _, backing = service_port(docs, redis)
    assert backing["metadata"]["name"] == "modelyard-redis"
    _, backing = service_port(docs, config["placement"]["scheduler"])
    assert backing["metadata"]["name"] == "modelyard-scheduler"
    assert named_ports(backing)["https"] == 9004  # TLS by default
    scheduler_args = containers(backing)[0]["args"]
    assert scheduler_args[scheduler_args.index("--port") + 1] == "9004"


def test_agents_subscribe_to_the_schedulers_agent_port_and_offer_mlservers_memory(manifests):
    for server in [
        d for d in pods(manifests) if d["metadata"]["labels"]["app.kubernetes.io/component"] == "server"
    ]:
        agent = {c["name"]: c for c in containers(server)}["agent"]
        args = agent["args"]
        _, backing = service_port(manifests, args[args.index("--scheduler") + 1])
        scheduler_args = containers(backing)[0]["args"]
        assert named_ports(backing)["agents"] == int(scheduler_args[scheduler_args.index("--agent-port") + 1])
        # 3/4 of MLServer's memory limit: the rest is MLServer's own
        limit = {c["name"]: c for c in containers(server)}["mlserver"]["resources"]["limits"]["memory"]
        assert int(args[args.index("--memory") + 1]) == int(quantity(limit) * 3 / 4)
        # gateways reach the agent by its pod's name under the headless Service
        name, namespace = server["metadata"]["name"], server["metadata"]["namespace"]
        assert args[args.index("--advertise-url") + 1] == f"https://$(POD_NAME).{name}.{namespace}.svc:9999"
        assert find(manifests, "Service", name)["spec"]["publishNotReadyAddresses"] is True
        # MLServer outlives the agent's drain, which fits in the pod's grace period
        mlserver = {c["name"]: c for c in containers(server)}["mlserver"]
        assert "/agent/livez" in mlserver["lifecycle"]["preStop"]["exec"]["command"][2]
        drain = int(args[args.index("--drain-timeout") + 1])
        assert server["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain
        assert args[args.index("--inference-url") + 1] == "http://127.0.0.1:8080"
        assert named_ports(server)["http"] == 8080
        assert args[args.index("--server") + 1] == server["metadata"]["name"]
        # the agent reads its capabilities back from the pod's labels
        volumes = {v["name"]: v for v in server["spec"]["template"]["spec"]["volumes"]}
        assert volumes["podinfo"]["downwardAPI"]["items"] == [
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}
        ]
        assert args[args.index("--capabilities-from") + 1] == "/etc/podinfo/labels"


def test_the_capabilities_become_pod_labels():
    docs = rendered("values-production.yaml")
    labels = find(docs, "StatefulSet", "gpu-pool")["spec"]["template"]["metadata"]["labels"]
    assert {k: v for k, v in labels.items() if k.startswith("capability.")} == {
        "capability.modelyard.io/huggingface": "true",
        "capability.modelyard.io/gpu": "true",
    }


def test_the_gateway_service_pod_ports_and_config_agree(manifests):
    config = validate_config(gateway_config(manifests), "configmap")
    deployment = find(manifests, "Deployment", "modelyard-gateway")
    ports = named_ports(deployment)
    assert ports["https"] == config.listen.port  # TLS by default
    service = find(manifests, "Service", "modelyard-gateway")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert by_name["https"]["targetPort"] == "https" and by_name["https"]["port"] == 443
    if config.listen.grpc_port is None:
        assert "grpc" not in ports and "grpc" not in by_name
    else:
        assert ports["grpc"] == config.listen.grpc_port and by_name["grpc"]["targetPort"] == "grpc"
    # the drain of SIGTERM fits in the grace period the pod is given
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= math.ceil(config.listen.drain_seconds + config.listen.shutdown_timeout)
    # the config is mounted where the container's command reads it
    (container,) = containers(deployment)
    mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["config"]
    assert container["args"] == ["serve", "--config", f"{mount}/gateway.yaml"]
    # the admin token comes from the Secret the values name
    (token,) = [e for e in container["env"] if e["name"] == "MODELYARD_ADMIN__TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "modelyard-admin", "key": "token"}
    # the HPA owns the count (a re-apply must not reset it)
    assert "replicas" not in deployment["spec"]
    # the HPA and PDB act on these pods
    hpa = find(manifests, "HorizontalPodAutoscaler", "modelyard-gateway")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "modelyard-gateway"
    pdb = find(manifests, "PodDisruptionBudget", "modelyard-gateway")
    assert (
        pdb["spec"]["selector"]["matchLabels"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )


def test_the_hpa_scales_on_requests_in_flight_when_asked():
    metrics = find(rendered("values.yaml"), "HorizontalPodAutoscaler", "modelyard-gateway")["spec"]["metrics"]
    assert [m["type"] for m in metrics] == ["Resource"]
    metrics = find(rendered("values-production.yaml"), "HorizontalPodAutoscaler", "modelyard-gateway")[
        "spec"
    ]["metrics"]
    assert metrics[1] == {
        "type": "Pods",
        "pods": {
            "metric": {"name": "modelyard_requests_in_flight"},
            "target": {"type": "AverageValue", "averageValue": "64"},
        },
    }


def test_an_existing_redis_replaces_the_deployed_one():
    docs = rendered("values-production.yaml")
    assert not [d for d in docs if "redis" in d["metadata"]["name"]]
    assert gateway_config(docs)["state"]["url"] == "redis://redis-master.platform.svc:6379/2"
    assert not [d for d in docs if d["kind"] == "Namespace"]  # create_namespace: false


def test_the_admin_secret_is_created_only_when_a_value_is_given(tmp_path):
    assert not [d for d in rendered("values.yaml") if d["kind"] == "Secret"]
    docs = rendered(
        "values.yaml", tmp_path=tmp_path, extra="gateway: {admin_token: {value: 0123456789abcdef}}"
    )
    secret = find(docs, "Secret", "modelyard-admin")
    assert secret["stringData"] == {"token": "0123456789abcdef"}
    kubernetes_validate.validate(secret, KUBERNETES[0], strict=True)
    assert "0123456789abcdef" not in yaml.safe_dump(find(docs, "ConfigMap", "modelyard-gateway"))


def test_workers_follow_the_cpu_limit_without_the_scheduler(tmp_path):
    """listen.workers "auto" would count the node's CPUs, not the pod's limit; with the scheduler,
    "auto" is one process."""
    assert gateway_config(rendered("values.yaml"))["listen"]["workers"] == "auto"
    docs = rendered(
        "values.yaml",
        tmp_path=tmp_path,
        extra="scheduler: {enabled: false}\nservers: []\ngateway: {resources: {limits: {cpu: 2500m}}}",
    )
    assert gateway_config(docs)["listen"]["workers"] == 3
    assert not [d for d in docs if "scheduler" in d["metadata"]["name"]]
    assert "placement" not in gateway_config(docs)


def test_a_config_change_rolls_the_gateways(tmp_path):
    def checksum(docs: list[dict[str, Any]]) -> str:
        template = find(docs, "Deployment", "modelyard-gateway")["spec"]["template"]
        value: str = template["metadata"]["annotations"]["modelyard.io/config-sha256"]
        return value

    first = checksum(rendered("values.yaml"))
    assert first == checksum(rendered("values.yaml"))
    assert first != checksum(
        rendered(
            "values.yaml", tmp_path=tmp_path, extra="gateway: {config: {limits: {max_body_bytes: 1000}}}"
        )
    )


def test_every_role_traces_to_the_collector_the_values_name():
    docs = rendered("values-production.yaml")
    assert gateway_config(docs)["telemetry"] == {
        "otlp_endpoint": "http://otel-collector.observability:4318",
        "sample_ratio": 0.1,
    }
    flags = ["--otlp-endpoint=http://otel-collector.observability:4318", "--trace-sample-ratio=0.1"]
    scheduler = containers(find(docs, "StatefulSet", "modelyard-scheduler"))[0]
    assert [a for a in scheduler["args"] if a.startswith(("--otlp", "--trace"))] == flags
    for name in ("cpu-pool", "gpu-pool"):
        agent = {c["name"]: c for c in containers(find(docs, "StatefulSet", name))}["agent"]
        assert [a for a in agent["args"] if a.startswith(("--otlp", "--trace"))] == flags
    # off by default: no flag, no config section
    docs = rendered("values.yaml")
    assert "telemetry" not in gateway_config(docs)
    assert not [a for d in pods(docs) for c in containers(d) for a in c.get("args", []) if "otlp" in a]


def test_without_autoscaling_the_deployment_has_its_replicas(tmp_path):
    docs = rendered(
        "values.yaml", tmp_path=tmp_path, extra="gateway: {replicas: 3, autoscaling: {enabled: false}}"
    )
    assert find(docs, "Deployment", "modelyard-gateway")["spec"]["replicas"] == 3
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]


def test_the_scheduler_statefulset_is_governed_by_a_headless_service(manifests):
    statefulset = find(manifests, "StatefulSet", "modelyard-scheduler")
    governing = find(manifests, "Service", statefulset["spec"]["serviceName"])
    assert governing["spec"]["clusterIP"] == "None"


def test_redis_evicts_before_its_limit():
    redis = containers(find(rendered("values.yaml"), "Deployment", "modelyard-redis"))[0]
    args = redis["args"]
    assert int(args[args.index("--maxmemory") + 1]) == int(
        quantity(redis["resources"]["limits"]["memory"]) * 3 / 4
    )
    assert args[args.index("--maxmemory-policy") + 1] == "allkeys-lru"


def selects(selector: dict[str, str], doc: dict[str, Any]) -> bool:
    return selector.items() <= doc["spec"]["template"]["metadata"]["labels"].items()


def test_network_policies_let_through_exactly_the_roles_that_talk():
    docs = rendered("values.yaml")
    by_name = {d["metadata"]["name"]: d for d in pods(docs)}
    redis = find(docs, "NetworkPolicy", "modelyard-redis")["spec"]
    assert selects(redis["podSelector"]["matchLabels"], by_name["modelyard-redis"])
    (rule,) = redis["ingress"]
    (peer,) = rule["from"]
    assert [n for n, d in by_name.items() if selects(peer["podSelector"]["matchLabels"], d)] == [
        "modelyard-gateway"
    ]
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]

    scheduler = find(docs, "NetworkPolicy", "modelyard-scheduler")["spec"]
    assert selects(scheduler["podSelector"]["matchLabels"], by_name["modelyard-scheduler"])
    rest, agents = scheduler["ingress"]
    assert rest["ports"] == [{"port": 9004, "protocol": "TCP"}]
    assert selects(rest["from"][0]["podSelector"]["matchLabels"], by_name["modelyard-gateway"])
    assert rest["from"][1]["podSelector"]["matchLabels"] == {"modelyard.io/scheduler-client": "true"}
    assert agents["ports"] == [{"port": 9005, "protocol": "TCP"}]
    (peer,) = agents["from"]
    assert [n for n, d in by_name.items() if selects(peer["podSelector"]["matchLabels"], d)] == ["mlserver"]

    # the servers' pods: only the agents' data plane, from the gateways (and labelled scrapers);
    # MLServer's own ports (its repository API) from nothing outside the pod
    servers = find(docs, "NetworkPolicy", "modelyard-servers")["spec"]
    assert [n for n, d in by_name.items() if selects(servers["podSelector"]["matchLabels"], d)] == [
        "mlserver"
    ]
    (rule,) = servers["ingress"]
    assert rule["ports"] == [{"port": 9999, "protocol": "TCP"}]
    agent_args = {c["name"]: c for c in containers(by_name["mlserver"])}["agent"]["args"]
    assert agent_args[agent_args.index("--port") + 1] == "9999"
    gateways, labelled = rule["from"]
    assert [n for n, d in by_name.items() if selects(gateways["podSelector"]["matchLabels"], d)] == [
        "modelyard-gateway"
    ]
    assert labelled["podSelector"]["matchLabels"] == {"modelyard.io/server-client": "true"}


def test_network_policies_can_be_left_out(tmp_path):
    docs = rendered("values.yaml", tmp_path=tmp_path, extra="network_policies: false")
    assert not [d for d in docs if d["kind"] == "NetworkPolicy"]


def test_the_render_knows_every_manifest_the_package_ships():
    """A file the render does not list would be a manifest no user ever gets (and no test checks)."""
    shipped = {p.name for p in (Path(__file__).parents[3] / "src/modelyard/kube/manifests").glob("*.yaml")}
    assert set(template_names()) == shipped
